"""The OpenAI HTTP API without a server: request translation, response bodies and SSE chunks, errors."""

from __future__ import annotations

import json

import pytest

from decode_service.openai_http.errors import (
    BodyTooLargeError,
    ModelNotServedError,
    UnauthorizedError,
    http_error,
)
from decode_service.openai_http.protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    Endpoint,
    FieldError,
    UnsupportedFieldError,
    translate,
)
from decode_service.openai_http.responses import ResponseBuilder
from engine.errors import InvalidRequestError, OutOfBlocksError
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
    )
    generate = request.generate
    assert [(m.role, m.content) for m in generate.messages] == [("system", "be brief"), ("user", "a\nb")]
    sampling = generate.sampling
    assert (sampling.top_k, sampling.seed, sampling.logprobs) == (4, 2**64 - 1, 3)
    assert sampling.temperature == 0.5 and sampling.repetition_penalty == pytest.approx(1.2)
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
    chat(response_format={"type": "text"}, tool_choice="none", store=False, modalities=["text"], tools=None)
    completion(echo=False, suffix="", service_tier="auto")


@pytest.mark.parametrize(
    ("endpoint", "fields", "param"),
    [
        (Endpoint.CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        (Endpoint.CHAT, {"tool_choice": "auto"}, "tool_choice"),
        (Endpoint.CHAT, {"response_format": {"type": "json_object"}}, "response_format"),
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
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            "stream_options.",
        ),
        (
            Endpoint.CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0]",
        ),
        (Endpoint.CHAT, {"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages[0].name"),
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
