"""Structured outputs and forced tool calls over the public gRPC API, on a live `DecodeServer`.

A tiny random-weight model writes noise unless held to its grammar, so every answer that parses and
validates here was made so by the constraint. Refusals (bad schemas, unknown tools, compiles past the
timeout, in the core) are INVALID_ARGUMENT naming the field, leak nothing, and the server keeps serving.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import grpc
import jsonschema
import pytest
from conftest import save_tiny_model, wait_until
from pydantic import BaseModel, Field
from test_decode_server import RunningServer, start_server

from protos.tandem.v1 import generation_pb2 as pb

COMPILE_TIMEOUT_S = 1.0
# About 3 s to compile (1 s at 800 alternatives; grows as n^1.5) on a 2-core Xeon: past COMPILE_TIMEOUT_S.
SLOW_REGEX = "(" + "|".join(f"[a-z]{{{i}}}x" for i in range(1, 1600)) + ")"

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
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": ["integer", "null"], "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "street": {"type": "string", "maxLength": 8},
            },
            "required": ["zip"],
            "additionalProperties": False,
        },
        "kind": {"anyOf": [{"const": "a"}, {"type": "boolean"}]},
    },
    "required": ["name", "age", "tags", "address", "kind"],
    "additionalProperties": False,
}
TOOLS = [
    pb.FunctionTool(name="get_weather", description="Weather of a city", parameters_json=json.dumps(WEATHER)),
    pb.FunctionTool(
        name="add",
        description="Add two numbers",
        parameters_json=json.dumps(
            {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 99},
                    "b": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["a", "b"],
                "additionalProperties": False,
            }
        ),
    ),
]


def streamed_tool_calls(responses) -> dict[int, dict[str, str]]:
    """The tool calls a stream spelled out piece by piece, by call index."""
    calls: dict[int, dict[str, str]] = {}
    for response in responses:
        for piece in response.tool_calls:
            call = calls.setdefault(piece.index, {"name": "", "arguments": ""})
            call["name"] += piece.name
            call["arguments"] += piece.arguments
    return calls


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-model")
    save_tiny_model(directory, 7)
    running = start_server(
        directory, max_model_len=512, num_blocks=256, structured_output_compile_timeout_s=COMPILE_TIMEOUT_S
    )
    yield running
    gate = running.server.engine_loop.grammars
    running.close()
    assert gate.worker_pid is None  # the compile worker ends with the server


def chat(sampled: bool = False, max_tokens: int = 200, **kwargs) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=1.0, seed=5) if sampled else pb.SamplingParams(temperature=0.0)
    return pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content="Answer.")],
        sampling=sampling,
        stopping=pb.StoppingParams(max_tokens=max_tokens),
        **kwargs,
    )


def generate(server: RunningServer, request: pb.GenerateRequest) -> tuple[str, int]:
    """What the model wrote (decoded from its token ids, whatever the answer parsers make of it) and
    the finish reason."""
    responses = list(server.stub.Generate(request, timeout=120))
    ids = [token_id for response in responses for token_id in response.token_ids]
    return server.engine.tokenizer.decode(ids), responses[-1].finish_reason


def refusal(server: RunningServer, request: pb.GenerateRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        list(server.stub.Generate(request, timeout=120))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    return caught.value


def assert_nothing_held(server: RunningServer) -> None:
    assert wait_until(server.pool_is_full, timeout=10), "a refused or finished request still holds KV blocks"


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("schema", [WEATHER, PERSON], ids=["weather", "person"])
def test_json_schema_answers_are_valid_against_the_schema(server, schema, sampled):
    output = pb.StructuredOutput(json_schema=json.dumps(schema))
    text, finish = generate(server, chat(sampled, structured_output=output))
    assert finish == pb.STOP, text
    jsonschema.validate(json.loads(text), schema)
    assert_nothing_held(server)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_json_object_regex_and_choice_answers_match(server, sampled):
    text, finish = generate(server, chat(sampled, structured_output=pb.StructuredOutput(json_object=True)))
    assert finish == pb.STOP and isinstance(json.loads(text), dict), text
    regex = r"[0-9]{3}-[a-z]{2,4}"
    text, finish = generate(server, chat(sampled, structured_output=pb.StructuredOutput(regex=regex)))
    assert finish == pb.STOP and re.fullmatch(regex, text), text
    choices = ["red", "green", "blue sky", 'say "hi"']
    output = pb.StructuredOutput(choice=pb.ChoiceList(choices=choices))
    text, finish = generate(server, chat(sampled, structured_output=output))
    assert finish == pb.STOP and text in choices, text
    grammar = 'root ::= "(" [0-9] ("+" [0-9])* ")"'
    text, finish = generate(server, chat(sampled, structured_output=pb.StructuredOutput(grammar=grammar)))
    assert finish == pb.STOP and re.fullmatch(r"\([0-9](\+[0-9])*\)", text), text


def test_max_tokens_cuts_a_constrained_answer_with_length(server):
    output = pb.StructuredOutput(json_schema=json.dumps(PERSON))
    text, finish = generate(server, chat(max_tokens=3, structured_output=output))
    assert finish == pb.LENGTH and text.startswith("{")


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_writes_valid_calls(server, parallel):
    request = chat(
        tools=TOOLS,
        tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_REQUIRED),
        parallel_tool_calls=parallel,
        max_tokens=400,
    )
    responses = list(server.stub.Generate(request, timeout=120))
    finish = responses[-1].finish_reason
    calls = streamed_tool_calls(responses)
    schemas = {tool.name: json.loads(tool.parameters_json) for tool in TOOLS}
    # The tiny random model may keep adding calls to an unbounded array until max_tokens cuts it: every
    # call it finished is valid, and without parallel calls it writes exactly one and stops.
    finished = calls if finish == pb.TOOL_CALLS else {i: c for i, c in calls.items() if i < max(calls)}
    assert finished, responses[-1]
    for call in finished.values():
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
    if not parallel:
        assert finish == pb.TOOL_CALLS and len(calls) == 1
    assert finish in (pb.TOOL_CALLS, pb.LENGTH)
    assert not any(response.text for response in responses), "forced calls leave no content"


# Constraints that compile yet allow no token: a rule with no base case allows nothing from the start; an
# empty class allows nothing after the text before it; surrogates are not text, so the UTF-8 mask refuses
# what the regex alone would allow after their first byte.
IMPOSSIBLE = {
    "no-base-case": pb.StructuredOutput(grammar='root ::= root "a"'),
    "empty-class": pb.StructuredOutput(regex="ok[^\\s\\S]"),
    "surrogates": pb.StructuredOutput(regex="[\\ud800-\\udfff]+"),
}


@pytest.mark.slow
@pytest.mark.parametrize("impossible", list(IMPOSSIBLE.values()), ids=list(IMPOSSIBLE))
def test_a_constraint_that_allows_no_token_ends_its_request_alone(server, impossible):
    bad = chat(structured_output=impossible)
    # Alone first (this also compiles it): refused with what is wrong, not an internal error.
    assert "constraint allows no token at this point" in refusal(server, bad).details()
    plain = pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content="Tell me a story.")],
        sampling=pb.SamplingParams(temperature=1.0, seed=9),
        stopping=pb.StoppingParams(max_tokens=300, ignore_eos=True),
    )
    streams = [server.stub.Generate(plain, timeout=120) for _ in range(3)]
    firsts = [next(stream) for stream in streams]  # all three are running now
    assert "constraint allows no token at this point" in refusal(server, bad).details()
    for first, stream in zip(firsts, streams, strict=True):
        responses = [first, *stream]
        assert responses[-1].finish_reason == pb.LENGTH
        assert sum(len(response.token_ids) for response in responses) == 300
    assert_nothing_held(server)


def test_a_named_tool_choice_writes_that_functions_arguments(server):
    request = chat(tools=TOOLS, tool_choice=pb.ToolChoice(function_name="get_weather"), sampled=True)
    text, _ = generate(server, request)
    jsonschema.validate(json.loads(text), WEATHER)


@pytest.mark.parametrize(
    ("kwargs", "field", "needle"),
    [
        (
            {"structured_output": pb.StructuredOutput(json_schema='{"type": "nonsense"}')},
            "structured_output.json_schema",
            'Unsupported type "nonsense"',
        ),
        (
            {"structured_output": pb.StructuredOutput(json_schema="{oops")},
            "structured_output.json_schema",
            "JSON",
        ),
        ({"structured_output": pb.StructuredOutput(regex="(ab")}, "structured_output.regex", "parenthesis"),
        (
            {"structured_output": pb.StructuredOutput(grammar="root ::= x")},
            "structured_output.grammar",
            '"x"',
        ),
        (
            {"tools": TOOLS, "tool_choice": pb.ToolChoice(function_name="get_time")},
            "tool_choice.function_name",
            "'get_time' is not one of the request's tools: get_weather, add",
        ),
        (
            {
                "tools": [pb.FunctionTool(name="bad name")],
                "tool_choice": pb.ToolChoice(mode=pb.TOOL_CHOICE_NONE),
            },
            "tools[0].name",
            "a-z",
        ),
        (
            {
                "tools": [TOOLS[0], pb.FunctionTool(name="f", parameters_json='{"type": "wat"}')],
                "tool_choice": pb.ToolChoice(mode=pb.TOOL_CHOICE_REQUIRED),
            },
            "tools[1].parameters_json",
            "type 'object'",
        ),
        (
            {
                "tools": [
                    TOOLS[0],
                    pb.FunctionTool(name="f", parameters_json='{"properties": {"x": {"type": "wat"}}}'),
                ],
                "tool_choice": pb.ToolChoice(mode=pb.TOOL_CHOICE_REQUIRED),
            },
            "tools[1].parameters_json",
            'Unsupported type "wat"',
        ),
        (
            {
                "tools": TOOLS,
                "tool_choice": pb.ToolChoice(mode=pb.TOOL_CHOICE_REQUIRED),
                "structured_output": pb.StructuredOutput(json_object=True),
            },
            "structured_output",
            "cannot be combined",
        ),
    ],
)
def test_bad_constraints_are_refused_by_field_and_the_server_keeps_serving(server, kwargs, field, needle):
    error = refusal(server, chat(**kwargs))
    assert error.details().startswith(f"{field}: ") and needle in error.details(), error.details()
    text, finish = generate(server, chat(structured_output=pb.StructuredOutput(regex="ok|fine")))
    assert text in ("ok", "fine") and finish == pb.STOP
    assert_nothing_held(server)


def test_tools_on_a_text_prompt_are_refused(server):
    none = pb.ToolChoice(mode=pb.TOOL_CHOICE_NONE)
    request = pb.GenerateRequest(
        prompt="hi", tools=TOOLS, tool_choice=none, stopping=pb.StoppingParams(max_tokens=2)
    )
    assert refusal(server, request).details().startswith("tools: needs a chat request")


def test_a_compile_past_the_timeout_is_refused_and_others_are_served(server):
    error = refusal(server, chat(structured_output=pb.StructuredOutput(regex=SLOW_REGEX)))
    assert error.details().startswith(
        f"structured_output.regex: did not compile within {COMPILE_TIMEOUT_S:g} s"
    )
    text, finish = generate(
        server, chat(structured_output=pb.StructuredOutput(choice=pb.ChoiceList(choices=["x", "y"])))
    )
    assert text in ("x", "y") and finish == pb.STOP
    assert_nothing_held(server)


def test_a_tool_result_turn_renders_and_answers(server):
    messages = [
        pb.ChatMessage(role="user", content="Weather in Paris?"),
        pb.ChatMessage(
            role="assistant",
            tool_calls=[pb.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')],
        ),
        pb.ChatMessage(role="tool", content='{"temp": 21}', tool_call_id="call_1", name="get_weather"),
    ]
    request = pb.GenerateRequest(
        messages=messages,
        tools=TOOLS,
        tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_NONE),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingParams(max_tokens=30),
        structured_output=pb.StructuredOutput(regex="It is [0-9]{1,2}"),
    )
    text, finish = generate(server, request)
    assert re.fullmatch("It is [0-9]{1,2}", text) and finish == pb.STOP, text
    bad = pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="c", name="add", arguments="[1]")])
    error = refusal(
        server, pb.GenerateRequest(messages=[messages[0], bad], stopping=pb.StoppingParams(max_tokens=2))
    )
    assert error.details().startswith("messages[1].tool_calls[0].arguments: must be a JSON object")


def test_the_python_clients_send_constraints_and_tools(server):
    import asyncio

    from tandem.client import AsyncTandemClient, FinishReason, TandemClient

    target = f"127.0.0.1:{server.port}"
    messages = [{"role": "user", "content": "Weather?"}]
    with TandemClient(target) as client:
        answer = client.complete(messages=messages, json_schema=WEATHER, temperature=0.0, max_tokens=200)
        jsonschema.validate(json.loads(answer.text), WEATHER)
        assert answer.finish_reason in (FinishReason.STOP, FinishReason.TOOL_CALLS)
        openai_tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
        named = client.complete(
            messages=messages,
            tools=[openai_tool],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=200,
        )
        arguments = (
            named.tool_calls[0].arguments
            if named.tool_calls
            else server.engine.tokenizer.decode(named.token_ids)
        )
        jsonschema.validate(json.loads(arguments), WEATHER)

    async def choose() -> str:
        async with AsyncTandemClient(target) as client:
            return (await client.complete(messages=messages, choice=["up", "down"], max_tokens=5)).text

    assert asyncio.run(choose()) in ("up", "down")


def test_tandem_generate_takes_a_json_schema_file(server, tmp_path, capsys):
    from tandem.cli import main

    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(WEATHER))
    target = f"127.0.0.1:{server.port}"
    code = main(
        ["generate", "--target", target, "--json-schema", str(schema_file), "--max-tokens", "200", "Weather?"]
    )
    assert code == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), WEATHER)
    code = main(["generate", "--target", target, "--regex", "[ab]{3}", "--temperature", "0", "x"])
    assert code == 0 and re.fullmatch("[ab]{3}", capsys.readouterr().out.strip())


def test_a_reasoning_parser_needs_a_single_think_token(tmp_path):
    from tiny_tokenizer import build_tiny_tokenizer

    from base.errors import ConfigError
    from decode_service.front_door.constraints import reasoning_end_token_id
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path / "tok"))
    assert reasoning_end_token_id(tokenizer, None) is None
    with pytest.raises(ConfigError, match="no single </think> token"):
        reasoning_end_token_id(tokenizer, "qwen3")
    tokenizer.hf.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    assert reasoning_end_token_id(tokenizer, "deepseek_r1") == tokenizer.hf.convert_tokens_to_ids("</think>")


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--structured-output-compile-timeout", "0"], "structured_output_compile_timeout_s must be > 0"),
        (["--grammar-cache-size", "-1"], "grammar_cache_size must be >= 0"),
        (["--chat-template", "/nonexistent/t.jinja"], "is not a readable file"),
    ],
)
def test_bad_structured_output_flags_are_config_errors(flags, needle):
    import argparse

    from base.errors import ConfigError
    from decode_service.cli import add_arguments, service_config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ConfigError, match=needle):
        service_config_from_args(parser.parse_args(["--model", "m", *flags]))


def test_structured_output_flags_reach_the_config():
    import argparse

    from decode_service.cli import add_arguments, service_config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--model",
            "m",
            "--grammar-cache-size",
            "3",
            "--tool-call-parser",
            "hermes",
            "--reasoning-parser",
            "qwen3",
        ]
    )
    config = service_config_from_args(args)
    assert (config.grammar_cache_size, config.tool_call_parser, config.reasoning_parser) == (
        3,
        "hermes",
        "qwen3",
    )
    assert config.structured_output_compile_timeout_s == 10.0 and config.chat_template is None


def test_cancelling_or_aborting_a_constrained_stream_frees_everything(server):
    long_answer = pb.StructuredOutput(regex="[a-z]{300}")
    call = server.stub.Generate(chat(max_tokens=300, structured_output=long_answer), timeout=60)
    stream = iter(call)
    next(stream)
    next(stream)
    call.cancel()
    assert_nothing_held(server)

    request = chat(max_tokens=300, structured_output=long_answer)
    request.request_id = "constrained-abort"
    stream = iter(server.stub.Generate(request, timeout=60))
    received = [next(stream)]
    assert server.stub.Abort(pb.AbortRequest(request_id="constrained-abort")).aborted
    received.extend(stream)
    assert received[-1].finish_reason == pb.ABORT
    assert re.fullmatch("[a-z]*", "".join(response.text for response in received))
    assert_nothing_held(server)


class Address(BaseModel):
    city: str = Field(max_length=12)
    zip: str = Field(pattern="^[0-9]{5}$")


class Order(BaseModel):
    """What pydantic writes for a nested model: the model under `$defs`, a `$ref` to it."""

    item: Literal["book", "pen"]
    quantity: int = Field(ge=1, le=9)
    ship_to: Address


class Parcel(BaseModel):
    """Another tool whose `$defs` holds an `Address` of its own, unlike `Order`'s."""

    class Address(BaseModel):
        street: str = Field(max_length=8)

    weight: int = Field(ge=1, le=50)
    to: Parcel.Address


ORDER_TOOL = pb.FunctionTool(name="order", parameters_json=json.dumps(Order.model_json_schema()))
PARCEL_TOOL = pb.FunctionTool(name="parcel", parameters_json=json.dumps(Parcel.model_json_schema()))


def test_required_tool_calls_work_with_pydantic_defs_and_refs(server):
    assert "$defs" in Order.model_json_schema() and "$ref" in json.dumps(Order.model_json_schema())
    for parallel in (False, True):
        request = chat(
            sampled=True,
            tools=[ORDER_TOOL, PARCEL_TOOL],
            tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_REQUIRED),
            parallel_tool_calls=parallel,
            max_tokens=400,
        )
        responses = list(server.stub.Generate(request, timeout=120))
        calls = streamed_tool_calls(responses)
        finish = responses[-1].finish_reason
        finished = calls if finish == pb.TOOL_CALLS else {i: c for i, c in calls.items() if i < max(calls)}
        assert finished, responses[-1]
        models = {"order": Order, "parcel": Parcel}
        for call in finished.values():
            models[call["name"]].model_validate_json(call["arguments"])


def test_each_tools_defs_keep_their_own_meaning_in_the_required_schema(server):
    """Both tools define an `Address`; each call's arguments are held to its own tool's."""
    import xgrammar as xgr

    from decode_service.front_door.constraints import parse_tools, required_tool_calls_schema

    tools = parse_tools(pb.GenerateRequest(tools=[ORDER_TOOL, PARCEL_TOOL]))
    schema = json.dumps(required_tool_calls_schema(tools, parallel=True))
    tokenizer = server.engine.tokenizer
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer.hf, vocab_size=server.engine.vocab_size, stop_token_ids=sorted(tokenizer.eos_token_ids)
    )
    compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(
        schema, any_whitespace=False
    )

    def accepts(calls: list[dict]) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return matcher.accept_string(json.dumps(calls)) and matcher.is_completed()

    order = {"item": "pen", "quantity": 2, "ship_to": {"city": "Paris", "zip": "75001"}}
    parcel = {"weight": 3, "to": {"street": "Rue 1"}}
    assert accepts([{"name": "order", "arguments": order}, {"name": "parcel", "arguments": parcel}])
    assert not accepts([{"name": "parcel", "arguments": {"weight": 3, "to": order["ship_to"]}}])
    assert not accepts([{"name": "order", "arguments": {**order, "ship_to": parcel["to"]}}])
