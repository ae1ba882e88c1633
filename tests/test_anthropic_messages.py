"""Anthropic's Messages API on the HTTP front door: the translation of a body into a chat request, the
message and event stream built from the engine's messages, and refusals of every field; then the
official `anthropic` SDK against a live server with the real default model, aggregated and
disaggregated: a plain message, a streamed one, a forced tool call whose input validates against its
schema, a tool-result turn and count_tokens against the prompt's real token count."""

from __future__ import annotations

import http.client
import json

import anthropic
import jsonschema
import pytest
from conftest import wait_until
from starlette.requests import Request
from test_disagg_serving import RunningPrefill
from test_openai_agent import DisaggregatedServer
from test_openai_api import MODEL, Server, published_schemas

from decode_service.front_door.admission import RequestLimits
from decode_service.front_door.openai_http.anthropic_protocol import translate_count, translate_message
from decode_service.front_door.openai_http.anthropic_responses import MessageBuilder
from decode_service.front_door.openai_http.errors import (
    BodyTooLargeError,
    FieldError,
    ModelNotServedError,
    UnauthorizedError,
    anthropic_error,
    http_error,
)
from decode_service.front_door.openai_http.request_io import ApiKeys
from protos.tandem.v1 import generation_pb2 as pb
from serving.errors import QueueFullError

LIMITS = RequestLimits()
KEY = "test-key"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOL = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Sampling fields the SDK no longer takes as arguments (the API still does).
GREEDY = {"temperature": 0}


def body(**fields) -> dict:
    return {"model": MODEL, "max_tokens": 16, "messages": ASK, **fields}


# -- translation ---------------------------------------------------------------------------------------


def test_a_conversation_becomes_chat_turns_with_its_blocks_in_place():
    request = translate_message(
        body(
            system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
            messages=[
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "a tool knows", "signature": "s"},
                        {"type": "text", "text": "Let me look."},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "get_weather",
                            "input": {"city": "Oslo"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "9C"}],
                        },
                        {"type": "text", "text": "And tomorrow?"},
                    ],
                },
            ],
            tools=[TOOL],
            stop_sequences=["\n\n"],
            temperature=0.5,
            top_p=0.9,
            top_k=40,
            metadata={"user_id": "alice"},
        ),
        LIMITS,
    )
    turns = [(m.role, m.content) for m in request.generate.messages]
    assert turns == [
        ("system", "Be brief.\nBe kind."),
        ("user", "Weather?"),
        ("assistant", "Let me look."),  # earlier thinking is left out, as chat templates leave it
        ("tool", "9C"),
        ("user", "And tomorrow?"),
    ]
    (call,) = request.generate.messages[2].tool_calls
    assert (call.id, call.name, json.loads(call.arguments)) == ("toolu_1", "get_weather", {"city": "Oslo"})
    assert request.generate.messages[3].tool_call_id == "toolu_1"
    assert json.loads(request.generate.tools[0].parameters_json) == WEATHER
    assert not request.generate.HasField("tool_choice"), "unset: auto with tools, as the chat route"
    generate = request.generate
    assert list(generate.stopping.stop) == ["\n\n"] and generate.stopping.max_tokens == 16
    assert (generate.sampling.temperature, generate.sampling.top_k) == (0.5, 40)
    assert generate.sampling.top_p == pytest.approx(0.9)
    assert generate.tenant == "alice"
    # A chat field named by a later error is the block the client sent.
    assert request.param_for("messages[2].tool_calls[0].arguments") == "messages[1].content[2].input"
    assert request.param_for("messages[3].content") == "messages[2].content[0].content"
    assert request.param_for("messages[0].content") == "system.content"
    assert request.param_for("tools[0].parameters_json") == "tools[0].input_schema"
    assert request.param_for("tool_choice.function_name") == "tool_choice"


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, pb.ToolChoice(mode=pb.TOOL_CHOICE_AUTO)),
        ({"type": "any"}, pb.ToolChoice(mode=pb.TOOL_CHOICE_REQUIRED)),
        ({"type": "none"}, pb.ToolChoice(mode=pb.TOOL_CHOICE_NONE)),
        ({"type": "tool", "name": "get_weather"}, pb.ToolChoice(function_name="get_weather")),
    ],
)
def test_each_tool_choice_maps_onto_the_chat_modes(choice, expected):
    request = translate_message(body(tools=[TOOL], tool_choice=choice), LIMITS).generate
    assert request.tool_choice == expected
    assert not request.HasField("parallel_tool_calls")
    parallel = translate_message(
        body(tools=[TOOL], tool_choice={**choice, "disable_parallel_tool_use": True}), LIMITS
    )
    assert parallel.generate.parallel_tool_calls is False


def test_thinking_switches_the_templates_thinking_and_count_tokens_takes_the_prompt_fields():
    enabled = translate_message(body(thinking={"type": "enabled", "budget_tokens": 1024}), LIMITS)
    assert json.loads(enabled.generate.chat_template_kwargs_json) == {"enable_thinking": True}
    adaptive = translate_message(body(thinking={"type": "adaptive", "display": "summarized"}), LIMITS)
    assert json.loads(adaptive.generate.chat_template_kwargs_json) == {"enable_thinking": True}
    disabled = translate_message(body(thinking={"type": "disabled"}), LIMITS)
    assert json.loads(disabled.generate.chat_template_kwargs_json) == {"enable_thinking": False}
    counted = translate_count(
        {"model": MODEL, "messages": ASK, "system": "Be brief.", "tools": [TOOL]}, LIMITS
    )
    assert [m.role for m in counted.generate.messages] == ["system", "user"]
    assert counted.generate.tools[0].name == "get_weather"


BLOCK = {"type": "text", "text": "hi"}
BAD_FIELDS = [
    ({"model": 3}, "model"),
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "16"}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "system", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [5]}]}, "messages[0].content[0]"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        "messages[0].content[0].type",
    ),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{**BLOCK, "extra": 1}]}]}, "messages[0].content[0].extra"),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}
            ]
        },
        "messages[0].content[0]",
    ),
    (
        {"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "a"}]}]},
        "messages[0].content[0]",
    ),
    (
        {
            "messages": [
                {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": []}]}
            ]
        },
        "messages[0].content[0].input",
    ),
    ({"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]}, "messages"),
    ({"system": 5}, "system"),
    ({"system": [{"type": "text", "text": 1}]}, "system[0].text"),
    ({"stop_sequences": "\n"}, "stop_sequences"),
    ({"stop_sequences": [1]}, "stop_sequences[0]"),
    ({"temperature": "0.5"}, "temperature"),
    ({"top_p": True}, "top_p"),
    ({"top_k": 1.5}, "top_k"),
    ({"stream": "yes"}, "stream"),
    ({"tools": {"name": "f"}}, "tools"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "f", "input_schema": "{}"}]}, "tools[0].input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [TOOL], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "required"}}, "tool_choice.type"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tools": [TOOL], "tool_choice": {"type": "auto", "name": "f"}}, "tool_choice.name"),
    (
        {"tools": [TOOL], "tool_choice": {"type": "any", "disable_parallel_tool_use": 1}},
        "tool_choice.disable_parallel_tool_use",
    ),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "on"}}, "thinking.type"),
    ({"thinking": {"type": "enabled", "budget_tokens": 0}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "adaptive", "display": "omitted"}}, "thinking.display"),
    ({"output_config": {"effort": "low"}}, "output_config"),
    ({"metadata": {"user_id": 1}}, "metadata.user_id"),
    ({"metadata": {"other": "x"}}, "metadata.other"),
    ({"service_tier": "priority"}, "service_tier"),
    ({"container": "c"}, "container"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_FIELDS, ids=[param for _, param in BAD_FIELDS])
def test_each_field_sent_wrong_is_refused_naming_it(fields, param):
    sent = {k: v for k, v in body(**fields).items() if v is not None}
    with pytest.raises(FieldError) as refused:
        translate_message(sent, LIMITS)
    assert str(refused.value).startswith(param), str(refused.value)
    status, error = anthropic_error(refused.value)
    assert status == 400 and error["error"]["type"] == "invalid_request_error"


def test_a_count_tokens_body_takes_no_generation_fields_and_turns_are_limited():
    with pytest.raises(FieldError, match="^max_tokens is not supported"):
        translate_count(body(), LIMITS)
    many = [{"role": "user", "content": "hi"}] * (LIMITS.max_chat_messages + 1)
    with pytest.raises(FieldError, match="^messages has"):
        translate_message(body(messages=many), LIMITS)
    with pytest.raises(FieldError, match="must be a JSON object") as refused:
        translate_message([], LIMITS)
    assert refused.value.param == "body"


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (UnauthorizedError("missing bearer token"), 401, "authentication_error"),
        (ModelNotServedError("no such model"), 404, "not_found_error"),
        (BodyTooLargeError("too big"), 413, "request_too_large"),
        (QueueFullError("full"), 429, "rate_limit_error"),
        (RuntimeError("bug"), 500, "api_error"),
    ],
)
def test_errors_have_anthropics_shape_and_the_openai_routes_status(error, status, kind):
    message = http_error(error)[1]["error"]["message"]  # a bug's is the same sanitized line
    assert anthropic_error(error) == (status, {"type": "error", "error": {"type": kind, "message": message}})


# -- the answer ----------------------------------------------------------------------------------------


def messages_of_an_answer() -> list[pb.GenerateResponse]:
    """Reasoning, text, then two calls, the last message ending the answer with its usage."""
    last = pb.GenerateResponse(finish_reason=pb.TOOL_CALLS)
    last.tool_calls.add(index=1, id="call_b", name="add", arguments='{"a": 1}')
    last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_tokens = 30, 12, 8
    first_call = pb.GenerateResponse()
    first_call.tool_calls.add(index=0, id="call_a", name="get_weather", arguments="")
    more = pb.GenerateResponse()
    more.tool_calls.add(index=0, arguments='{"city": "Oslo", ')
    rest = pb.GenerateResponse()
    rest.tool_calls.add(index=0, arguments='"days": 2}')
    return [
        pb.GenerateResponse(reasoning_text="The user "),
        pb.GenerateResponse(reasoning_text="wants weather."),
        pb.GenerateResponse(text="Checking"),
        pb.GenerateResponse(text="."),
        first_call,
        more,
        rest,
        last,
    ]


def sse(data: bytes) -> list[dict]:
    """The stream's events; each `event:` line names its data's type."""
    events = []
    for part in data.decode().split("\n\n"):
        if part:
            name, payload = part.split("\n")
            event = json.loads(payload.removeprefix("data: "))
            assert name == f"event: {event['type']}"
            events.append(event)
    return events


def test_the_stream_opens_and_closes_a_block_per_kind_and_puts_together_the_whole_message():
    streamed = MessageBuilder("r1", MODEL, prompt_tokens=30)
    events = sse(streamed.start_event() + b"".join(streamed.events(m) for m in messages_of_an_answer()))
    whole = MessageBuilder("r1", MODEL, prompt_tokens=30)
    for message in messages_of_an_answer():
        whole.add(message)
    message = whole.body()
    assert [(e["type"], e.get("index"), e.get("delta", {}).get("type")) for e in events] == [
        ("message_start", None, None),
        ("content_block_start", 0, None),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, None),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, None),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("content_block_start", 3, None),
        ("content_block_delta", 3, "input_json_delta"),
        ("content_block_stop", 3, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    start = events[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"] == "msg_r1"
    assert events[9]["content_block"] == {
        "type": "tool_use",
        "id": "call_a",
        "name": "get_weather",
        "input": {},
    }
    assert message["content"] == [
        {"type": "thinking", "signature": "", "thinking": "The user wants weather."},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "call_a", "name": "get_weather", "input": {"city": "Oslo", "days": 2}},
        {"type": "tool_use", "id": "call_b", "name": "add", "input": {"a": 1}},
    ]
    usage = {
        "input_tokens": 22,
        "output_tokens": 12,
        "cache_read_input_tokens": 8,
        "cache_creation_input_tokens": 0,
    }
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"] == usage == message["usage"]
    assert (message["stop_reason"], message["type"], message["role"]) == ("tool_use", "message", "assistant")


@pytest.mark.parametrize(
    ("finish", "stop", "reason"),
    [(pb.STOP, None, "end_turn"), (pb.LENGTH, None, "max_tokens"), (pb.STOP, "\n\n", "stop_sequence")],
)
def test_each_finish_has_its_stop_reason(finish, stop, reason):
    builder = MessageBuilder("r", MODEL, prompt_tokens=3)
    last = pb.GenerateResponse(text="Hi", finish_reason=finish)
    if stop is not None:
        last.stop_string = stop
    builder.add(last)
    assert (builder.body()["stop_reason"], builder.body()["stop_sequence"]) == (reason, stop)
    assert builder.body()["content"] == [{"type": "text", "text": "Hi"}]


# -- the official SDK against live servers, with the real default model -------------------------------


@pytest.fixture(scope="module", params=["aggregated", "disaggregated"])
def server(request, real_model_dir):
    settings = {"tool_call_parser": "hermes", "auth_token": KEY, "max_model_len": 1024}
    if request.param == "aggregated":
        running = Server(real_model_dir, **settings)
        yield running
        running.close()
        return
    prefill = RunningPrefill(real_model_dir, block_size=8)
    running = DisaggregatedServer(real_model_dir, prefill, **settings)
    yield running
    running.close()
    assert prefill.prefilled_request_ids(), "the prompts were prefilled by the prefill server"
    prefill.close()


@pytest.fixture(scope="module")
def client(server):
    sdk = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)
    yield sdk
    sdk.close()


def raw_post(server: Server, path: str, payload: object, headers: dict) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=60)
    try:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        connection.request("POST", path, body=data, headers={"Content-Type": "application/json", **headers})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def real_prompt_tokens(server: Server, messages: list[dict], **tools) -> int:
    """The prompt's token count as the chat route reports it (its template and tokenizer, served)."""
    answer = server.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=1, temperature=0, **tools
    )
    return answer.usage.prompt_tokens


@pytest.mark.slow
@pytest.mark.real_model
def test_a_plain_message_and_its_token_count(server, client):
    message = client.messages.create(
        model=MODEL, max_tokens=24, system="Answer in one short sentence.", messages=ASK, extra_body=GREEDY
    )
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.content and message.content[0].type == "text" and message.content[0].text.strip()
    usage = message.usage
    assert 1 <= usage.output_tokens <= 24
    prompt = [{"role": "system", "content": "Answer in one short sentence."}, *ASK]
    real = real_prompt_tokens(server, prompt)
    assert usage.input_tokens + usage.cache_read_input_tokens == real
    counted = client.messages.count_tokens(model=MODEL, system="Answer in one short sentence.", messages=ASK)
    assert counted.input_tokens == real
    with_tool = client.messages.count_tokens(model=MODEL, messages=ASK, tools=[TOOL])
    function = {"name": TOOL["name"], "description": TOOL["description"], "parameters": WEATHER}
    assert with_tool.input_tokens == real_prompt_tokens(
        server, ASK, tools=[{"type": "function", "function": function}]
    )


@pytest.mark.slow
@pytest.mark.real_model
def test_a_streamed_message_puts_together_what_the_whole_one_says(server, client):
    asked = {
        "model": MODEL,
        "max_tokens": 20,
        "messages": ASK,
        "extra_body": GREEDY,
        "stop_sequences": ["\n\n"],
    }
    whole = client.messages.create(**asked)
    with client.messages.stream(**asked) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    assert [block.model_dump() for block in streamed.content] == [
        block.model_dump() for block in whole.content
    ]
    assert (streamed.stop_reason, streamed.stop_sequence) == (whole.stop_reason, whole.stop_sequence)
    assert streamed.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_tool_call_validates_against_its_schema(server, client, stream):
    asked = {
        "model": MODEL,
        "max_tokens": 48,
        "messages": ASK,
        "tools": [TOOL],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "extra_body": GREEDY,
    }
    if stream:
        with client.messages.stream(**asked) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**asked)
    assert message.stop_reason == "tool_use"
    calls = [block for block in message.content if block.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id
    jsonschema.validate(calls[0].input, WEATHER)


@pytest.mark.slow
@pytest.mark.real_model
def test_a_tool_result_turn_is_answered(server, client):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris", "days": 1},
                }
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 24C"}],
        },
    ]
    message = client.messages.create(
        model=MODEL,
        max_tokens=24,
        messages=history,
        tools=[TOOL],
        tool_choice={"type": "none"},
        extra_body=GREEDY,
    )
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.content[0].type == "text" and message.content[0].text
    counted = client.messages.count_tokens(
        model=MODEL, messages=history, tools=[TOOL], tool_choice={"type": "none"}
    )
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens


@pytest.mark.slow
@pytest.mark.real_model
def test_refusals_have_anthropics_shape_and_the_server_keeps_serving(server, client):
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=MODEL, max_tokens=0, messages=ASK)
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert refused.value.body["error"]["message"].startswith("max_tokens")
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="claude-nonexistent", max_tokens=4, messages=ASK)
    assert unknown.value.body["type"] == "error" and unknown.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=ASK
        )
    valid = body(max_tokens=4)
    status, error = raw_post(server, "/v1/messages", valid, {})
    assert (status, error["error"]["type"]) == (401, "authentication_error")
    status, answer = raw_post(server, "/v1/messages", valid, {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and answer["type"] == "message", "a bearer token is accepted as well"
    status, error = raw_post(server, "/v1/messages", b"{not json", {"x-api-key": KEY})
    assert status == 400 and "request body is not valid JSON" in error["error"]["message"]
    status, error = raw_post(server, "/v1/messages", b"x" * (5 << 20), {"x-api-key": KEY})
    assert (status, error["error"]["type"]) == (413, "request_too_large")
    status, error = raw_post(
        server, "/v1/messages/count_tokens", {"model": MODEL, "messages": []}, {"x-api-key": KEY}
    )
    assert status == 400 and error["error"]["message"].startswith("messages")
    status, error = raw_post(server, "/v1/messages", body(tools=[TOOL]), {"x-api-key": KEY})
    assert status == 200, "auto tool choice runs the server's tool-call parser"
    assert client.messages.create(model=MODEL, max_tokens=4, messages=ASK).content is not None
    assert wait_until(server.idle)


def request_with(headers: dict[str, str]) -> Request:
    raw = [(name.lower().encode(), value.encode()) for name, value in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": raw})


@pytest.mark.parametrize(
    ("headers", "accepted"),
    [
        ({"x-api-key": KEY}, True),
        ({"Authorization": f"Bearer {KEY}"}, True),
        ({"Authorization": f"Bearer {KEY}", "x-api-key": "wrong"}, True),
        ({"Authorization": "Bearer wrong", "x-api-key": KEY}, False),
        ({"x-api-key": "wrong"}, False),
        ({"x-api-key": ""}, False),
        ({}, False),
    ],
)
def test_the_key_is_taken_from_x_api_key_or_the_bearer_header(headers, accepted):
    """`Authorization`, when sent, is the key: a wrong bearer token is not rescued by another header."""
    keys = ApiKeys(KEY)
    if accepted:
        keys.authorize(request_with(headers))
    else:
        with pytest.raises(UnauthorizedError):
            keys.authorize(request_with(headers))
    ApiKeys(None).authorize(request_with({}))


@pytest.mark.slow
@pytest.mark.real_model
def test_answers_and_events_match_the_published_schemas(server):
    _, validator = published_schemas(server)
    status, whole = raw_post(server, "/v1/messages", body(max_tokens=8), {"x-api-key": KEY})
    assert status == 200
    validator("MessageOut").validate(whole)
    status, counted = raw_post(server, "/v1/messages/count_tokens", {"messages": ASK}, {"x-api-key": KEY})
    validator("TokenCount").validate(counted)
    connection = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=60)
    try:
        headers = {"Content-Type": "application/json", "x-api-key": KEY}
        connection.request("POST", "/v1/messages", body=json.dumps(body(stream=True)), headers=headers)
        events = sse(connection.getresponse().read())
    finally:
        connection.close()
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    for event in events:
        validator("MessageStreamEvent").validate(event)
