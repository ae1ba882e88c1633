"""Agent traffic over the OpenAI HTTP API, driven by the official `openai` SDK against live servers,
aggregated and disaggregated: `chat.completions.parse` with a pydantic model, tools under each
tool_choice (streamed and not), a tool-result turn, continuous usage, and refusals that name the
parameter the client sent while the server keeps serving and leaks nothing.

A tiny random-weight model writes noise unless a grammar holds it, so every answer that validates here
was made so by the constraint; `auto` can only be checked to be served (the parsers' own tests force
the model formats).
"""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from conftest import save_tiny_model, wait_until
from pydantic import BaseModel, Field
from test_disagg_serving import RunningPrefill
from test_openai_api import MODEL, Server, published_schemas

from decode_service.server import DecodeServer
from engine.model_store import model_fingerprint

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": ["integer", "null"]}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "add", "description": "Add numbers", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 1.0, "seed": 11}


class Forecast(BaseModel):
    city: str = Field(min_length=1, max_length=12)
    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=1, le=7)
    note: str | None = Field(max_length=6)


class DisaggregatedServer(Server):
    """The HTTP test server with its prompts prefilled by a prefill server."""

    def __init__(self, model_dir, prefill: RunningPrefill, **config_kwargs) -> None:
        self._fingerprint = model_fingerprint(model_dir)
        super().__init__(model_dir, prefill=prefill.address, **config_kwargs)

    async def _create(self, config) -> DecodeServer:
        return DecodeServer(self.engine, config, model_fingerprint=self._fingerprint)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-agent-model")
    save_tiny_model(directory, 13)
    return directory


@pytest.fixture(scope="module", params=["aggregated", "disaggregated"])
def server(request, model_dir):
    if request.param == "aggregated":
        running = Server(model_dir, tool_call_parser="hermes")
        yield running
        running.close()
        return
    prefill = RunningPrefill(model_dir, block_size=8)
    running = DisaggregatedServer(model_dir, prefill, tool_call_parser="hermes")
    yield running
    running.close()
    assert prefill.prefilled_request_ids(), "the prompts were prefilled by the prefill server"
    assert wait_until(prefill.pool_is_full)
    prefill.close()


def create(server: Server, **kwargs):
    return server.client.chat.completions.create(
        model=MODEL,
        messages=kwargs.pop("messages", MESSAGES),
        max_tokens=kwargs.pop("max_tokens", 160),
        **kwargs,
    )


def assert_valid_calls(calls: list[dict], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
        assert call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def streamed(stream) -> tuple[str, list[dict], str, list]:
    """(content, calls, finish reason, chunks) of a stream, the calls put together as an SDK would."""
    content, calls, finish, chunks = [], {}, None, []
    for chunk in stream:
        chunks.append(chunk)
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content.append(choice.delta.content or "")
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:
                assert delta.id and delta.function.name, "a call's first delta has its id and name"
                function = {"name": delta.function.name, "arguments": ""}
                calls[delta.index] = {"id": delta.id, "type": delta.type, "function": function}
            calls[delta.index]["function"]["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return "".join(content), [calls[i] for i in sorted(calls)], finish, chunks


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_parse_with_a_pydantic_model(server, sampling):
    completion = server.client.chat.completions.parse(
        model=MODEL, messages=MESSAGES, response_format=Forecast, max_tokens=200, **sampling
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Forecast)
    jsonschema.validate(json.loads(message.content), Forecast.model_json_schema())


def test_streamed_json_schema_and_continuous_usage(server):
    stream = create(
        server,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": WEATHER, "strict": True},
        },
        **SAMPLED,
    )
    content, calls, finish, chunks = streamed(stream)
    jsonschema.validate(json.loads(content), WEATHER)
    assert finish == "stop" and not calls
    usages = [chunk.usage for chunk in chunks]
    assert all(usage is not None and usage.prompt_tokens > 0 for usage in usages)
    counts = [usage.completion_tokens for usage in usages]
    assert counts == sorted(counts) and counts[-1] == counts[-2] > 0


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_tool_choice_required_returns_valid_calls(server, sampling):
    _, validator = published_schemas(server)
    completion = create(server, tools=TOOLS, tool_choice="required", **sampling)
    validator("ChatCompletion").validate(completion.to_dict())
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert_valid_calls([call.model_dump() for call in choice.message.tool_calls], set(SCHEMAS))
    _, calls, finish, chunks = streamed(
        create(server, tools=TOOLS, tool_choice="required", stream=True, **sampling)
    )
    for chunk in chunks:
        validator("ChatCompletionChunk").validate(chunk.to_dict())
    assert finish == "tool_calls"
    assert_valid_calls(calls, set(SCHEMAS))
    one = create(server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, **sampling)
    assert len(one.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_tool_choice_calls_that_function(server, stream):
    choice = {"type": "function", "function": {"name": "add"}}
    if stream:
        _, calls, finish, _ = streamed(
            create(server, tools=TOOLS, tool_choice=choice, stream=True, **SAMPLED)
        )
    else:
        completion = create(server, tools=TOOLS, tool_choice=choice, **SAMPLED)
        finish = completion.choices[0].finish_reason
        calls = [call.model_dump() for call in completion.choices[0].message.tool_calls]
    assert finish == "tool_calls"
    assert len(calls) == 1
    assert_valid_calls(calls, {"add"})


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_none_and_auto_are_served(server, stream):
    for tool_choice in ("none", "auto"):
        kwargs = {"tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 12, **GREEDY}
        if stream:
            content, calls, finish, _ = streamed(create(server, stream=True, **kwargs))
        else:
            choice = create(server, **kwargs).choices[0]
            content, calls, finish = choice.message.content, choice.message.tool_calls, choice.finish_reason
        assert finish in ("length", "stop", "tool_calls")
        if tool_choice == "none":
            assert content and not calls and finish == "length"


def test_a_tool_result_turn(server):
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = create(server, tools=TOOLS, tool_choice=named, **SAMPLED)
    assistant = first.choices[0].message
    result = {"role": "tool", "tool_call_id": assistant.tool_calls[0].id, "content": '{"temperature": 21}'}
    messages = [*MESSAGES, assistant.model_dump(exclude_none=True), result]
    assert messages[1]["tool_calls"] and "content" not in messages[1]
    # Seeded and past EOS: an unseeded answer once sampled EOS within its 8 tokens ("stop").
    answer = create(
        server,
        messages=[*MESSAGES, assistant, result],
        tools=TOOLS,
        tool_choice="none",
        max_tokens=8,
        extra_body={"ignore_eos": True},
        **SAMPLED,
    )
    assert answer.choices[0].message.content and answer.choices[0].finish_reason == "length"
    again = create(server, messages=messages, tools=TOOLS, tool_choice="required", **GREEDY)
    assert_valid_calls([call.model_dump() for call in again.choices[0].message.tool_calls], set(SCHEMAS))


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"extra_body": {"guided_json": {"type": "nonsense"}}}, "guided_json"),
        ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs.regex"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (
            {
                "tools": [
                    TOOLS[0],
                    {"type": "function", "function": {"name": "bad", "parameters": {"type": 3}}},
                ],
                "tool_choice": "required",
            },
            "tools[1].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "required"},
            "tools[0].function.name",
        ),
    ],
)
def test_bad_constraints_get_a_400_naming_the_param_while_others_are_served(server, kwargs, param):
    good = create(server, stream=True, max_tokens=120, **GREEDY)
    first = next(good)
    with pytest.raises(openai.BadRequestError) as error:
        create(server, **kwargs)
    body = error.value.body
    assert body["param"] == param, body
    assert body["message"].startswith(param), body
    assert [first, *good][-1].choices[0].finish_reason == "length"
    assert wait_until(server.idle), "a refused request still holds KV blocks or a slot"


# About 3 s to compile on a 2-core host (tiny vocabulary), far past the timeout below; it parses at once.
SLOW_REGEX = "(" + "|".join(f"[a-z]{{{i}}}x" for i in range(1, 1600)) + ")"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_constraint_the_core_cannot_compile_in_time_gets_a_400_streamed_or_not(model_dir, stream):
    """The core's refusal arrives before the first token, so a stream answers it with a 400 too, not a
    200 and an error event; the server keeps serving."""
    server = Server(model_dir, structured_output_compile_timeout_s=0.5)
    try:
        with pytest.raises(openai.BadRequestError) as error:
            answer = create(server, stream=stream, extra_body={"structured_outputs": {"regex": SLOW_REGEX}})
            list(answer) if stream else answer
        body = error.value.body
        assert body["param"] == "structured_outputs.regex", body
        assert body["message"].startswith("structured_outputs.regex: did not compile within 0.5 s"), body
        good = create(server, stream=stream, max_tokens=4, extra_body={"structured_outputs": {"regex": "ok"}})
        text = (
            "".join(chunk.choices[0].delta.content or "" for chunk in good)
            if stream
            else good.choices[0].message.content
        )
        assert text == "ok"
        assert wait_until(server.idle)
    finally:
        server.close()
