"""Text the server did not write, end to end on a live server (gRPC and HTTP): JSON inside request string
fields nested too deeply or holding lone surrogates, string patterns a JSON string cannot hold unescaped,
tool calls the model writes with such text, and logprob bytes of characters split across tokens. Each bad
input is a 400 / INVALID_ARGUMENT naming its field (or, written by the model, plain answer text), never a
500, and the server keeps serving the next request."""

from __future__ import annotations

import json
import re

import grpc
import pytest
from conftest import save_tiny_model, wait_until
from test_openai_api import MODEL, Server, http_call

from decode_service.front_door.json_text import MAX_NESTING
from protos.tandem.v1 import generation_pb2 as pb

pytestmark = pytest.mark.slow

USER = pb.ChatMessage(role="user", content="Answer.")
MESSAGES = [{"role": "user", "content": "Answer."}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
DEEP = '{"a": ' + "[" * 5000 + "]" * 5000 + "}"  # past Python's recursion limit, let alone the bound
SURROGATE = '{"a": "\\ud800"}'  # a lone surrogate escape: valid JSON, no text
TOO_DEEP = "nests arrays or objects too deeply"
LONE = "holds a lone UTF-16 surrogate"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-untrusted-model")
    save_tiny_model(directory, 17)
    running = Server(directory, max_model_len=512, tool_call_parser="hermes")
    yield running
    running.close()


def chat_request(**fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        messages=fields.pop("messages", [USER]),
        sampling=fields.pop("sampling", pb.SamplingParams(temperature=0.0)),
        stopping=pb.StoppingParams(max_tokens=fields.pop("max_tokens", 40)),
        **fields,
    )


def grpc_refusal(server: Server, request: pb.GenerateRequest) -> str:
    with pytest.raises(grpc.RpcError) as caught:
        list(server.stub.Generate(request, timeout=120))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    return caught.value.details()


def http_refusal(server: Server, **body) -> tuple[str, str]:
    status, answer = http_call(
        server, "POST", "/v1/chat/completions", {"model": MODEL, "max_tokens": 8, **body}
    )
    assert status == 400, answer
    return answer["error"]["param"], answer["error"]["message"]


def chat_body(**body) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 80, **body}


def assert_still_serving(server: Server) -> None:
    request = chat_request(structured_output=pb.StructuredOutput(regex="ok|fine"))
    responses = list(server.stub.Generate(request, timeout=120))
    assert "".join(r.text for r in responses) in ("ok", "fine") and responses[-1].finish_reason == pb.STOP
    assert wait_until(server.idle), "a refused request still holds KV blocks or a slot"


def pattern_schema(pattern: str) -> dict:
    return {
        "type": "object",
        "properties": {"q": {"type": "string", "pattern": pattern}},
        "required": ["q"],
        "additionalProperties": False,
    }


# --- JSON inside request string fields (defect 13) --------------------------------------------------


@pytest.mark.parametrize(("text", "needle"), [(DEEP, TOO_DEEP), (SURROGATE, LONE)], ids=["deep", "surrogate"])
def test_json_in_grpc_string_fields_is_refused_by_field(server, text, needle):
    call = pb.ToolCall(id="call_1", name="f", arguments=text)
    result = pb.ChatMessage(role="tool", tool_call_id="call_1", content="1")
    replayed = [USER, pb.ChatMessage(role="assistant", tool_calls=[call]), result]
    requests = {
        "messages[1].tool_calls[0].arguments": chat_request(messages=replayed),
        "structured_output.json_schema": chat_request(
            structured_output=pb.StructuredOutput(json_schema=text)
        ),
        "tools[0].parameters_json": chat_request(tools=[pb.FunctionTool(name="f", parameters_json=text)]),
        "chat_template_kwargs_json": chat_request(chat_template_kwargs_json=text),
    }
    for field, request in requests.items():
        details = grpc_refusal(server, request)
        assert details.startswith(f"{field}: ") and needle in details, details
    assert_still_serving(server)


def test_json_in_http_string_fields_is_refused_naming_the_parameter(server):
    for text, needle in ((DEEP, TOO_DEEP), (SURROGATE, LONE)):
        call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": text}}
        result = {"role": "tool", "tool_call_id": "call_1", "content": "1"}
        messages = [*MESSAGES, {"role": "assistant", "tool_calls": [call]}, result]
        param, message = http_refusal(server, messages=messages, tools=[TOOL])
        assert param == "messages[1].tool_calls[0].function.arguments" and needle in message, message
        response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": text}}
        param, message = http_refusal(server, messages=MESSAGES, response_format=response_format)
        assert param == "response_format.json_schema.schema" and needle in message, message
        param, message = http_refusal(server, messages=MESSAGES, structured_outputs={"json": text})
        assert param == "structured_outputs.json" and needle in message, message
    # An object field nested past the bound: the body is refused (it would reach the template).
    kwargs: object = 1
    for _ in range(MAX_NESTING + 50):
        kwargs = {"a": kwargs}
    param, message = http_refusal(server, messages=MESSAGES, chat_template_kwargs=kwargs)
    assert param == "body" and TOO_DEEP in message, message
    assert_still_serving(server)


# --- string patterns JSON cannot hold unescaped (defect 10) -----------------------------------------


@pytest.mark.parametrize("pattern", ['"', '\\\\"', "\\n", '^"[a-z]{1,3}"$', "é\\x22"])
def test_a_pattern_only_escaped_text_matches_is_refused_by_its_path(server, pattern):
    schema = json.dumps(pattern_schema(pattern))
    details = grpc_refusal(server, chat_request(structured_output=pb.StructuredOutput(json_schema=schema)))
    assert details.startswith(f"structured_output.json_schema: properties.q.pattern {pattern!r} "), details
    tools = [pb.FunctionTool(name="f", parameters_json=schema)]
    details = grpc_refusal(server, chat_request(tools=tools, tool_choice=pb.ToolChoice(function_name="f")))
    assert details.startswith(f"tools[0].parameters_json: properties.q.pattern {pattern!r} "), details
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": pattern_schema(pattern)}}
    param, message = http_refusal(server, messages=MESSAGES, response_format=response_format)
    assert param == "response_format.json_schema.schema", message
    assert message.startswith(f"{param}: properties.q.pattern {pattern!r} "), message
    assert_still_serving(server)


def test_patterns_with_dots_and_classes_give_json_that_matches_them(server):
    """Even a model pushed toward writing a quote or a backslash (the tiny tokenizer's ids 4 and 62)
    writes the pattern's characters as JSON holds them: `é.` once let its `.` write a raw quote."""
    tiny_ids = server.engine.tokenizer.hf.convert_tokens_to_ids(['"', "\\"])
    assert tiny_ids == [4, 62]
    for pattern in ("^é.{1,4}$", "^.{2,6}$", "^[^a]{2,6}$", "^[ -~]{3}$"):
        schema = json.dumps(pattern_schema(pattern))
        for sampling in (pb.SamplingParams(temperature=0.0), pb.SamplingParams(temperature=1.0, seed=3)):
            sampling.logit_bias.update({4: 30.0, 62: 30.0})
            request = chat_request(
                structured_output=pb.StructuredOutput(json_schema=schema), sampling=sampling
            )
            responses = list(server.stub.Generate(request, timeout=120))
            answer = json.loads("".join(r.text for r in responses))
            assert re.fullmatch(pattern.strip("^$"), answer["q"]) and responses[-1].finish_reason == pb.STOP


# --- tool calls the model writes (defect 12) --------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_model_written_calls_with_lone_surrogates_are_answers_not_errors(server, stream):
    """The grammar makes the tiny model write each call exactly; the hermes parser reads it."""
    as_text = [
        '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": \\"\\ud800\\"}"}</tool_call>',
    ]
    as_call = '<tool_call>{"name": "f", "arguments": {"a": "\\ud800 x"}}</tool_call>'
    for written in [*as_text, as_call]:
        body = chat_body(tools=[TOOL], structured_outputs={"choice": [written]})
        if stream:
            content, calls, finish = streamed_chat(server, body)
        else:
            status, answer = http_call(server, "POST", "/v1/chat/completions", body)
            assert status == 200, answer
            choice = answer["choices"][0]
            content, calls = choice["message"]["content"], choice["message"].get("tool_calls") or []
            finish = choice["finish_reason"]
        if written in as_text:
            assert (content, calls, finish) == (written, [], "stop")
        else:
            assert not content and [call["function"]["name"] for call in calls] == ["f"]
            assert json.loads(calls[0]["function"]["arguments"]) == {"a": "\ud800 x"}
            assert finish == "tool_calls"
    assert_still_serving(server)


def streamed_chat(server: Server, body: dict) -> tuple[str, list[dict], str]:
    """(content, calls, finish reason) of a streamed chat; an error event fails the SDK's iteration."""
    stream = server.client.chat.completions.create(
        **{key: body[key] for key in ("model", "messages", "temperature", "max_tokens", "tools")},
        stream=True,
        extra_body={
            key: value
            for key, value in body.items()
            if key not in ("model", "messages", "temperature", "max_tokens", "tools")
        },  # fmt: skip
    )
    content, calls, finish = [], {}, None
    for chunk in stream:
        choice = chunk.choices[0]
        content.append(choice.delta.content or "")
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"function": {"name": delta.function.name, "arguments": ""}})
            call["function"]["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return "".join(content), [calls[index] for index in sorted(calls)], finish


# --- logprob bytes (defect 14) ----------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprob_bytes_put_together_are_the_answers_utf8(server, stream):
    answer = "řřřř 東京"
    body = chat_body(logprobs=True, top_logprobs=2, structured_outputs={"choice": [answer]})
    if stream:
        chunks = server.client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            temperature=0,
            max_tokens=80,
            logprobs=True,
            top_logprobs=2,
            stream=True,
            extra_body={"structured_outputs": {"choice": [answer]}},
        )
        entries, content = [], ""
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].logprobs:
                entries += [entry.model_dump() for entry in chunk.choices[0].logprobs.content]
            content += (chunk.choices[0].delta.content or "") if chunk.choices else ""
    else:
        status, whole = http_call(server, "POST", "/v1/chat/completions", body)
        assert status == 200, whole
        entries = whole["choices"][0]["logprobs"]["content"]
        content = whole["choices"][0]["message"]["content"]
    assert content == answer
    assert entries[-1]["token"] in ("<|endoftext|>", "<|im_end|>"), "the end token, which adds no text"
    entries = entries[:-1]
    assert len(entries) > len(answer), "the tiny vocabulary splits these characters between tokens"
    assert bytes(byte for entry in entries for byte in entry["bytes"]) == answer.encode()
