"""OpenAI's Responses API driven by the official `openai` SDK against a live server with the real default
model (SmolLM2-135M-Instruct): `responses.create`, `.stream`, `.parse` with a pydantic model, a
function-tool round trip, `previous_response_id` continuing a conversation, the store's tenants, and
refusals naming the field while the server keeps serving.

Greedy answers are compared with the chat route's for the same turns: the Responses route is the chat
route underneath, so the same prompt gives the same tokens.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from conftest import save_tiny_model
from pydantic import BaseModel, Field
from test_openai_api import MODEL, TOKEN, Server, http_call, published_schemas

from decode_service.server import MAX_HTTP_BODY_BYTES

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

TENANT_HEADER = "x-tenant"
GREEDY = {"temperature": 0.0}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": WEATHER,
    "strict": True,
}


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population: int = Field(ge=0, le=10**9)


@pytest.fixture(scope="module")
def server(real_model_dir):
    running = Server(
        real_model_dir,
        max_num_seqs=8,
        max_model_len=1024,
        enable_responses_store=True,
        tenant_header=TENANT_HEADER,
    )
    yield running
    running.close()


def client_of(server: Server, tenant: str) -> openai.OpenAI:
    return server.client.with_options(default_headers={TENANT_HEADER: tenant})


def chat_text(server: Server, messages: list[dict], max_tokens: int) -> tuple[str, int]:
    """The chat route's greedy answer to `messages`, and its prompt's token count."""
    answer = server.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, **GREEDY
    )
    return answer.choices[0].message.content, answer.usage.prompt_tokens


def test_create_answers_as_the_chat_route_does(server):
    response = server.client.responses.create(
        model=MODEL, input="Name a fruit.", instructions="Answer in one word.", max_output_tokens=12, **GREEDY
    )
    text, prompt_tokens = chat_text(
        server,
        [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a fruit."}],
        12,
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete")
    assert response.output_text == text and text
    assert response.usage.input_tokens == prompt_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.output[0].type == "message" and response.output[0].content[0].type == "output_text"


def test_max_output_tokens_makes_an_incomplete_response(server):
    response = server.client.responses.create(
        model=MODEL, input="Tell me a long story about a dragon.", max_output_tokens=3, **GREEDY
    )
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3


def test_stream_events_add_up_to_the_final_response(server):
    kwargs = {"model": MODEL, "input": "Say hello to Ann.", "max_output_tokens": 16, **GREEDY}
    with server.client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [event.sequence_number for event in events] == list(range(len(events)))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    for kind in (
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ):
        assert kinds.count(kind) == 1, kind
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == final.output_text
    assert final.output_text == server.client.responses.create(**kwargs).output_text
    status, document = http_call(server, "GET", f"/v1/responses/{final.id}")
    assert status == 200 and document["output"][0]["content"][0]["text"] == deltas


def test_parse_returns_the_pydantic_model_the_schema_held_the_answer_to(server):
    response = server.client.responses.parse(
        model=MODEL,
        input="Describe Paris as JSON with its name, country and population.",
        text_format=City,
        max_output_tokens=80,
        **GREEDY,
    )
    assert response.status == "completed"
    assert isinstance(response.output_parsed, City)
    jsonschema.validate(json.loads(response.output_text), City.model_json_schema())


def test_a_function_tool_round_trip(server):
    question = {"role": "user", "content": "What is the weather in Paris?"}
    called = server.client.responses.create(
        model=MODEL,
        input=[question],
        tools=[WEATHER_TOOL],
        tool_choice="required",
        max_output_tokens=60,
        **GREEDY,
    )
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and called.status == "completed"
    assert calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    answered = server.client.responses.create(
        model=MODEL,
        input=[
            question,
            *called.output,
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 25 C"},
        ],
        tools=[WEATHER_TOOL],
        tool_choice="none",
        max_output_tokens=20,
        **GREEDY,
    )
    assert answered.status in ("completed", "incomplete")
    assert not [item for item in answered.output if item.type == "function_call"]
    # The tool's output is in the prompt: the second prompt is longer than the first by more than it.
    assert answered.usage.input_tokens > called.usage.input_tokens + 5


def test_previous_response_id_continues_the_conversation(server):
    ann = client_of(server, "ann")
    first = ann.responses.create(
        model=MODEL, input="My name is Ann.", instructions="Be brief.", max_output_tokens=16, **GREEDY
    )
    second = ann.responses.create(
        model=MODEL, input="What is my name?", previous_response_id=first.id, max_output_tokens=16, **GREEDY
    )
    assert second.previous_response_id == first.id
    # The second prompt holds the first turn and its answer (the instructions are not inherited).
    text, prompt_tokens = chat_text(
        server,
        [
            {"role": "user", "content": "My name is Ann."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"},
        ],
        16,
    )
    assert second.usage.input_tokens == prompt_tokens
    assert second.output_text == text


def test_a_tenant_never_sees_another_tenants_stored_response(server):
    ann, bob = client_of(server, "ann"), client_of(server, "bob")
    kept = ann.responses.create(model=MODEL, input="Hello", max_output_tokens=4, **GREEDY)
    assert kept.store is True
    assert ann.responses.retrieve(kept.id).output_text == kept.output_text
    for attempt in (
        lambda: bob.responses.retrieve(kept.id),
        lambda: bob.responses.delete(kept.id),
        lambda: server.client.responses.retrieve(kept.id),  # no tenant header: the tenant ""
    ):
        with pytest.raises(openai.NotFoundError):
            attempt()
    with pytest.raises(openai.NotFoundError) as error:
        bob.responses.create(model=MODEL, input="Hi", previous_response_id=kept.id, max_output_tokens=4)
    assert error.value.body["param"] == "previous_response_id"
    unstored = ann.responses.create(model=MODEL, input="Hello", max_output_tokens=4, store=False, **GREEDY)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        ann.responses.retrieve(unstored.id)
    ann.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        ann.responses.retrieve(kept.id)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input[0].type"),
        ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
        ({"input": "x", "temperature": "hot"}, "temperature"),
        ({"input": "x", "tools": [{"type": "file_search"}]}, "tools[0].type"),
        ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, "tool_choice"),
        ({"input": "x", "tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
        (
            {
                "input": "x",
                "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "nope"}}},
            },
            "text.format.schema",
        ),
        ({"input": "x", "previous_response_id": "resp_missing"}, "previous_response_id"),
        ({"input": "x", "store": "yes"}, "store"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "model": "other"}, None),
    ],
)
def test_bad_fields_are_refused_naming_them_while_others_are_served(server, body, param):
    streaming = server.client.responses.create(
        model=MODEL, input="Count to twenty.", max_output_tokens=30, stream=True, **GREEDY
    )
    first = next(iter(streaming))
    status, error = http_call(server, "POST", "/v1/responses", {"model": MODEL, **body})
    assert status in (400, 404), error
    assert error["error"]["param"] == param, error
    if param is not None:
        assert param.split("[")[0].split(".")[0] in error["error"]["message"]
    assert [first, *streaming][-1].type == "response.completed"


def test_body_size_nesting_and_json_limits_apply(server):
    huge = "x" * (MAX_HTTP_BODY_BYTES + 1)
    status, error = http_call(server, "POST", "/v1/responses", {"model": MODEL, "input": huge})
    assert status == 413 and error["error"]["code"] == "request_too_large"
    deep = b'{"input": "x", "metadata": ' + b'{"a": ' * 200 + b"1" + b"}" * 200 + b"}"
    status, error = http_call(server, "POST", "/v1/responses", deep)
    assert status == 400 and "nests" in error["error"]["message"]
    status, error = http_call(server, "POST", "/v1/responses", b'{"input": "x",')
    assert status == 400 and error["error"]["param"] == "body"


def test_openapi_publishes_the_responses_bodies(server):
    document, validator = published_schemas(server)
    post = document["paths"]["/v1/responses"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("ResponsesRequest")
    assert "/v1/responses/{response_id}" in document["paths"]
    request = {
        "model": MODEL,
        "input": "Hi",
        "max_output_tokens": 4,
        "tools": [WEATHER_TOOL],
        "tool_choice": "none",
    }
    validator("ResponsesRequest").validate(request)
    status, answer = http_call(server, "POST", "/v1/responses", request)
    assert status == 200
    validator("ResponseObject").validate(answer)


@pytest.fixture(scope="module")
def guarded_tiny_server(tmp_path_factory):
    """A tiny random model's server with a bearer token and no responses store."""
    directory = tmp_path_factory.mktemp("tiny-responses-model")
    save_tiny_model(directory, 21)
    running = Server(directory, max_num_seqs=4, auth_token=TOKEN)
    yield running
    running.close()


def test_without_a_store_nothing_is_kept_and_previous_response_id_is_refused(guarded_tiny_server):
    client = guarded_tiny_server.client
    response = client.responses.create(model=MODEL, input="hi", max_output_tokens=3, store=True)
    assert response.store is False and response.usage.output_tokens == 3
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=MODEL, input="hi", previous_response_id=response.id)
    assert error.value.body["param"] == "previous_response_id"
    assert "--enable-responses-store" in error.value.body["message"]


def test_the_bearer_token_guards_every_responses_route(guarded_tiny_server):
    for method, path, body in (
        ("POST", "/v1/responses", {"model": MODEL, "input": "hi"}),
        ("GET", "/v1/responses/resp_1", None),
        ("DELETE", "/v1/responses/resp_1", None),
    ):
        for key in ("wrong", None):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            status, error = http_call(guarded_tiny_server, method, path, body, headers)
            assert status == 401 and error["error"]["type"] == "authentication_error", (method, key)
