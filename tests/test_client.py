"""The Python client (`tandem.client`) and `tandem generate` against a fake Generation server.

The fake is a real grpc.aio server on loopback whose behaviour is chosen by the prompt: it streams
canned responses, sleeps past deadlines, waits to be aborted, or fails with a status. It records what
arrived (requests, metadata, cancellations) so that tests can check what the client actually sent.
"""

from __future__ import annotations

import asyncio
import io
import json
import socket
import threading

import grpc
import pytest
from conftest import wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc
from tandem.cli import main
from tandem.client import (
    AsyncTandemClient,
    Completion,
    DeadlineExceeded,
    FinishReason,
    GenerationDelta,
    InvalidArgument,
    ModelInfo,
    ResourceExhausted,
    ServerTimings,
    ServingMode,
    TandemClient,
    TandemError,
    TokenLogprob,
    TopLogprob,
    Unavailable,
    Usage,
)
from tandem.client.errors import error_for_status
from tandem.client.generate_command import NO_CHAT_TEMPLATE
from tandem.client.requests import build_request

TOKEN = "s3cret-token"
CANNED_TIMINGS = pb.ServerTimings(queue_seconds=0.25, prefill_seconds=0.5, first_token_seconds=0.75)
SAFETY_TIMEOUT = 20.0

# Prompts that select the fake's behaviour; any other prompt streams the canned completion.
SLOW = "slow"
WAIT_FOR_ABORT = "wait-for-abort"
BAD = "bad"
NO_TEMPLATE = "model without a chat template"
FULL = "full"


class FakeGeneration(generation_pb2_grpc.GenerationServicer):
    """Canned Generate/Abort/GetModelInfo; records requests, metadata and cancelled request ids."""

    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.cancelled: list[str] = []
        self._abort_events: dict[str, asyncio.Event] = {}
        self._next_id = 0

    def _request_id(self, request: pb.GenerateRequest) -> str:
        self._next_id += 1
        return request.request_id or f"fake-{self._next_id}"

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        request_id = self._request_id(request)
        # `tandem generate` sends PROMPT as the last chat message unless --raw.
        text = request.messages[-1].content if request.messages else request.prompt
        if request.messages and text == NO_TEMPLATE:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{NO_CHAT_TEMPLATE}; send a plain prompt")
        if text == BAD:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "temperature must be >= 0")
        if text == FULL:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue is full")
        try:
            if text == SLOW:
                await asyncio.sleep(SAFETY_TIMEOUT)
            if text == WAIT_FOR_ABORT:
                aborted = self._abort_events.setdefault(request_id, asyncio.Event())
                yield pb.GenerateResponse(request_id=request_id, token_ids=[7], text="first")
                await asyncio.wait_for(aborted.wait(), SAFETY_TIMEOUT)
                yield pb.GenerateResponse(request_id=request_id, finish_reason=pb.ABORT)
                return
            for response in canned_stream(request_id, request.sampling.logprobs):
                yield response
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        self.metadata.append(dict(context.invocation_metadata()))
        event = self._abort_events.get(request.request_id)
        if event is None or event.is_set():
            return pb.AbortResponse(aborted=False)
        event.set()
        return pb.AbortResponse(aborted=True)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext):
        return pb.ModelInfo(
            model_name="fake-model",
            max_context_length=256,
            vocab_size=512,
            eos_token_ids=[0, 2],
            dtype="float32",
            block_size=16,
            mode=pb.SERVING_MODE_AGGREGATED,
            server_version="9.9",
        )


def canned_stream(request_id: str, logprobs: int) -> list[pb.GenerateResponse]:
    """Three messages, 'Hello', ', wor', 'ld', the last carrying a stop string, usage and timings."""
    chunks = [([11], "Hello"), ([12, 13], ", wor"), ([14], "ld")]
    responses = []
    for token_ids, text in chunks:
        response = pb.GenerateResponse(request_id=request_id, token_ids=token_ids, text=text)
        if logprobs:
            response.logprobs.extend(
                pb.TokenLogprob(
                    token_id=t,
                    logprob=-0.5,
                    top=[pb.TopLogprob(token_id=t + k, logprob=-k - 0.5) for k in range(logprobs)],
                )
                for t in token_ids
            )
        responses.append(response)
    final = responses[-1]
    final.finish_reason = pb.STOP
    final.stop_string = "!"
    final.usage.prompt_tokens = 3
    final.usage.completion_tokens = 4
    final.timings.CopyFrom(CANNED_TIMINGS)
    return responses


class FakeServer:
    """The fake Generation service plus grpc.health.v1 on 127.0.0.1, on its own event-loop thread."""

    def __init__(self) -> None:
        self.servicer = FakeGeneration()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.port = self._call(self._start())
        self.target = f"127.0.0.1:{self.port}"

    async def _start(self) -> int:
        self._server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(self.servicer, self._server)
        health = HealthServicer()
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        return port

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(SAFETY_TIMEOUT)

    def close(self) -> None:
        self._call(self._server.stop(grace=None))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(SAFETY_TIMEOUT)
        self._loop.close()


@pytest.fixture(scope="module")
def server():
    running = FakeServer()
    yield running
    running.close()


@pytest.fixture
def client(server):
    with TandemClient(server.target, timeout=SAFETY_TIMEOUT) as tandem_client:
        yield tandem_client


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- building requests and reading responses (no server) ---


def test_build_request_leaves_unset_options_unset():
    request = build_request("hi")
    assert request.prompt == "hi" and not request.token_ids and not request.messages
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        assert not request.sampling.HasField(name), name
    assert not request.sampling.logit_bias and request.n == 0
    assert not request.stopping.HasField("max_tokens")


def test_build_request_maps_every_option():
    request = build_request(
        token_ids=[1, 2, 3],
        temperature=0.0,
        top_p=0.9,
        top_k=5,
        min_p=0.05,
        seed=2**63,
        logprobs=2,
        max_tokens=7,
        stop="\n",
        stop_token_ids=[4],
        ignore_eos=True,
        min_tokens=1,
        request_id="r",
        priority=-3,
        tenant="acme",
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.25,
        logit_bias={7: -100.0},
        n=3,
    )
    assert list(request.token_ids) == [1, 2, 3]
    sampling = request.sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (
        0.5,
        -0.5,
        1.25,
    )
    assert dict(sampling.logit_bias) == {7: -100.0} and request.n == 3
    assert request.sampling.HasField("temperature") and request.sampling.temperature == 0.0
    assert request.sampling.top_k == 5 and request.sampling.seed == 2**63 and request.sampling.logprobs == 2
    assert request.stopping.max_tokens == 7 and list(request.stopping.stop) == ["\n"], "a str is one stop"
    assert list(request.stopping.stop_token_ids) == [4] and request.stopping.ignore_eos
    assert (request.request_id, request.priority, request.tenant) == ("r", -3, "acme")


def test_request_options_are_exactly_build_requests_keywords():
    """Both clients' generate() take RequestOptions and pass them on whole: the two lists cannot drift."""
    import inspect

    from tandem.client import RequestOptions

    keywords = [
        name
        for name, parameter in inspect.signature(build_request).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    assert list(RequestOptions.__annotations__) == keywords


def test_a_misspelt_option_is_refused_when_generate_is_called():
    """Before any call is made, as the explicit signatures refused it."""
    client = TandemClient("127.0.0.1:1")
    with pytest.raises(TypeError, match="temprature"):
        client.generate("hi", temprature=0.5)
    client.close()

    async def misspelt() -> None:
        async_client = AsyncTandemClient("127.0.0.1:1")
        try:
            with pytest.raises(TypeError, match="max_token"):
                async_client.generate("hi", max_token=4)
        finally:
            await async_client.close()

    asyncio.run(misspelt())


def test_build_request_accepts_chat_messages_in_three_forms():
    request = build_request(
        messages=[{"role": "system", "content": "be brief"}, ("user", "hi"), pb.ChatMessage(role="assistant")]
    )
    assert [(m.role, m.content) for m in request.messages] == [
        ("system", "be brief"),
        ("user", "hi"),
        ("assistant", ""),
    ]


def test_final_delta_carries_stop_token_usage_and_timings():
    message = pb.GenerateResponse(request_id="r", token_ids=[9], finish_reason=pb.STOP, stop_token_id=9)
    message.usage.prompt_tokens = 5
    message.timings.CopyFrom(CANNED_TIMINGS)
    delta = GenerationDelta.from_proto(message)
    assert delta.is_final and delta.finish_reason == "stop" and delta.matched_stop == 9
    assert delta.usage == Usage(5, 0) and delta.timings == ServerTimings(0.25, 0.5, 0.75)
    assert delta.raw is message and delta.index == 0
    assert GenerationDelta.from_proto(pb.GenerateResponse(request_id="r", index=2)).index == 2


def test_intermediate_delta_has_no_final_fields():
    delta = GenerationDelta.from_proto(pb.GenerateResponse(request_id="r", token_ids=[1], text="a"))
    assert not delta.is_final
    assert (delta.finish_reason, delta.matched_stop, delta.usage, delta.timings) == (None, None, None, None)


def test_finish_reason_from_a_newer_server_is_unknown_not_a_crash():
    delta = GenerationDelta.from_proto(pb.GenerateResponse(finish_reason=99))
    assert delta.finish_reason is FinishReason.UNKNOWN


@pytest.mark.parametrize("code", [c for c in grpc.StatusCode if c is not grpc.StatusCode.OK])
def test_every_status_code_maps_to_its_own_exception(code):
    error = error_for_status(code, "why")
    assert isinstance(error, TandemError) and type(error) is not TandemError
    assert error.code is code and error.code_name == code.name and error.message == "why"
    assert str(error) == f"{code.name}: why"


# --- the sync and async clients against the fake server ---


def test_generate_streams_deltas_and_sends_the_token(server):
    with TandemClient(server.target, auth_token=TOKEN, timeout=SAFETY_TIMEOUT) as tandem_client:
        stream = tandem_client.generate("hi", max_tokens=4, request_id="sync-1", metadata={"x-trace": "t1"})
        deltas = list(stream)
    assert [d.text for d in deltas] == ["Hello", ", wor", "ld"]
    assert [d.token_ids for d in deltas] == [(11,), (12, 13), (14,)]
    assert all(d.request_id == "sync-1" for d in deltas) and not any(d.is_final for d in deltas[:-1])
    final = deltas[-1]
    assert final.finish_reason is FinishReason.STOP and final.matched_stop == "!"
    assert final.usage == Usage(3, 4) and final.timings == ServerTimings(0.25, 0.5, 0.75)
    sent = server.servicer.metadata[-1]
    assert sent["authorization"] == f"Bearer {TOKEN}" and sent["x-trace"] == "t1"
    assert server.servicer.requests[-1].stopping.max_tokens == 4


def test_no_authorization_header_without_a_token(client, server):
    client.complete("hi")
    assert "authorization" not in server.servicer.metadata[-1]


def test_sync_and_async_generate_are_equal(client, server):
    options = dict(token_ids=[1, 2], temperature=0.0, logprobs=2, request_id="same", tenant="t")
    sync_deltas = list(client.generate(**options))

    async def run_async() -> list[GenerationDelta]:
        async with AsyncTandemClient(server.target, timeout=SAFETY_TIMEOUT) as async_client:
            return [delta async for delta in async_client.generate(**options)]

    async_deltas = asyncio.run(run_async())
    assert sync_deltas == async_deltas
    assert sync_deltas[0].logprobs[0] == TokenLogprob(11, -0.5, (TopLogprob(11, -0.5), TopLogprob(12, -1.5)))
    first, second = server.servicer.requests[-2:]
    assert first == second


def test_complete_joins_the_stream(client):
    completion = client.complete(messages=[("user", "hi")], logprobs=1)
    assert completion == Completion(
        request_id=completion.request_id,
        text="Hello, world",
        token_ids=(11, 12, 13, 14),
        logprobs=completion.logprobs,
        finish_reason=FinishReason.STOP,
        matched_stop="!",
        usage=Usage(3, 4),
        timings=ServerTimings(0.25, 0.5, 0.75),
    )
    assert [lp.token_id for lp in completion.logprobs] == [11, 12, 13, 14]
    assert completion.request_id.startswith("fake-")


def test_abort_ends_the_stream_with_abort(client):
    stream = client.generate(WAIT_FOR_ABORT, request_id="to-abort")
    first = next(stream)
    assert first.text == "first" and not first.is_final
    assert client.abort("to-abort") is True
    rest = list(stream)
    assert len(rest) == 1 and rest[0].finish_reason is FinishReason.ABORT
    assert client.abort("to-abort") is False, "an already finished request cannot be aborted again"


def test_async_abort_ends_the_stream_with_abort(server):
    async def run() -> tuple[bool, list[GenerationDelta]]:
        async with AsyncTandemClient(server.target, timeout=SAFETY_TIMEOUT) as async_client:
            stream = async_client.generate(WAIT_FOR_ABORT, request_id="async-abort")
            first = await anext(stream)
            aborted = await async_client.abort("async-abort")
            return aborted, [first] + [delta async for delta in stream]

    aborted, deltas = asyncio.run(run())
    assert aborted and [d.finish_reason for d in deltas] == [None, FinishReason.ABORT]


def test_abort_of_an_unknown_request_is_false(client):
    assert client.abort("never-existed") is False


def test_leaving_the_stream_early_cancels_the_call(client, server):
    stream = client.generate(WAIT_FOR_ABORT, request_id="left-early")
    next(stream)
    stream.close()
    assert wait_until(lambda: "left-early" in server.servicer.cancelled)


def test_deadline_raises_deadline_exceeded(client):
    with pytest.raises(DeadlineExceeded) as raised:
        list(client.generate(SLOW, timeout=0.2))
    assert raised.value.code_name == "DEADLINE_EXCEEDED"


def test_default_timeout_of_the_client_applies(server):
    with TandemClient(server.target, timeout=0.2) as tandem_client, pytest.raises(DeadlineExceeded):
        tandem_client.complete(SLOW)


def test_async_deadline_raises_deadline_exceeded(server):
    async def run() -> None:
        async with AsyncTandemClient(server.target) as async_client:
            await async_client.complete(SLOW, timeout=0.2)

    with pytest.raises(DeadlineExceeded):
        asyncio.run(run())


@pytest.mark.parametrize(
    ("prompt", "error_type", "message"),
    [
        (BAD, InvalidArgument, "temperature must be >= 0"),
        (FULL, ResourceExhausted, "queue is full"),
    ],
)
def test_status_errors_are_typed_with_the_server_message(client, server, prompt, error_type, message):
    with pytest.raises(error_type) as raised:
        client.complete(prompt)
    assert raised.value.message == message

    async def run() -> None:
        async with AsyncTandemClient(server.target, timeout=SAFETY_TIMEOUT) as async_client:
            await async_client.complete(prompt)

    with pytest.raises(error_type):
        asyncio.run(run())


def test_unreachable_server_is_unavailable():
    with TandemClient(f"127.0.0.1:{closed_port()}", timeout=SAFETY_TIMEOUT) as tandem_client:
        with pytest.raises(Unavailable):
            tandem_client.model_info()


def test_model_info_and_health(client, server):
    expected = ModelInfo("fake-model", 256, 512, (0, 2), "float32", 16, ServingMode.AGGREGATED, "9.9")
    assert client.model_info() == expected
    assert client.health() == "SERVING"

    async def run() -> tuple[ModelInfo, str]:
        async with AsyncTandemClient(server.target, timeout=SAFETY_TIMEOUT) as async_client:
            return await async_client.model_info(), await async_client.health()

    assert asyncio.run(run()) == (expected, "SERVING")


# --- tandem generate ---


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["generate", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_streams_text_and_reports_usage_and_ttft(server, capsys):
    code, out, err = run_cli(
        capsys, "hi", "--target", server.target, "--max-tokens", "4", "--temperature", "0"
    )
    assert code == 0
    assert out == "Hello, world\n"
    assert "finish: stop (matched '!')" in err and "usage: 3 prompt + 4 completion tokens" in err
    assert "ttft:" in err and "(server 0.750 s)" in err
    request = server.servicer.requests[-1]
    assert [(m.role, m.content) for m in request.messages] == [("user", "hi")], "a chat turn by default"
    assert not request.prompt and request.stopping.max_tokens == 4
    assert request.sampling.HasField("temperature") and not request.sampling.HasField("top_p")


def test_cli_raw_sends_plain_text(server, capsys):
    code, _, _ = run_cli(capsys, "hi", "--raw", "--target", server.target)
    assert code == 0
    request = server.servicer.requests[-1]
    assert request.prompt == "hi" and not request.messages


def test_cli_falls_back_to_the_raw_prompt_when_the_model_has_no_chat_template(server, capsys):
    code, out, err = run_cli(capsys, NO_TEMPLATE, "--target", server.target)
    assert code == 0 and out == "Hello, world\n"
    assert "no chat template; sending the prompt raw" in err
    chat, raw = server.servicer.requests[-2:]
    assert chat.messages[-1].content == NO_TEMPLATE and raw.prompt == NO_TEMPLATE and not raw.messages


def test_cli_explicit_chat_does_not_fall_back(server, capsys):
    code, out, err = run_cli(capsys, NO_TEMPLATE, "--chat", "--target", server.target)
    assert code == 1 and out == "" and "INVALID_ARGUMENT: " + NO_CHAT_TEMPLATE in err


def test_cli_json_prints_one_json_object_per_message(server, capsys):
    code, out, _ = run_cli(capsys, "hi", "--target", server.target, "--json", "--logprobs", "1")
    assert code == 0
    messages = [json.loads(line) for line in out.splitlines()]
    assert [m["text"] for m in messages] == ["Hello", ", wor", "ld"]
    assert messages[-1]["finishReason"] == "STOP" and messages[-1]["usage"]["completionTokens"] == 4
    assert messages[0]["logprobs"][0]["tokenId"] == 11


def test_cli_sends_every_flag(server, capsys, monkeypatch):
    monkeypatch.setenv("TANDEM_AUTH_TOKEN", TOKEN)
    code, _, _ = run_cli(
        capsys,
        "--token-ids",
        "5, 6,7",
        "--target",
        server.target,
        "--top-p",
        "0.5",
        "--top-k",
        "3",
        "--min-p",
        "0.1",
        "--seed",
        "42",
        "--stop",
        "a",
        "--stop",
        "b",
        "--stop-token-ids",
        "1,2",
        "--stop-token-ids",
        "3",
        "--ignore-eos",
        "--min-tokens",
        "2",
        "--priority",
        "5",
        "--tenant",
        "acme",
        "--request-id",
        "cli-1",
        "--timeout",
        "30",
    )
    assert code == 0
    request = server.servicer.requests[-1]
    assert list(request.token_ids) == [5, 6, 7] and not request.prompt
    assert (request.sampling.top_k, request.sampling.seed) == (3, 42)
    assert list(request.stopping.stop) == ["a", "b"] and list(request.stopping.stop_token_ids) == [1, 2, 3]
    assert request.stopping.ignore_eos and request.stopping.min_tokens == 2
    assert (request.priority, request.tenant, request.request_id) == (5, "acme", "cli-1")
    assert server.servicer.metadata[-1]["authorization"] == f"Bearer {TOKEN}"


def test_cli_chat_reads_the_prompt_from_stdin(server, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("what is 2+2?"))
    code, _, _ = run_cli(capsys, "-", "--chat", "--system", "be brief", "--target", server.target)
    assert code == 0
    request = server.servicer.requests[-1]
    roles_and_contents = [(m.role, m.content) for m in request.messages]
    assert roles_and_contents == [("system", "be brief"), ("user", "what is 2+2?")]
    assert not request.prompt


@pytest.mark.parametrize(
    "argv",
    [
        ["hi", "--temperature", "hot"],
        ["hi", "--no-such-flag"],
        ["--token-ids", "1,x"],
        [],
        ["hi", "--token-ids", "1"],
        ["hi", "--raw", "--system", "s"],
        ["hi", "--raw", "--chat"],
        ["--chat", "--token-ids", "1"],
        ["--system", "s", "--token-ids", "1"],
    ],
)
def test_cli_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as raised:
        main(["generate", *argv])
    assert raised.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_cli_status_error_prints_its_name_and_exits_1(server, capsys):
    code, out, err = run_cli(capsys, BAD, "--target", server.target)
    assert code == 1 and out == ""
    assert "error: INVALID_ARGUMENT: temperature must be >= 0" in err.splitlines()


def test_cli_deadline_is_a_status_error(server, capsys):
    code, _, err = run_cli(capsys, SLOW, "--target", server.target, "--timeout", "0.2")
    assert code == 1 and "error: DEADLINE_EXCEEDED" in err


def test_cli_missing_ca_file_is_an_error_not_a_traceback(server, capsys, tmp_path):
    code, _, err = run_cli(capsys, "hi", "--target", server.target, "--ca-cert", str(tmp_path / "nope.pem"))
    assert code == 1 and err.startswith("error: cannot read the CA certificate")


def test_cli_aborted_stream_exits_1(server, capsys):
    def abort_when_running() -> None:
        with TandemClient(server.target, timeout=SAFETY_TIMEOUT) as other:
            wait_until(lambda: other.abort("cli-abort"))

    aborter = threading.Thread(target=abort_when_running)
    aborter.start()
    code, out, err = run_cli(capsys, WAIT_FOR_ABORT, "--request-id", "cli-abort", "--target", server.target)
    aborter.join(SAFETY_TIMEOUT)
    assert code == 1 and out == "first\n" and "finish: abort" in err


def test_build_request_passes_template_kwargs_and_special_tokens():
    request = build_request(
        messages=[{"role": "user", "content": "hi"}],
        chat_template_kwargs={"enable_thinking": False},
        skip_special_tokens=False,
    )
    assert json.loads(request.chat_template_kwargs_json) == {"enable_thinking": False}
    assert request.HasField("skip_special_tokens") and not request.skip_special_tokens
    plain = build_request("hi")
    assert not plain.chat_template_kwargs_json and not plain.HasField("skip_special_tokens")


def test_build_request_opts_out_of_speculation():
    assert not build_request("hi").sampling.disable_speculation
    assert build_request("hi", disable_speculation=True).sampling.disable_speculation
