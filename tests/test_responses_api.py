"""The Responses API's protocol, without a server: a `POST /v1/responses` body → `GenerateRequest`
(turns, sampling, tools, structured output, a stored conversation continued), the 400 each wrong field
gets (naming it), and the response object and stream events built from `GenerateResponse`s."""

from __future__ import annotations

import json

import pytest

from decode_service.front_door.admission import RequestLimits
from decode_service.front_door.openai_http.errors import FieldError, ResponseNotFoundError, http_error
from decode_service.front_door.openai_http.response_store import StoredResponse
from decode_service.front_door.openai_http.responses_api import (
    ResponsesAnswer,
    new_response_id,
    stream_event,
    translate_responses,
)
from protos.tandem.v1 import generation_pb2 as pb

LIMITS = RequestLimits()
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER}


def turns(request: pb.GenerateRequest) -> list[tuple]:
    return [
        (m.role, m.content, [(c.id, c.name, c.arguments) for c in m.tool_calls], m.tool_call_id)
        for m in request.messages
    ]


def test_a_string_input_with_instructions_is_a_system_and_a_user_turn():
    call = translate_responses(
        {"input": "Hi", "instructions": "Be brief", "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9},
        LIMITS,
    )
    assert turns(call.generate) == [("system", "Be brief", [], ""), ("user", "Hi", [], "")]
    assert call.generate.stopping.max_tokens == 7
    assert call.generate.sampling.temperature == 0.5
    assert call.generate.sampling.top_p == pytest.approx(0.9)
    # The stored conversation leaves the instructions out: a continuation does not inherit them.
    assert [m.role for m in call.conversation] == ["user"]


def test_items_become_turns_with_calls_joined_to_the_assistant_turn():
    items = [
        {"role": "developer", "content": "Use tools"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Paris?"}]},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "t"}],
        },
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city":"Paris"}',
        },
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city":"Nice"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {
            "type": "function_call_output",
            "call_id": "call_2",
            "output": [{"type": "input_text", "text": "rain"}],
        },
    ]
    call = translate_responses({"input": items, "tools": [TOOL], "tool_choice": "auto"}, LIMITS)
    assert turns(call.generate) == [
        ("system", "Use tools", [], ""),
        ("user", "Paris?", [], ""),
        (
            "assistant",
            "",
            [("call_1", "get_weather", '{"city":"Paris"}'), ("call_2", "get_weather", '{"city":"Nice"}')],
            "",
        ),
        ("tool", "sunny", [], "call_1"),
        ("tool", "rain", [], "call_2"),
    ]
    assert call.generate.messages[3].name == "get_weather"
    assert call.generate.tools[0].name == "get_weather"
    assert json.loads(call.generate.tools[0].parameters_json) == WEATHER
    assert call.generate.tool_choice.mode == pb.TOOL_CHOICE_AUTO


def test_named_tool_choice_and_json_schema_format_translate():
    named = translate_responses(
        {"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"}}, LIMITS
    )
    assert named.generate.tool_choice.function_name == "get_weather"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    structured = translate_responses(
        {
            "input": "x",
            "text": {"format": {"type": "json_schema", "name": "A", "schema": schema, "strict": True}},
        },
        LIMITS,
    )
    assert json.loads(structured.generate.structured_output.json_schema) == schema
    assert structured.param_for("structured_output.json_schema") == "text.format.schema"
    assert structured.param_for("tools[0].parameters_json") == "tools[0].parameters"
    as_object = translate_responses({"input": "x", "text": {"format": {"type": "json_object"}}}, LIMITS)
    assert as_object.generate.structured_output.json_object


def stored_response(output: list[dict], conversation: list[pb.ChatMessage]) -> StoredResponse:
    body = {"id": "resp_1", "output": output}
    return StoredResponse.of(body, conversation, len(json.dumps(body)))


def test_previous_response_puts_its_conversation_and_output_first():
    earlier = stored_response(
        [
            {"type": "reasoning", "id": "rs", "summary": [], "content": [], "status": "completed"},
            {"type": "message", "content": [{"type": "output_text", "text": "Hello Ann"}]},
        ],
        [pb.ChatMessage(role="user", content="I am Ann")],
    )
    asked: list[str] = []

    def lookup(response_id: str) -> StoredResponse | None:
        asked.append(response_id)
        return earlier if response_id == "resp_1" else None

    call = translate_responses(
        {"input": "Who am I?", "previous_response_id": "resp_1", "instructions": "New"}, LIMITS, lookup
    )
    assert turns(call.generate) == [
        ("system", "New", [], ""),
        ("user", "I am Ann", [], ""),
        ("assistant", "Hello Ann", [], ""),
        ("user", "Who am I?", [], ""),
    ]
    assert asked == ["resp_1"]
    with pytest.raises(ResponseNotFoundError) as missing:
        translate_responses({"input": "x", "previous_response_id": "resp_2"}, LIMITS, lookup)
    status, body = http_error(missing.value)
    assert status == 404 and body["error"]["param"] == "previous_response_id"


@pytest.mark.parametrize(
    "body, param, text",
    [
        ({}, "input", "required"),
        ({"input": ""}, "input", "empty"),
        ({"input": []}, "input", "empty"),
        ({"input": 5}, "input", "non-empty string"),
        ({"input": [{"type": "input_image"}]}, "input[0].type", "input_image"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0].type",
            "input_image",
        ),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "robot"),
        ({"input": [{"role": "user", "content": 3}]}, "input[0].content", "string"),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0].call_id",
            "required",
        ),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 7}]}, "input[0].output", "7"),
        ({"input": "x", "instructions": 3}, "instructions", "string"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "range"),
        ({"input": "x", "max_output_tokens": "9"}, "max_output_tokens", "integer"),
        ({"input": "x", "temperature": 3}, "temperature", "range"),
        ({"input": "x", "temperature": "hot"}, "temperature", "number"),
        ({"input": "x", "top_p": 0}, "top_p", "range"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", "web_search"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name", "required"),
        (
            {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": 1}]},
            "tools[0].parameters",
            "",
        ),
        ({"input": "x", "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"input": "x", "tools": [TOOL], "tool_choice": "any"}, "tool_choice", "auto"),
        ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "mcp"}}, "tool_choice.type", "mcp"),
        (
            {
                "input": "x",
                "tools": [TOOL],
                "tool_choice": "required",
                "text": {"format": {"type": "json_object"}},
            },
            "tool_choice",
            "one output constraint",
        ),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type", "xml"),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "A"}}},
            "text.format.schema",
            "required",
        ),
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": 5}}}, "text.format.schema", ""),
        ({"input": "x", "text": "json"}, "text", "object"),
        ({"input": "x", "previous_response_id": 5}, "previous_response_id", "string"),
        (
            {"input": "x", "previous_response_id": "resp_1"},
            "previous_response_id",
            "--enable-responses-store",
        ),
        ({"input": "x", "store": "yes"}, "store", "boolean"),
        ({"input": "x", "stream": 1}, "stream", "boolean"),
        ({"input": "x", "metadata": {"k": 1}}, "metadata.k", "string"),
        ({"input": "x", "truncation": "auto"}, "truncation", "not supported"),
        ({"input": "x", "background": True}, "background", "not supported"),
        ({"input": "x", "reasoning": {"effort": "max"}}, "reasoning.effort", "max"),
        ({"input": "x", "frequency_penalty": 1}, "frequency_penalty", "not supported"),
        ([1], "body", "JSON object"),
    ],
)
def test_each_wrong_field_is_a_400_naming_it(body, param, text):
    with pytest.raises(FieldError) as refused:
        translate_responses(body, LIMITS)
    status, error = http_error(refused.value)
    assert status == 400
    assert error["error"]["param"] == param
    assert error["error"]["message"].startswith(param) or param == "body"
    assert text in error["error"]["message"]


def test_more_items_than_chat_turns_allowed_is_refused_before_parsing():
    limits = RequestLimits(max_chat_messages=2)
    with pytest.raises(FieldError, match="--max-chat-messages") as refused:
        translate_responses({"input": [{"role": "user", "content": "x"}] * 3}, limits)
    assert refused.value.param == "input"


def message(**fields) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id="r", **fields)


def finished(reason: int, completion_tokens: int) -> pb.GenerateResponse:
    return message(
        finish_reason=reason,
        usage=pb.Usage(prompt_tokens=11, completion_tokens=completion_tokens, cached_tokens=8),
    )


def run(body: dict, messages: list[pb.GenerateResponse]) -> tuple[ResponsesAnswer, list[dict]]:
    answer = ResponsesAnswer(translate_responses(body, LIMITS), new_response_id(), "m", stored=False)
    events = answer.start()
    for each in messages:
        events += answer.feed(each)
    events += answer.finish()
    return answer, events


def test_stream_events_open_grow_and_close_each_item_in_order():
    answer, events = run(
        {"input": "x", "tools": [TOOL], "stream": True},
        [
            message(token_ids=[1, 2], reasoning_text="Think"),
            message(token_ids=[3], text="Hi"),
            message(token_ids=[4], text=" there"),
            message(token_ids=[5], tool_calls=[pb.ToolCallDelta(index=0, id="call_a", name="get_weather")]),
            message(token_ids=[6], tool_calls=[pb.ToolCallDelta(index=0, arguments='{"city":')]),
            message(token_ids=[7], tool_calls=[pb.ToolCallDelta(index=0, arguments='"Oslo"}')]),
            finished(pb.TOOL_CALLS, 7),
        ],
    )
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    text_done = events[12]
    assert text_done["text"] == "Hi there" and text_done["output_index"] == 1
    assert events[18]["arguments"] == '{"city":"Oslo"}' and events[18]["name"] == "get_weather"
    body = events[-1]["response"]
    assert body == answer.body()
    assert body["status"] == "completed" and body["incomplete_details"] is None
    reasoning, said, called = body["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Think"}]
    assert said["content"][0]["text"] == "Hi there" and said["status"] == "completed"
    assert said["id"] == events[8]["item"]["id"] == events[10]["item_id"]
    assert (called["call_id"], called["name"], called["arguments"]) == (
        "call_a",
        "get_weather",
        '{"city":"Oslo"}',
    )
    assert body["usage"] == {
        "input_tokens": 11,
        "input_tokens_details": {"cached_tokens": 8},
        "output_tokens": 7,
        "output_tokens_details": {"reasoning_tokens": 2},
        "total_tokens": 18,
    }
    assert stream_event(events[0]).startswith(b"event: response.created\ndata: {")


def test_an_answer_cut_by_max_output_tokens_is_incomplete():
    answer, events = run(
        {"input": "x", "max_output_tokens": 2}, [message(token_ids=[1, 2], text="ab"), finished(pb.LENGTH, 2)]
    )
    body = answer.body()
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete"
    assert body["max_output_tokens"] == 2
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["status"] == "incomplete"


def test_the_response_echoes_its_request():
    answer, _ = run(
        {
            "input": "x",
            "instructions": "I",
            "tools": [TOOL],
            "tool_choice": "none",
            "temperature": 0.2,
            "metadata": {"k": "v"},
            "user": "ann",
            "text": {"format": {"type": "json_object"}},
        },
        [message(token_ids=[1], text="{}"), finished(pb.STOP, 1)],
    )
    body = answer.body()
    assert body["id"].startswith("resp_") and body["object"] == "response"
    assert body["instructions"] == "I" and body["tool_choice"] == "none"
    assert body["tools"] == [TOOL] and body["metadata"] == {"k": "v"} and body["user"] == "ann"
    assert body["text"] == {"format": {"type": "json_object"}} and body["temperature"] == 0.2
    assert body["store"] is False


def test_an_engine_error_mid_stream_is_an_error_event_naming_the_parameter():
    answer, _ = run({"input": "x"}, [message(token_ids=[1], text="a")])
    status, body = http_error(FieldError("text.format.schema", "text.format.schema allows no token"))
    event = answer.error_event(body)
    assert status == 400 and event["type"] == "error"
    assert event["param"] == "text.format.schema" and "allows no token" in event["message"]
    assert event["sequence_number"] > 0
    assert stream_event(event).startswith(b"event: error\n")
