"""The OpenAI-compatible HTTP API end to end, driven by the official `openai` SDK against a decode server
whose gRPC port serves the same engine: same greedy text as gRPC, streams, n, penalties, logprobs, stop,
every error status, concurrency, and a disconnect that frees the request's blocks."""

from __future__ import annotations

import asyncio
import http.client
import json
import ssl
import threading
from collections.abc import Callable

import grpc
import jsonschema
import openai
import pytest
from conftest import save_tiny_model, wait_until
from test_decode_server import self_signed_certificate
from tiny_tokenizer import TINY_VOCAB_SIZE

from decode_service.config import DecodeServiceConfig
from decode_service.server import MAX_HTTP_BODY_BYTES, DecodeServer
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc
from serving.config import TLSConfig

TOKEN = "s3cret"
MODEL = "tiny-chat"

pytestmark = pytest.mark.slow


class Server:
    """A decode server with its HTTP API on its own event-loop thread; SDK and gRPC clients to it."""

    def __init__(self, model_dir, max_num_seqs: int = 16, max_model_len: int = 256, **config_kwargs) -> None:
        engine_config = EngineConfig(
            cache=CacheConfig(block_size=8, num_blocks=256),
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=64,
        )
        self.engine = Engine.from_pretrained(model_dir, engine_config)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        config = DecodeServiceConfig(
            host="127.0.0.1", port=0, http_port=0, served_model_name=MODEL, **config_kwargs
        )
        self.server: DecodeServer = self.call(self._create(config))
        self.call(self.server.start())
        self.url = f"http://127.0.0.1:{self.server.http_port}"
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port}")
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        api_key = config_kwargs.get("auth_token") or "unused"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120)

    async def _create(self, config: DecodeServiceConfig) -> DecodeServer:
        return DecodeServer(self.engine, config)

    def call(self, coroutine, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def idle(self) -> bool:
        manager = self.engine.block_manager
        return manager.num_free_blocks == manager.num_blocks and len(self.server.registry) == 0

    def close(self) -> None:
        self.client.close()
        self.channel.close()
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-chat-model")
    save_tiny_model(directory, 21)
    return directory


@pytest.fixture(scope="module")
def server(model_dir):
    running = Server(model_dir)
    yield running
    running.close()


def http_call(
    server: Server,
    method: str,
    path: str,
    body: object = None,
    headers: dict | None = None,
    timeout: float = 60,
) -> tuple[int, dict]:
    """A raw HTTP call (stdlib), for what the SDK will not send: wrong tokens, huge or broken bodies."""
    connection = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=timeout)
    try:
        payload = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        connection.request(
            method, path, body=payload, headers={"Content-Type": "application/json", **(headers or {})}
        )
        response = connection.getresponse()
        data = response.read()
        return response.status, json.loads(data) if data else {}
    finally:
        connection.close()


def grpc_greedy(server: Server, max_tokens: int, **prompt) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(
        sampling=pb.SamplingParams(temperature=0.0, logprobs=3),
        stopping=pb.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
        **prompt,
    )
    return list(server.stub.Generate(request, timeout=120))


def grpc_text(responses: list[pb.GenerateResponse]) -> str:
    return "".join(r.text for r in responses)


GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]


def test_models_list_names_the_served_model(server):
    (model,) = server.client.models.list().data
    assert model.id == MODEL and model.owned_by == "tandem"


def published_schemas(server: Server) -> tuple[dict, Callable[[str], jsonschema.Draft202012Validator]]:
    """/openapi.json, and a validator of one of its component schemas by name."""
    status, document = http_call(server, "GET", "/openapi.json")
    assert status == 200
    return document, lambda name: jsonschema.Draft202012Validator(
        {"$ref": f"#/components/schemas/{name}", "components": document["components"]}
    )


def sse_payloads(server: Server, path: str, body: dict) -> list[dict]:
    """The JSON of each server-sent event of a streamed answer, [DONE] left out."""
    connection = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=60)
    try:
        connection.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        lines = connection.getresponse().read().decode().splitlines()
    finally:
        connection.close()
    assert lines[-2:] == ["data: [DONE]", ""], lines[-3:]
    return [json.loads(line[6:]) for line in lines[:-2] if line.startswith("data: ")]


def test_openapi_publishes_the_typed_request_models(server):
    """/openapi.json describes the bodies the server takes: what it accepts passes the schema, and a
    body the schema refuses the server refuses too, naming the same field."""
    document, validator = published_schemas(server)
    for path, model in (
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/v1/completions", "CompletionRequest"),
    ):
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
    chat = validator("ChatCompletionRequest")
    good = {
        "model": MODEL,
        "messages": [*MESSAGES, {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}],
        "max_tokens": 2,
        "stop": ["\\n"],
        "tool_choice": "none",
        "response_format": {"type": "json_object"},
    }
    chat.validate(good)
    assert http_call(server, "POST", "/v1/chat/completions", good)[0] == 200
    for field, value in (
        ("temperature", "hot"),
        ("messages", "hi"),
        ("stream", 1),
        ("audio", {"voice": "x"}),
    ):
        assert not chat.is_valid({**good, field: value}), field
        status, refused = http_call(server, "POST", "/v1/chat/completions", {**good, field: value})
        assert status == 400 and refused["error"]["param"] == field, refused


def test_answers_and_stream_chunks_match_the_published_schemas(server):
    """Every body and chunk the server sends validates against /openapi.json's answer types, which
    allow no undeclared key: usage, logprobs of both formats, n > 1, stop reasons, continuous usage."""
    document, validator = published_schemas(server)
    for path, answer, chunk in (
        ("/v1/chat/completions", "ChatCompletion", "ChatCompletionChunk"),
        ("/v1/completions", "Completion", "CompletionChunk"),
    ):
        content = document["paths"][path]["post"]["responses"]["200"]["content"]
        assert content["application/json"]["schema"]["$ref"].endswith(f"/{answer}")
        assert content["text/event-stream"]["schema"]["$ref"].endswith(f"/{chunk}")
    chat = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 4,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 2,
    }
    completion = {"model": MODEL, "prompt": "the quick", "max_tokens": 4, "logprobs": 2, "stop": ["zzz"]}
    for path, body, answer, chunk in (
        ("/v1/completions", completion, "Completion", "CompletionChunk"),
        ("/v1/chat/completions", chat, "ChatCompletion", "ChatCompletionChunk"),
    ):
        status, whole = http_call(server, "POST", path, body)
        assert status == 200, whole
        validator(answer).validate(whole)
        options = {"include_usage": True, "continuous_usage_stats": True}
        chunks = sse_payloads(server, path, {**body, "stream": True, "stream_options": options})
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
        for payload in chunks:
            validator(chunk).validate(payload)
    message = whole["choices"][0]["message"]
    assert not validator("ChatCompletion").is_valid(
        {**whole, "choices": [{**whole["choices"][0], "message": {**message, "x": 1}}]}
    )


def test_chat_plain_and_streamed_equal_the_grpc_answer(server):
    expected = grpc_text(grpc_greedy(server, 12, messages=[pb.ChatMessage(**m) for m in MESSAGES]))
    plain = server.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, **GREEDY)
    (choice,) = plain.choices
    assert choice.message.role == "assistant" and choice.message.content == expected
    assert choice.finish_reason == "length" and plain.usage.completion_tokens == 12
    assert plain.id.startswith("chatcmpl-") and plain.model == MODEL

    chunks = list(
        server.client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(server):
    prompt = "cached usage " + " ".join(f"w{i}" for i in range(60))  # several KV blocks long

    def cached_tokens() -> tuple[int, int]:
        usage = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY).usage
        return usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens

    first, prompt_tokens = cached_tokens()
    again, _ = cached_tokens()
    assert first == 0
    assert 0 < again < prompt_tokens  # whole blocks of the prompt, never its last token


def test_text_completion_plain_and_streamed_equal_the_grpc_answer(server):
    expected = grpc_text(grpc_greedy(server, 10, prompt="Once upon a time"))
    plain = server.client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, **GREEDY)
    assert plain.choices[0].text == expected and plain.object == "text_completion"
    streamed = server.client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=10, stream=True, **GREEDY
    )
    assert "".join(c.choices[0].text for c in streamed) == expected
    ids = list(grpc_greedy(server, 1, prompt="Once")[0].token_ids)
    by_ids = server.client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, **GREEDY)
    assert by_ids.choices[0].text == grpc_text(grpc_greedy(server, 4, token_ids=[5, 6, 7])) and ids


def test_n_two_choices_share_the_prompt(server):
    sampled = server.client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=8,
        n=2,
        temperature=1.0,
        seed=7,
        **{"extra_body": {"ignore_eos": True}},
    )
    assert [c.index for c in sampled.choices] == [0, 1]
    assert sampled.usage.completion_tokens == 16
    greedy = server.client.completions.create(model=MODEL, prompt="Once", max_tokens=6, n=2, **GREEDY)
    assert (
        greedy.choices[0].text == greedy.choices[1].text == grpc_text(grpc_greedy(server, 6, prompt="Once"))
    )
    streamed = server.client.completions.create(
        model=MODEL, prompt="Once", max_tokens=6, n=2, stream=True, **GREEDY
    )
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts[0] == texts[1] == greedy.choices[0].text
    assert wait_until(server.idle)


def test_penalties_and_logit_bias_change_the_output_as_over_grpc(server):
    prompt = "the the the"
    plain = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, **GREEDY)
    penalized = server.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, frequency_penalty=2.0, presence_penalty=1.0, **GREEDY
    )
    assert penalized.choices[0].text != plain.choices[0].text
    request = pb.GenerateRequest(
        prompt=prompt,
        sampling=pb.SamplingParams(temperature=0.0, frequency_penalty=2.0, presence_penalty=1.0),
        stopping=pb.StoppingParams(max_tokens=16, ignore_eos=True),
    )
    assert penalized.choices[0].text == grpc_text(list(server.stub.Generate(request, timeout=120)))
    repeated = server.client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True, "repetition_penalty": 3.0},
    )
    assert repeated.choices[0].text != plain.choices[0].text
    forced = server.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, logit_bias={"42": 100}, logprobs=0, **GREEDY
    )
    (forced_token,) = set(forced.choices[0].logprobs.tokens)
    assert forced_token == server.engine.tokenizer.decode([42], skip_special_tokens=False)


def test_chat_logprobs_with_three_alternatives_match_grpc(server):
    expected = grpc_greedy(server, 5, messages=[pb.ChatMessage(**m) for m in MESSAGES])
    answer = server.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = answer.choices[0].logprobs.content
    grpc_logprobs = [lp for r in expected for lp in r.logprobs]
    assert len(content) == len(grpc_logprobs) == 5
    for entry, reference in zip(content, grpc_logprobs, strict=True):
        assert entry.logprob == pytest.approx(reference.logprob, abs=1e-5)
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            [t.logprob for t in reference.top], abs=1e-5
        )
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[2].logprob


def test_stop_string_ends_the_answer_without_it(server):
    full = (
        server.client.completions.create(model=MODEL, prompt="Once upon", max_tokens=20, **GREEDY)
        .choices[0]
        .text
    )
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    answer = server.client.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=20, stop=[stop], **GREEDY
    )
    (choice,) = answer.choices
    assert choice.finish_reason == "stop" and choice.text == full[: full.index(stop)]
    assert choice.model_extra["stop_reason"] == stop


def test_sixteen_concurrent_streams_each_match_grpc(server):
    prompts = [f"story number {i}" for i in range(16)]
    expected = [grpc_text(grpc_greedy(server, 8, prompt=p)) for p in prompts]

    async def stream_all() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)

        async def one(prompt: str) -> str:
            stream = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=8, stream=True, **GREEDY
            )
            return "".join([chunk.choices[0].text async for chunk in stream])

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()

    assert asyncio.run(stream_all()) == expected
    assert max(len(step.chunks) for step in server.server.events.snapshot()[-40:]) > 1
    assert wait_until(server.idle)


def test_a_disconnect_mid_stream_aborts_the_request_and_frees_its_blocks(server):
    body = {
        "model": MODEL,
        "prompt": "Once upon",
        "max_tokens": 200,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    connection = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=60)
    connection.request(
        "POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data:")
    assert server.engine.block_manager.num_free_blocks < server.engine.block_manager.num_blocks
    connection.close()
    assert wait_until(server.idle)
    assert not server.server.scheduler.has_work


def test_a_disconnect_while_waiting_for_a_whole_answer_aborts_it(server):
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 240, "temperature": 0, "ignore_eos": True}
    connection = http.client.HTTPConnection("127.0.0.1", server.server.http_port, timeout=60)
    headers = {"Content-Type": "application/json", "X-Request-Id": "whole-then-gone"}
    connection.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
    assert wait_until(lambda: "whole-then-gone" in server.server.registry)
    connection.close()
    assert wait_until(server.idle)
    steps = [s for s in server.server.events.snapshot() if "whole-then-gone" in s.request_ids]
    assert len(steps) < 240, "the request ran to its end instead of being aborted"


# --- errors --------------------------------------------------------------------------------------


def assert_openai_error(
    error: openai.APIStatusError, status: int, text: str, param: str | None = None
) -> None:
    assert error.status_code == status
    body = error.body
    assert set(body) == {"message", "type", "param", "code"}, body
    assert text in body["message"]
    if param is not None:
        assert body["param"] == param


@pytest.mark.parametrize(
    ("kwargs", "text", "param"),
    [
        ({"temperature": -1}, "temperature must be >= 0", None),
        ({"top_p": 1.5}, "top_p must be in (0, 1]", None),
        ({"max_tokens": 0}, "max_tokens must be >= 1", None),
        ({"n": 0}, "n must be >= 1", "n"),
        ({"n": 17}, "n must be in [1, 16]", None),
        ({"presence_penalty": 3}, "presence_penalty must be in [-2, 2]", None),
        ({"logit_bias": {str(TINY_VOCAB_SIZE): 1}}, "logit_bias token ids", None),
        ({"top_logprobs": 21, "logprobs": True}, "logprobs must be in [0, 20]", None),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
            "tool_choice: auto (the default when tools are given) needs a server started with --tool-call-",
            "tool_choice",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema must be an object", None),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex: ", "guided_regex"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio is not supported", "audio"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role must be one of", None),
        (
            {"extra_body": {"disable_speculation": "yes"}},
            "disable_speculation must be a boolean",
            "disable_speculation",
        ),
    ],
)
def test_bad_requests_get_400_naming_the_field_while_others_are_served(server, kwargs, text, param):
    good = server.client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=200, stream=True, **GREEDY
    )
    first = next(good)
    request = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as error:
        server.client.chat.completions.create(**request)
    assert_openai_error(error.value, 400, text, param)
    assert [first, *good][-1].choices[0].finish_reason == "length"


def _body(fields: str) -> str:
    """A JSON request body from raw JSON text, for what json.dumps cannot write (NaN, lone surrogates)."""
    return "{" + fields + ', "model": "' + MODEL + '", "max_tokens": 2}'


_HUGE = "1" + "0" * 400


@pytest.mark.parametrize(
    ("endpoint", "raw", "param", "text"),
    [
        ("completions", _body('"prompt": "\\ud800"'), "prompt", "lone UTF-16 surrogate"),
        (
            "chat/completions",
            _body('"messages": [{"role": "user", "content": "a\\uDC00"}]'),
            "messages[0].content",
            "lone UTF-16 surrogate",
        ),
        ("completions", _body('"prompt": "hi", "user": "\\ud800"'), "user", "lone UTF-16 surrogate"),
        ("completions", _body('"prompt": "hi", "stop": ["\\ud800"]'), "stop[0]", "lone UTF-16 surrogate"),
        ("completions", _body('"prompt": "hi", "\\ud800": 1'), "body", "lone UTF-16 surrogate"),
        ("completions", "[" * 200_000 + "]" * 200_000, "body", "nests arrays or objects too deeply"),
        ("completions", _body('"prompt": "hi", "temperature": ' + _HUGE), "temperature", "finite number"),
        ("completions", _body('"prompt": "hi", "top_p": 1e400'), "top_p", "finite number"),
        ("completions", _body('"prompt": "hi", "temperature": NaN'), "body", "NaN is not a number"),
        (
            "completions",
            _body('"prompt": "hi", "logit_bias": {"5": -' + _HUGE + "}"),
            "logit_bias",
            "logit_bias values must be a finite number",
        ),
    ],
    ids=["prompt", "content", "user", "stop", "key", "nesting", "huge-int", "inf", "nan", "bias"],
)
def test_hostile_json_gets_400_naming_the_field_not_500(server, endpoint, raw, param, text):
    status, body = http_call(server, "POST", f"/v1/{endpoint}", raw.encode())
    assert status == 400, body
    assert body["error"]["param"] == param and text in body["error"]["message"], body
    answer = server.client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **GREEDY)
    assert answer.choices[0].finish_reason == "length"


def test_unknown_model_is_404(server):
    with pytest.raises(openai.NotFoundError) as error:
        server.client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    assert_openai_error(error.value, 404, "'gpt-4o' does not exist")


def test_body_over_the_message_limit_is_413(server):
    huge = "x" * (MAX_HTTP_BODY_BYTES + 1)
    status, body = http_call(server, "POST", "/v1/completions", {"model": MODEL, "prompt": huge})
    assert status == 413 and body["error"]["code"] == "request_too_large"
    status, body = http_call(server, "POST", "/v1/completions", b"{not json")
    assert status == 400 and body["error"]["param"] == "body"


def test_health_and_request_id_header(server):
    assert http_call(server, "GET", "/health")[0] == 200
    answer = server.client.completions.with_raw_response.create(
        model=MODEL, prompt="hi", max_tokens=2, extra_headers={"X-Request-Id": "http-req-1"}, **GREEDY
    )
    assert answer.parse().id == "cmpl-http-req-1"


def test_bearer_token_is_required_like_on_grpc(model_dir):
    guarded = Server(model_dir, max_num_seqs=4, auth_token=TOKEN)
    try:
        answer = guarded.client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **GREEDY)
        assert answer.choices[0].text is not None
        for key in ("wrong", None):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            status, body = http_call(
                guarded, "POST", "/v1/completions", {"model": MODEL, "prompt": "hi"}, headers
            )
            assert status == 401 and body["error"]["type"] == "authentication_error"
        assert http_call(guarded, "GET", "/v1/models")[0] == 401
        assert http_call(guarded, "GET", "/health")[0] == 200, "probes need no token"
    finally:
        guarded.close()


def test_full_queue_is_429_and_draining_is_503(model_dir):
    small = Server(model_dir, max_num_seqs=1, max_queue=0)
    try:
        running = small.client.completions.create(
            model=MODEL, prompt="hi", max_tokens=200, stream=True, **GREEDY
        )
        next(running)
        with pytest.raises(openai.RateLimitError) as full:
            small.client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert_openai_error(full.value, 429, "retry later")
        draining = asyncio.run_coroutine_threadsafe(small.server.drain(grace_seconds=60), small.loop)
        assert wait_until(lambda: http_call(small, "GET", "/health")[0] == 503)
        with pytest.raises(openai.InternalServerError) as refused:
            small.client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert_openai_error(refused.value, 503, "draining")
        assert [c.choices[0].finish_reason for c in running][-1] == "length", "the live stream finished"
        assert draining.result(60)
    finally:
        small.close()


def test_https_uses_the_grpc_ports_certificate_and_token(model_dir, tmp_path):
    cert, key = self_signed_certificate(tmp_path)
    secure = Server(model_dir, max_num_seqs=2, tls=TLSConfig(cert, key), auth_token=TOKEN)
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}).encode()
    try:
        context = ssl.create_default_context(cafile=str(cert))
        connection = http.client.HTTPSConnection(
            "localhost", secure.server.http_port, context=context, timeout=60
        )
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"}
        connection.request("POST", "/v1/completions", body=body, headers=headers)
        response = connection.getresponse()
        assert response.status == 200 and json.loads(response.read())["usage"]["completion_tokens"] == 2
        connection.close()
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            http_call(secure, "POST", "/v1/completions", body, {"Authorization": f"Bearer {TOKEN}"})
    finally:
        secure.close()
