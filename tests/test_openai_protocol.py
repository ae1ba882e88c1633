"""The OpenAI HTTP API without a server: request translation, response bodies and SSE chunks, errors."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from base.errors import InvalidRequestError, OutOfBlocksError
from decode_service.front_door.openai_http.errors import (
    BodyTooLargeError,
    FieldError,
    ModelNotServedError,
    UnauthorizedError,
    UnsupportedFieldError,
    http_error,
)
from decode_service.front_door.openai_http.models import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    FunctionDefinition,
    ResponseFormat,
    StreamOptions,
    StructuredOutputs,
)
from decode_service.front_door.openai_http.protocol import COMPLETIONS_DEFAULT_MAX_TOKENS, Endpoint, translate
from decode_service.front_door.openai_http.responses import ResponseBuilder
from protos.tandem.v1 import generation_pb2 as pb
from serving.errors import DrainingError, QueueFullError
from serving.sampling import sampling_params

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "Once upon"}


def chat(**fields):
    return translate({**CHAT, **fields}, Endpoint.CHAT)


def completion(**fields):
    return translate({**COMPLETION, **fields}, Endpoint.COMPLETION)


# --- requests ------------------------------------------------------------------------------------


def test_chat_fields_map_to_the_grpc_request():
    request = chat(
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ],
        max_tokens=9,
        max_completion_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=4,
        min_p=0.1,
        n=2,
        stop="END",
        seed=-1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias={"7": -100, "11": 5.5},
        logprobs=True,
        top_logprobs=3,
        user="alice",
        min_tokens=2,
        ignore_eos=True,
        stop_token_ids=[3],
        priority=5,
        stream=True,
        stream_options={"include_usage": True},
        disable_speculation=True,
    )
    generate = request.generate
    assert [(m.role, m.content) for m in generate.messages] == [("system", "be brief"), ("user", "a\nb")]
    sampling = generate.sampling
    assert (sampling.top_k, sampling.seed, sampling.logprobs) == (4, 2**64 - 1, 3)
    assert sampling.temperature == 0.5 and sampling.repetition_penalty == pytest.approx(1.2)
    assert sampling.disable_speculation
    assert dict(sampling.logit_bias) == {7: -100.0, 11: 5.5}
    stopping = generate.stopping
    assert stopping.max_tokens == 7, "max_completion_tokens wins over the deprecated max_tokens"
    assert list(stopping.stop) == ["END"] and list(stopping.stop_token_ids) == [3]
    assert stopping.ignore_eos and stopping.min_tokens == 2
    assert (generate.n, generate.tenant, generate.priority) == (2, "alice", 5)
    assert request.stream and request.include_usage and request.top_logprobs == 3 and request.model == "m"


def test_chat_defaults_leave_the_server_defaults():
    request = translate({"messages": [{"role": "user", "content": "hi"}]}, Endpoint.CHAT)
    generate = request.generate
    assert not generate.stopping.HasField("max_tokens"), "chat runs to the end of the context by default"
    for name in ("temperature", "top_p", "seed", "presence_penalty", "repetition_penalty"):
        assert not generate.sampling.HasField(name), name
    assert generate.n == 1 and generate.sampling.logprobs == 0
    assert request.model is None and not request.stream and request.top_logprobs is None


def test_logprobs_without_alternatives_still_ask_the_engine_for_one():
    request = chat(logprobs=True)
    assert request.top_logprobs == 0 and request.generate.sampling.logprobs == 1


@pytest.mark.parametrize(
    ("prompt", "text", "ids"),
    [("Once", "Once", []), ([1, 2], "", [1, 2]), (["Once"], "Once", []), ([[4, 5]], "", [4, 5])],
)
def test_completion_prompt_forms(prompt, text, ids):
    request = completion(prompt=prompt, logprobs=2)
    assert request.generate.prompt == text and list(request.generate.token_ids) == ids
    assert request.generate.stopping.max_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS
    assert request.top_logprobs == 2 and request.generate.sampling.logprobs == 2


def test_neutral_values_of_unsupported_features_are_accepted():
    request = chat(
        response_format={"type": "text"},
        tool_choice="none",
        store=False,
        modalities=["text"],
        tools=None,
        metadata={"a": "b"},
        skip_special_tokens=True,
        add_generation_prompt=True,
        chat_template_kwargs={},
        prediction={"type": "content", "content": "x"},
        stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False},
    )
    assert not request.generate.HasField("structured_output") and not request.generate.HasField("tool_choice")
    completion(echo=False, suffix="", service_tier="auto", best_of=1, guided_decoding_backend="xgrammar")


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize(
    ("fields", "expected", "param"),
    [
        (
            {"response_format": {"type": "json_object"}},
            pb.StructuredOutput(json_object=True),
            "response_format",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "w", "schema": SCHEMA, "strict": True},
                }
            },
            pb.StructuredOutput(json_schema=json.dumps(SCHEMA)),
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "w", "schema": json.dumps(SCHEMA)},
                }
            },
            pb.StructuredOutput(json_schema=json.dumps(SCHEMA)),
            "response_format.json_schema.schema",
        ),
        ({"guided_json": SCHEMA}, pb.StructuredOutput(json_schema=json.dumps(SCHEMA)), "guided_json"),
        ({"guided_regex": "[a-z]+"}, pb.StructuredOutput(regex="[a-z]+"), "guided_regex"),
        (
            {"guided_choice": ["yes", "no"]},
            pb.StructuredOutput(choice=pb.ChoiceList(choices=["yes", "no"])),
            "guided_choice",
        ),
        ({"guided_grammar": 'root ::= "a"'}, pb.StructuredOutput(grammar='root ::= "a"'), "guided_grammar"),
        (
            {"structured_outputs": {"json": json.dumps(SCHEMA)}},
            pb.StructuredOutput(json_schema=json.dumps(SCHEMA)),
            "structured_outputs.json",
        ),
        ({"structured_outputs": {"regex": "x"}}, pb.StructuredOutput(regex="x"), "structured_outputs.regex"),
        (
            {"structured_outputs": {"choice": ["a"]}},
            pb.StructuredOutput(choice=pb.ChoiceList(choices=["a"])),
            "structured_outputs.choice",
        ),
        (
            {"structured_outputs": {"grammar": "g"}},
            pb.StructuredOutput(grammar="g"),
            "structured_outputs.grammar",
        ),
        (
            {"structured_outputs": {"json_object": True}},
            pb.StructuredOutput(json_object=True),
            "structured_outputs.json_object",
        ),
    ],
)
def test_each_output_constraint_translates_and_remembers_its_param(fields, expected, param):
    for request in (chat(**fields), completion(**fields)):
        assert request.generate.structured_output == expected
        assert request.constraint_param == param
        assert request.param_for("structured_output.json_schema") == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "json": SCHEMA}}, "structured_outputs.regex"),
        (
            {
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
                "structured_outputs": {"regex": "a"},
            },
            "structured_outputs.regex",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required",
                "guided_json": SCHEMA,
            },
            "tool_choice",
        ),
    ],
)
def test_conflicting_constraints_are_refused_naming_both(fields, param):
    with pytest.raises(FieldError, match="one output constraint") as error:
        chat(**fields)
    assert error.value.param == param
    assert str(error.value).startswith(param)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": "{not json"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": "json"}, "response_format"),
        ({"guided_json": 3}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", 1]}, "guided_choice"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object"),
        ({"structured_outputs": "json"}, "structured_outputs"),
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
            "tools[0].function.strict",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"},
            "tool_choice",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function"}},
            "tool_choice.function",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}], "parallel_tool_calls": "no"},
            "parallel_tool_calls",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
                        ],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 3}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        (
            {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": 1}},
            "stream_options.continuous_usage_stats",
        ),
    ],
)
def test_bad_structured_output_and_tool_values_name_the_param(fields, param):
    with pytest.raises(FieldError) as error:
        chat(**fields)
    assert error.value.param == param, error.value
    assert str(error.value).startswith(param)


WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather now", "parameters": SCHEMA, "strict": True},
}


def test_tools_tool_choice_and_a_tool_result_turn_translate():
    request = chat(
        messages=[
            {"role": "user", "content": "Weather in Paris?", "name": "bob"},
            {
                "role": "assistant",
                "content": None,
                "refusal": None,
                "reasoning_content": "think",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        tools=[WEATHER_TOOL, {"type": "function", "function": {"name": "noop"}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
    )
    generate = request.generate
    assert [(t.name, t.description, t.parameters_json) for t in generate.tools] == [
        ("get_weather", "Weather now", json.dumps(SCHEMA)),
        ("noop", "", ""),
    ]
    assert generate.tool_choice == pb.ToolChoice(function_name="get_weather")
    assert generate.HasField("parallel_tool_calls") and not generate.parallel_tool_calls
    user, assistant, tool = generate.messages
    assert user.name == "bob"
    assert assistant.content == "" and list(assistant.tool_calls) == [
        pb.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    ]
    assert (tool.role, tool.tool_call_id, tool.content) == ("tool", "call_1", "sunny")
    for mode, value in (("none", pb.TOOL_CHOICE_NONE), ("auto", pb.TOOL_CHOICE_AUTO),
                        ("required", pb.TOOL_CHOICE_REQUIRED)):  # fmt: skip
        assert chat(tools=[WEATHER_TOOL], tool_choice=mode).generate.tool_choice.mode == value
    assert not chat(tools=[WEATHER_TOOL]).generate.HasField("tool_choice")


def test_skip_special_tokens_is_passed_on_only_when_given():
    assert not chat().generate.HasField("skip_special_tokens")
    assert chat(skip_special_tokens=False).generate.skip_special_tokens is False
    with pytest.raises(FieldError) as error:
        chat(skip_special_tokens="no")
    assert error.value.param == "skip_special_tokens"


def test_chat_template_kwargs_travel_as_json_and_errors_name_the_http_param():
    request = chat(chat_template_kwargs={"enable_thinking": False})
    assert json.loads(request.generate.chat_template_kwargs_json) == {"enable_thinking": False}
    assert request.param_for("chat_template_kwargs_json") == "chat_template_kwargs"
    assert not chat(chat_template_kwargs={}).generate.chat_template_kwargs_json
    with pytest.raises(FieldError) as error:
        chat(chat_template_kwargs=["enable_thinking"])
    assert error.value.param == "chat_template_kwargs"


def test_grpc_field_paths_map_to_the_http_params_used():
    request = chat(tools=[WEATHER_TOOL], guided_json=SCHEMA)
    assert request.param_for("structured_output.json_schema") == "guided_json"
    assert request.param_for("tools[1].parameters_json") == "tools[1].function.parameters"
    assert request.param_for("tools[0].name") == "tools[0].function.name"
    assert request.param_for("tool_choice.function_name") == "tool_choice"
    assert (
        request.param_for("messages[2].tool_calls[0].arguments")
        == "messages[2].tool_calls[0].function.arguments"
    )
    assert request.param_for("messages[2].content") == "messages[2].content"

    class ConstraintError(InvalidRequestError):
        field = "structured_output.json_schema"

    status, body = http_error(ConstraintError("structured_output.json_schema: xgrammar cannot compile it"),
                              request.param_for)  # fmt: skip
    assert status == 400 and body["error"]["param"] == "guided_json"
    assert body["error"]["message"] == "guided_json: xgrammar cannot compile it"


def test_extras_request_id_stop_string_and_continuous_usage():
    request = chat(request_id="abc", include_stop_str_in_output=True, stream=True,
                   stream_options={"include_usage": True, "continuous_usage_stats": True})  # fmt: skip
    assert request.generate.request_id == "abc" and request.include_stop and request.continuous_usage
    assert not chat(stream=True, stream_options={"continuous_usage_stats": True}).continuous_usage


@pytest.mark.parametrize(
    ("endpoint", "fields", "param"),
    [
        (Endpoint.CHAT, {"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0].type"),
        (
            Endpoint.CHAT,
            {"tools": [{"type": "function", "function": {"name": "f", "x": 1}}]},
            "tools[0].function.x",
        ),
        (Endpoint.COMPLETION, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        (
            Endpoint.CHAT,
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}},
            "response_format.json_schema.x",
        ),
        (Endpoint.CHAT, {"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
        (Endpoint.COMPLETION, {"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
        (Endpoint.CHAT, {"store": True}, "store"),
        (Endpoint.CHAT, {"continue_final_message": True}, "continue_final_message"),
        (Endpoint.CHAT, {"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        (
            Endpoint.CHAT,
            {"messages": [{"role": "user", "content": "hi", "function_call": {}}]},
            "messages[0].function_call",
        ),
        (Endpoint.CHAT, {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        (Endpoint.CHAT, {"modalities": ["text", "audio"]}, "modalities"),
        (Endpoint.CHAT, {"functions": [{"name": "f"}]}, "functions"),
        (Endpoint.CHAT, {"reasoning_effort": "high"}, "reasoning_effort"),
        (Endpoint.CHAT, {"no_such_field": 1}, "no_such_field"),
        (Endpoint.CHAT, {"prompt": "hi"}, "prompt"),
        (Endpoint.COMPLETION, {"messages": []}, "messages"),
        (Endpoint.COMPLETION, {"echo": True}, "echo"),
        (Endpoint.COMPLETION, {"suffix": "end"}, "suffix"),
        (Endpoint.COMPLETION, {"best_of": 3}, "best_of"),
        (Endpoint.COMPLETION, {"prompt": ["a", "b"]}, "prompt"),
        (
            Endpoint.CHAT,
            {"stream": True, "stream_options": {"include_usage": True, "chunk_size": 3}},
            "stream_options.chunk_size",
        ),
        (
            Endpoint.CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0]",
        ),
    ],
)
def test_unsupported_fields_are_refused_by_name(endpoint, fields, param):
    base = CHAT if endpoint is Endpoint.CHAT else COMPLETION
    with pytest.raises(UnsupportedFieldError) as error:
        translate({**base, **fields}, endpoint)
    assert error.value.param.startswith(param) and str(error.value).startswith(param)
    status, body = http_error(error.value)
    assert status == 400 and body["error"]["param"] == error.value.param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": 2**40}, "max_tokens"),
        ({"n": "2"}, "n"),
        ({"n": 0}, "n"),
        ({"seed": 2**70}, "seed"),
        ({"stop": ["a", 1]}, "stop"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"1": "big"}}, "logit_bias"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": 3, "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"user": 7}, "user"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
    ],
)
def test_wrong_json_types_name_the_field(fields, param):
    with pytest.raises(FieldError) as error:
        chat(**fields)
    assert error.value.param == param


@pytest.mark.parametrize("prompt", ["", [], None, [1, "2"], {"text": "hi"}])
def test_bad_completion_prompts_name_the_prompt(prompt):
    with pytest.raises(FieldError) as error:
        completion(prompt=prompt)
    assert error.value.param == "prompt"


def test_a_body_that_is_not_an_object_is_refused():
    with pytest.raises(FieldError, match="JSON object"):
        translate(["hi"], Endpoint.CHAT)


def test_ranges_are_left_to_the_validation_grpc_requests_go_through():
    request = chat(temperature=-1.0, presence_penalty=3.0)
    with pytest.raises(InvalidRequestError, match="temperature must be >= 0"):
        sampling_params(request.generate.sampling)


# --- responses -----------------------------------------------------------------------------------

TOKENS = {1: "Hel", 2: "lo", 3: "!", 4: "é"}


def message(index=0, text="", token_ids=(), logprobs=(), finish=None, completion_tokens=0, stop=None):
    response = pb.GenerateResponse(request_id="r", index=index, text=text, token_ids=list(token_ids))
    for token_id, logprob in logprobs:
        response.logprobs.add(
            token_id=token_id, logprob=logprob, top=[pb.TopLogprob(token_id=4, logprob=-0.5)] * 3
        )
    if finish is not None:
        response.finish_reason = finish
        response.usage.prompt_tokens = 5
        response.usage.completion_tokens = completion_tokens
        response.usage.cached_tokens = 4
        if stop is not None:
            response.stop_string = stop
    return response


def builder(request) -> ResponseBuilder:
    return ResponseBuilder(request, "r", "served", TOKENS.__getitem__, created=123)


def test_chat_stream_chunks_role_first_then_deltas_then_finish_and_usage():
    build = builder(chat(stream=True, stream_options={"include_usage": True}))
    first = build.chunks(message(text="Hel", token_ids=[1]))
    assert [c["choices"][0]["delta"] for c in first] == [
        {"role": "assistant", "content": ""},
        {"content": "Hel"},
    ]
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in first)
    assert first[0]["id"] == "chatcmpl-r" and first[0]["model"] == "served" and first[0]["created"] == 123
    (last,) = build.chunks(message(token_ids=[3], finish=pb.STOP, completion_tokens=2, stop="!"))
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    assert last["choices"][0]["stop_reason"] == "!"
    usage = build.usage_chunk()
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_chat_stream_without_include_usage_has_no_usage_key():
    build = builder(chat(stream=True))
    assert all("usage" not in chunk for chunk in build.chunks(message(text="a", token_ids=[1])))


def test_non_streamed_chat_with_two_choices_and_logprobs():
    build = builder(chat(n=2, logprobs=True, top_logprobs=2))
    build.add(message(index=0, text="Hel", token_ids=[1], logprobs=[(1, -0.1)]))
    build.add(message(index=1, text="é", token_ids=[4], logprobs=[(4, -0.2)]))
    build.add(message(index=1, finish=pb.LENGTH, completion_tokens=1))
    build.add(
        message(
            index=0, text="lo", token_ids=[2], logprobs=[(2, -0.3)], finish=pb.LENGTH, completion_tokens=2
        )
    )
    body = build.body()
    assert body["object"] == "chat.completion"
    first, second = body["choices"]
    assert (
        first["message"] == {"role": "assistant", "content": "Hello"} and first["finish_reason"] == "length"
    )
    assert second["message"]["content"] == "é" and second["index"] == 1
    content = first["logprobs"]["content"]
    assert [(c["token"], c["logprob"]) for c in content] == [
        ("Hel", pytest.approx(-0.1)),
        ("lo", pytest.approx(-0.3)),
    ]
    assert len(content[0]["top_logprobs"]) == 2, "trimmed to top_logprobs"
    assert second["logprobs"]["content"][0]["bytes"] == list("é".encode())
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_completion_logprobs_format_and_stream_chunks():
    build = builder(completion(logprobs=1, stream=True))
    (chunk,) = build.chunks(message(text="Hello", token_ids=[1, 2], logprobs=[(1, -0.1), (2, -0.2)]))
    assert (
        chunk["object"] == "text_completion"
        and chunk["id"] == "cmpl-r"
        and chunk["choices"][0]["text"] == "Hello"
    )
    logprobs = chunk["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["Hel", "lo"] and logprobs["text_offset"] == [0, 3]
    assert logprobs["top_logprobs"] == [{"é": -0.5}, {"é": -0.5}]
    (final,) = build.chunks(message(finish=pb.ABORT, completion_tokens=2))
    assert final["choices"][0]["finish_reason"] == "abort" and final["choices"][0]["text"] == ""


def test_no_logprobs_asked_gives_null_logprobs():
    build = builder(completion())
    build.add(message(text="Hel", token_ids=[1], finish=pb.STOP, completion_tokens=1))
    (choice,) = build.body()["choices"]
    assert choice["logprobs"] is None and choice["text"] == "Hel" and choice["stop_reason"] is None


# --- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (InvalidRequestError("temperature must be >= 0"), 400, "invalid_request_error"),
        (UnauthorizedError("missing bearer token"), 401, "authentication_error"),
        (ModelNotServedError("the model x does not exist"), 404, "not_found_error"),
        (BodyTooLargeError("too big"), 413, "invalid_request_error"),
        (QueueFullError("queue full"), 429, "rate_limit_error"),
        (OutOfBlocksError("no blocks"), 429, "rate_limit_error"),
        (DrainingError("draining"), 503, "service_unavailable_error"),
        (RuntimeError("bug"), 500, "server_error"),
    ],
)
def test_errors_map_to_openai_statuses_and_bodies(error, status, kind):
    got_status, body = http_error(error)
    assert got_status == status
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["type"] == kind
    if status == 500:
        assert "bug" not in body["error"]["message"], "internals stay in the server log"
    else:
        assert body["error"]["message"] == str(error)


@pytest.mark.parametrize(
    "request_fields",
    [
        pytest.param(lambda: chat(stream=True, n=2, stream_options={"include_usage": True}), id="chat"),
        pytest.param(lambda: chat(stream=True, logprobs=True, top_logprobs=1), id="chat-logprobs"),
        pytest.param(lambda: completion(stream=True, n=2), id="completion"),
        pytest.param(lambda: completion(stream=True, logprobs=1), id="completion-logprobs"),
    ],
)
def test_stream_events_are_the_chunks_as_server_sent_events(request_fields):
    """`events` (with its template for plain text) writes exactly what `chunks` says, message by message."""
    messages = [
        message(index=0, text="Hel", token_ids=[1]),
        message(index=1, text='"quoted"\n\\', token_ids=[2]),
        message(index=0, text="é ☃ \U0001f600", token_ids=[4]),
        message(index=0, text="", token_ids=[3]),
        message(index=1, text="lo", token_ids=[2], logprobs=[(2, -0.2)]),
        message(index=0, text="\x00\x1f</script>", token_ids=[3]),
        message(index=0, text="!", token_ids=[3], finish=pb.STOP, completion_tokens=4, stop="!"),
        message(index=1, text="lo", token_ids=[2], finish=pb.LENGTH, completion_tokens=2),
    ]
    by_chunks, by_events = builder(request_fields()), builder(request_fields())
    for sent in messages:
        expected = b"".join(
            b"data: " + json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
            for chunk in by_chunks.chunks(sent)
        )
        assert by_events.events(sent) == expected
    assert by_events.usage_chunk() == by_chunks.usage_chunk()


def tool_message(index=0, text="", reasoning="", calls=(), token_ids=(1,), finish=None, completion_tokens=0):
    response = message(index, text, token_ids, finish=finish, completion_tokens=completion_tokens)
    response.reasoning_text = reasoning
    response.tool_calls.extend(pb.ToolCallDelta(**call) for call in calls)
    return response


TOOL_STREAM = [
    tool_message(reasoning="Need weather."),
    tool_message(
        text="Checking.", calls=[{"index": 0, "id": "call_a", "name": "get_weather", "arguments": ""}]
    ),
    tool_message(calls=[{"index": 0, "arguments": '{"city": '}]),
    tool_message(calls=[{"index": 0, "arguments": '"Paris"}'}, {"index": 1, "id": "call_b", "name": "noop"}]),
    tool_message(calls=[{"index": 1, "arguments": "{}"}], finish=pb.TOOL_CALLS, completion_tokens=4),
]


def test_streamed_tool_calls_and_reasoning_go_out_as_openai_and_vllm_send_them():
    build = builder(chat(stream=True))
    deltas = [chunk["choices"][0] for sent in TOOL_STREAM for chunk in build.chunks(sent)]
    assert [d["delta"] for d in deltas] == [
        {"role": "assistant", "content": ""},
        {"reasoning_content": "Need weather."},
        {
            "content": "Checking.",
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ""},
                }
            ],
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
        {
            "tool_calls": [
                {"index": 0, "function": {"arguments": '"Paris"}'}},
                {
                    "index": 1,
                    "id": "call_b",
                    "type": "function",
                    "function": {"name": "noop", "arguments": ""},
                },
            ]
        },
        {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]},
    ]
    assert deltas[-1]["finish_reason"] == "tool_calls"
    by_events = ResponseBuilder(
        chat(stream=True), "r", "served", TOKENS.__getitem__, created=123, parsed=True
    )
    by_chunks = builder(chat(stream=True))
    for sent in TOOL_STREAM:
        assert by_events.events(sent) == b"".join(
            b"data: " + json.dumps(c, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
            for c in by_chunks.chunks(sent)
        )


def test_whole_answer_with_tool_calls_has_null_content_only_without_text():
    build = builder(chat())
    for sent in TOOL_STREAM:
        build.add(sent)
    (choice,) = build.body()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {
        "role": "assistant",
        "content": "Checking.",
        "reasoning_content": "Need weather.",
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {"id": "call_b", "type": "function", "function": {"name": "noop", "arguments": "{}"}},
        ],
    }
    build = builder(chat())
    build.add(
        tool_message(calls=[{"index": 0, "id": "c", "name": "f", "arguments": "{}"}], finish=pb.TOOL_CALLS)
    )
    assert build.body()["choices"][0]["message"]["content"] is None
    plain = builder(chat())
    plain.add(message(text="hi", finish=pb.STOP))
    assert plain.body()["choices"][0]["message"] == {"role": "assistant", "content": "hi"}


def test_continuous_usage_puts_the_choices_usage_in_every_chunk():
    request = chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    build = ResponseBuilder(request, "r", "served", TOKENS.__getitem__, created=1, prompt_tokens=5)
    chunks = build.chunks(message(text="Hel", token_ids=[1]))
    chunks += build.chunks(message(text="lo", token_ids=[2, 2]))
    assert build.events(message(text="!", token_ids=[3])).count(b'"completion_tokens":4') == 1
    chunks += build.chunks(message(token_ids=[3], finish=pb.STOP, completion_tokens=5))
    assert [(c["usage"]["prompt_tokens"], c["usage"]["completion_tokens"]) for c in chunks] == [
        (5, 0),
        (5, 1),
        (5, 3),
        (5, 5),
    ]
    assert build.usage_chunk()["usage"]["completion_tokens"] == 5


def test_include_stop_str_in_output_keeps_the_matched_stop_string():
    for stream in (True, False):
        build = builder(chat(stream=stream, include_stop_str_in_output=True))
        sent = [
            message(text="Hel", token_ids=[1]),
            message(text="lo", token_ids=[2], finish=pb.STOP, stop="!"),
        ]
        if stream:
            text = "".join(c["choices"][0]["delta"].get("content", "") for m in sent for c in build.chunks(m))
        else:
            for m in sent:
                build.add(m)
            text = build.body()["choices"][0]["message"]["content"]
        assert text == "Hello!"


_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=8,
)
_FIELDS = sorted(ChatCompletionRequest.model_fields | CompletionRequest.model_fields)


def _objects(model) -> st.SearchStrategy:
    """JSON objects with some of `model`'s keys, each holding any JSON."""
    return st.dictionaries(
        st.sampled_from(sorted(f.alias or n for n, f in model.model_fields.items())), _JSON_VALUES
    )


_NESTED = st.fixed_dictionaries(
    {},
    optional={
        "messages": st.lists(_objects(ChatMessage), min_size=1, max_size=2),
        "tools": st.lists(
            st.fixed_dictionaries({"type": st.just("function"), "function": _objects(FunctionDefinition)})
        ),
        "response_format": _objects(ResponseFormat),
        "structured_outputs": _objects(StructuredOutputs),
        "stream_options": _objects(StreamOptions),
    },
)


@settings(max_examples=300, deadline=None)
@given(
    endpoint=st.sampled_from(list(Endpoint)),
    fields=st.dictionaries(st.sampled_from(_FIELDS), _JSON_VALUES, max_size=3) | _NESTED,
)
def test_any_json_in_any_field_translates_or_names_the_field(endpoint, fields):
    """Whatever JSON a client puts in the fields tandem knows, the answer is a request or a `FieldError`
    whose message starts with the parameter it names, never another exception."""
    base = CHAT if endpoint is Endpoint.CHAT else COMPLETION
    try:
        translate({**base, **fields}, endpoint)
    except FieldError as error:
        assert error.param and str(error).startswith(error.param), error
