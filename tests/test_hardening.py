"""Issue 13's attacks, replayed scaled down against real servers on 127.0.0.1 (tiny random model).

Each test reproduces one attack as the review ran it and checks that the attacker gets a clear error
naming the limit's flag, or loses what it held, while the server goes on serving everyone else and
every KV block comes back. Stop-string cost and min_tokens (items 1 and 5) are also covered at unit
level in test_tokenizer.py, WFQ state (item 8) and step failures in test_decode_scheduler.py, the
prefill timeout policy (item 6) in test_disagg_units.py; a prefill process whose engine cannot warm up
exits non-zero naming the error (item 9) in test_serving_shell.py; everything at once in test_soak.py.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from conftest import save_tiny_model, wait_until
from test_decode_server import RunningServer, start_server
from test_disagg_serving import LoopThread
from test_openai_api import MODEL, Server, http_call

from base.logs import TextFormatter, log_event
from decode_service.front_door.admission import RequestLimits
from decode_service.front_door.validation import SHORT_PROMPT_BYTES
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.model_store import model_fingerprint
from prefill_service.config import PrefillServiceConfig
from prefill_service.server import PrefillServer
from protos.tandem.internal.v1 import prefill_pb2, prefill_pb2_grpc
from protos.tandem.v1 import generation_pb2 as pb

# A client that never reads: no BDP probing, so its HTTP/2 window stays at the 64 KiB default.
NEVER_READ_OPTIONS = [("grpc.http2.bdp_probe", 0)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-hardening-model")
    save_tiny_model(directory, 13)
    return directory


def hello(max_tokens: int = 4, stop: tuple[str, ...] = (), **kwargs) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt="Hello",
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingParams(max_tokens=max_tokens, ignore_eos=True, stop=stop),
        **kwargs,
    )


def refusal(server: RunningServer, request: pb.GenerateRequest, metadata=None) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        list(server.stub.Generate(request, timeout=60, metadata=metadata))
    return refused.value


def still_serves(server: RunningServer) -> None:
    responses = list(server.stub.Generate(hello(), timeout=60))
    assert responses[-1].finish_reason == pb.LENGTH
    assert wait_until(server.pool_is_full)


class CountingTokenizer:
    """Counts `encode` calls of a server's tokenizer; prompts above `gate_bytes` wait for `gate`."""

    def __init__(self, engine: Engine, gate_bytes: int | None = None) -> None:
        self._encode = engine.tokenizer.encode
        self.calls = 0
        self.gate = threading.Event()
        self.gate.set()
        self.gate_bytes = gate_bytes
        self.waiting = 0
        engine.tokenizer.encode = self

    def __call__(self, text: str, *args, **kwargs):
        self.calls += 1
        if self.gate_bytes is not None and len(text.encode()) > self.gate_bytes:
            self.waiting += 1
            self.gate.wait(60)
        return self._encode(text, *args, **kwargs)


class StepPause:
    """Holds the engine thread before each step while `paused`; a server with live, stuck requests."""

    def __init__(self, engine: Engine) -> None:
        self._step = engine.step
        self.running = threading.Event()
        self.running.set()
        engine.step = self

    def __call__(self, chunks):
        self.running.wait(60)
        return self._step(chunks)


@pytest.fixture(scope="module")
def limited(model_dir):
    """A decode server with small limits, so each attack is cheap to replay."""
    limits = RequestLimits(
        max_id_bytes=64, max_prompt_bytes=64 * 1024, max_stop_strings=4, max_stop_string_length=16
    )
    server = start_server(model_dir, max_num_seqs=2, max_queue=2, limits=limits, max_validation_queue=1)
    yield server
    server.close()


# --- item 1: stop strings -----------------------------------------------------------------------------


def test_stop_strings_beyond_the_limits_are_refused_by_name(limited):
    """The review's 59 KiB stop list and its 300k stop strings: refused before any work, by flag name."""
    many = hello(stop=[f"s{i}" for i in range(5)])
    error = refusal(limited, many)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-stop-strings" in error.details()
    long = hello(stop=["x" * 17])
    error = refusal(limited, long)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-stop-string-length" in error.details()
    at_limit = hello(stop=["x" * 16] * 4)
    assert list(limited.stub.Generate(at_limit, timeout=60))[-1].finish_reason == pb.LENGTH
    still_serves(limited)


# --- item 7: request ids ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("request_id", "x" * 65, "--max-id-bytes"),
        ("request_id", "ok\n2026-11-30 ERROR admin login", "printable"),
        ("tenant", "t" * 65, "--max-id-bytes"),
        ("tenant", "gold\x1b[2J", "printable"),
    ],
)
def test_ids_are_bounded_and_printable(limited, field, value, expected):
    error = refusal(limited, hello(**{field: value}))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in error.details() and expected in error.details()
    still_serves(limited)


def test_an_id_at_the_limit_is_echoed(limited):
    request_id = "é" * 32  # 64 bytes of UTF-8
    responses = list(limited.stub.Generate(hello(request_id=request_id), timeout=60))
    assert {r.request_id for r in responses} == {request_id}


def test_a_newline_in_a_logged_value_cannot_forge_a_line():
    logger = logging.getLogger("tandem.test.forge")
    record_holder = []
    handler = logging.Handler()
    handler.emit = record_holder.append
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        log_event(logger, logging.INFO, "request refused", reason="x\n2026-11-30 ERROR admin login\u2028")
    finally:
        logger.removeHandler(handler)
    line = TextFormatter().format(record_holder[0])
    assert "\n" not in line and "\u2028" not in line and "admin login" in line


# --- item 10: malformed protobuf ---------------------------------------------------------------------


def test_a_prompt_that_is_not_utf8_gets_invalid_argument(limited):
    raw = pb.GenerateRequest(prompt="Hi!", stopping=pb.StoppingParams(max_tokens=2)).SerializeToString()
    generate = limited.channel.unary_stream("/tandem.v1.Generation/Generate")
    with pytest.raises(grpc.RpcError) as refused:
        list(generate(raw.replace(b"Hi!", b"H\xff!"), timeout=60))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in refused.value.details() and "\n" not in refused.value.details()
    still_serves(limited)


# --- item 4: validation -------------------------------------------------------------------------------


def test_an_oversized_prompt_is_refused_before_it_is_tokenized(limited):
    counter = CountingTokenizer(limited.engine)
    try:
        error = refusal(limited, pb.GenerateRequest(prompt="a" * (64 * 1024 + 1)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-prompt-bytes" in error.details()
        chat = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="b" * 64 * 1024)])
        assert "--max-prompt-bytes" in refusal(limited, chat).details()
        assert counter.calls == 0
    finally:
        limited.engine.tokenizer.encode = counter._encode


def test_a_full_server_refuses_before_tokenizing(limited):
    """Capacity 4 (2 running + 2 queued) held by stuck requests: the 5th costs no tokenization."""
    pause = StepPause(limited.engine)
    pause.running.clear()
    counter = CountingTokenizer(limited.engine)
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            holders = [
                pool.submit(
                    lambda i=i: list(limited.stub.Generate(hello(request_id=f"hold-{i}"), timeout=60))
                )
                for i in range(4)
            ]
            assert wait_until(lambda: limited.server.registry.num_working == 4)
            calls_before = counter.calls
            error = refusal(limited, pb.GenerateRequest(prompt="c" * 30_000))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert counter.calls == calls_before
            pause.running.set()
            for holder in holders:
                assert holder.result(60)[-1].finish_reason == pb.LENGTH
    finally:
        pause.running.set()
        limited.engine.step = pause._step
        limited.engine.tokenizer.encode = counter._encode
    still_serves(limited)


def test_large_prompts_queue_apart_and_bounded_while_short_ones_pass(limited):
    """Three clients looping on huge prompts once delayed 'Hello' by seconds; now huge prompts wait on
    their own thread, at most --max-validation-queue of them, and 'Hello' does not wait behind them."""
    counter = CountingTokenizer(limited.engine, gate_bytes=SHORT_PROMPT_BYTES)
    counter.gate.clear()
    big = pb.GenerateRequest(prompt="d" * (SHORT_PROMPT_BYTES + 1), stopping=pb.StoppingParams(max_tokens=1))
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            first = pool.submit(lambda: refusal(limited, big))
            assert wait_until(lambda: counter.waiting == 1)
            error = refusal(limited, big)
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-validation-queue" in error.details()
            # The long-prompt thread is stuck, and a short prompt still goes through.
            assert list(limited.stub.Generate(hello(), timeout=60))[-1].finish_reason == pb.LENGTH
            counter.gate.set()
            # Too many tokens for the context: refused after tokenizing, and its slot comes back.
            assert first.result(60).code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        counter.gate.set()
        limited.engine.tokenizer.encode = counter._encode
    still_serves(limited)


def test_a_client_that_leaves_while_its_prompt_is_tokenized_gives_its_slot_back(limited):
    counter = CountingTokenizer(limited.engine, gate_bytes=SHORT_PROMPT_BYTES)
    counter.gate.clear()
    big = pb.GenerateRequest(prompt="e" * (SHORT_PROMPT_BYTES + 1), stopping=pb.StoppingParams(max_tokens=1))
    try:
        # The deadline leaves a busy machine time to reach the tokenizer, where the gate holds the prompt.
        with pytest.raises(grpc.RpcError) as gave_up:
            list(limited.stub.Generate(big, timeout=3.0))
        assert gave_up.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert counter.waiting == 1
    finally:
        counter.gate.set()
        limited.engine.tokenizer.encode = counter._encode
    hub = limited.server.registry
    assert wait_until(lambda: hub.num_working == 0 and len(hub) == 0)
    still_serves(limited)


# --- item 3: clients that never read ------------------------------------------------------------------


def never_read(
    server: RunningServer, request_id: str, max_tokens: int, logprobs: int = 0
) -> tuple[grpc.Channel, object]:
    """Start a Generate whose client never reads: 1 KiB ids make each message fill the window fast
    (logprobs make each token do so too, however many tokens a busy event loop merges into a message)."""
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}", options=NEVER_READ_OPTIONS)
    request = pb.GenerateRequest(
        request_id=request_id,
        token_ids=[5, 6, 7],
        sampling=pb.SamplingParams(temperature=0.0, logprobs=logprobs),
        stopping=pb.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    call = channel.unary_stream("/tandem.v1.Generation/Generate", pb.GenerateRequest.SerializeToString)(
        request, timeout=120
    )
    return channel, call


def test_finished_but_unread_streams_free_their_slots(model_dir):
    """Capacity 2 and two never-read streams: every new client once got RESOURCE_EXHAUSTED for as long as
    the readers slept. Now the engine's finished work frees the slots at once. (The stall timeout is far
    away here, so it is the finished work, not the stall, that makes room.) Each answer carries 20
    alternatives a token so that it overflows the window however many tokens a loaded loop merges into a
    message; without them a busy machine merged 200 tokens into few enough messages to be sent whole."""
    server = start_server(
        model_dir,
        max_num_seqs=2,
        max_model_len=1024,
        num_blocks=300,
        max_queue=0,
        stream_stall_timeout_s=600.0,
    )
    stalled = [never_read(server, f"{i}" * 1024, max_tokens=1000, logprobs=20) for i in range(2)]
    try:
        assert wait_until(lambda: len(server.server.registry) == 2)
        # The engine is done with both, and the event loop has seen their last tokens (what admission
        # counts); their clients have read nothing.
        assert wait_until(lambda: not server.server.scheduler.has_work)
        assert wait_until(lambda: server.server.registry.num_working == 0)
        assert len(server.server.registry) == 2
        assert list(server.stub.Generate(hello(), timeout=60))[-1].finish_reason == pb.LENGTH
        # The served call's handler leaves the registry once it has cleaned up; the unread two stay.
        assert wait_until(lambda: len(server.server.registry) == 2)
        assert server.server.watchdog.num_stalled == 0
    finally:
        for channel, _ in stalled:
            channel.close()
        server.close()


def test_stalled_calls_end_after_the_stall_timeout_and_free_their_buffers(model_dir):
    """Each answer (1,000 tokens with 20 alternatives each) is several times the 64 KiB window."""
    server = start_server(
        model_dir, max_num_seqs=2, max_model_len=1024, num_blocks=300, max_queue=0, stream_stall_timeout_s=2.0
    )
    stalled = [never_read(server, f"{i}" * 1024, max_tokens=1000, logprobs=20) for i in range(2)]
    try:
        assert wait_until(lambda: server.server.watchdog.num_stalled == 2, timeout=60)
        assert wait_until(lambda: len(server.server.registry) == 0)
        # The streams leave the registry on the event loop; the engine frees their blocks at its next
        # step, which a loaded machine may run a moment later.
        assert wait_until(server.pool_is_full)
        for channel, call in stalled:
            with pytest.raises(grpc.RpcError) as ended:
                list(call)
            assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "--stream-stall-timeout" in ended.value.details()
            channel.close()
        still_serves(server)
    finally:
        for channel, _ in stalled:
            channel.close()
        server.close()


def test_a_stream_that_falls_too_far_behind_is_cancelled_and_its_blocks_freed(model_dir):
    server = start_server(model_dir, max_num_seqs=2, max_stream_buffer=4, stream_stall_timeout_s=60.0)
    channel, call = never_read(server, "z" * 1024, max_tokens=200)
    try:
        assert wait_until(lambda: server.server.registry.num_overflowed == 1)
        # Cancelled in the engine while its call is still open: the blocks are back.
        assert wait_until(lambda: not server.server.scheduler.has_work)
        manager = server.engine.block_manager
        assert manager.num_free_blocks == manager.num_blocks
        assert server.server.registry.num_working == 0
        call.cancel()
        still_serves(server)
    finally:
        channel.close()
        server.close()


# --- the 'also' list: trusted tenant and priority, bearer token without TLS --------------------------


def test_tenant_and_priority_come_from_the_gateway_headers_when_configured(model_dir, caplog):
    caplog.set_level(logging.INFO)
    server = start_server(
        model_dir, tenant_header="x-tenant", priority_header="x-priority", auth_token="secret-token"
    )
    try:
        assert any("bearer token is configured without TLS" in r.getMessage() for r in caplog.records)
        metadata = [("authorization", "Bearer secret-token"), ("x-tenant", "gold"), ("x-priority", "3")]
        request = hello(tenant="i-say-i-am-gold", priority=100, request_id="from-gateway")
        list(server.stub.Generate(request, timeout=60, metadata=metadata))
        accepted = [r for r in caplog.records if getattr(r, "event", "") == "request accepted"]
        (line,) = [r for r in accepted if r.request_id == "from-gateway"]
        assert (line.tenant, line.priority) == ("gold", 3)
    finally:
        server.close()


def test_a_repeated_trusted_header_is_refused_on_both_doors(model_dir):
    """A gateway that appends its header (Envoy's default) must not let the client pick its tenant; HTTP
    took the first copy and gRPC the last, so either way a duplicate is refused."""
    grpc_server = start_server(model_dir, tenant_header="x-tenant", priority_header="x-priority")
    http_server = Server(model_dir, tenant_header="x-tenant", priority_header="x-priority")
    try:
        for header in ("x-tenant", "x-priority"):
            metadata = [(header, "1"), (header, "2")]
            with pytest.raises(grpc.RpcError) as caught:
                list(grpc_server.stub.Generate(hello(), timeout=60, metadata=metadata))
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert f"the {header} header appears 2 times" in caught.value.details()

            connection = http.client.HTTPConnection("127.0.0.1", http_server.server.http_port, timeout=60)
            body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
            connection.putrequest("POST", "/v1/completions")
            for value in ("1", "2"):
                connection.putheader(header, value)
            connection.putheader("Content-Type", "application/json")
            connection.putheader("Content-Length", str(len(body)))
            connection.endheaders(body)
            response = connection.getresponse()
            error = json.loads(response.read())["error"]
            connection.close()
            assert response.status == 400 and f"the {header} header appears 2 times" in error["message"]
        one = [("x-tenant", "gold"), ("x-priority", "3")]
        assert list(grpc_server.stub.Generate(hello(), timeout=60, metadata=one))[-1].finish_reason
        assert wait_until(grpc_server.pool_is_full) and wait_until(http_server.idle)
    finally:
        grpc_server.close()
        http_server.close()


# --- item 6: an unread Prefill -------------------------------------------------------------------------


def test_an_unread_prefill_call_frees_its_blocks(model_dir):
    """A Prefill nobody reads once pinned its blocks with no server-side limit."""
    engine = Engine.from_pretrained(
        model_dir,
        EngineConfig(
            cache=CacheConfig(block_size=16, num_blocks=64),
            max_model_len=1024,
            max_num_seqs=4,
            max_num_batched_tokens=256,
        ),
    )
    runner = LoopThread()
    config = PrefillServiceConfig(host="127.0.0.1", port=0, stream_stall_timeout_s=1.0)
    server = runner.call(_prefill_server(engine, model_fingerprint(model_dir), config))
    port = runner.call(server.start())
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=NEVER_READ_OPTIONS)
    try:
        stub = prefill_pb2_grpc.PrefillStub(channel)
        info = stub.GetInfo(prefill_pb2.GetInfoRequest(), timeout=30)
        request = prefill_pb2.PrefillRequest(
            request_id="unread",
            prompt_token_ids=[(7 * i) % 300 + 3 for i in range(600)],
            sampling=pb.SamplingParams(temperature=0.0),
            compatibility_hash=info.compatibility_hash,
        )
        call = stub.Prefill(request, timeout=120)
        manager = engine.block_manager
        assert wait_until(lambda: len(server.registry) == 1)
        assert wait_until(lambda: len(server.registry) == 0, timeout=30)
        assert wait_until(lambda: manager.num_free_blocks == manager.num_blocks)
        assert server.watchdog.num_stalled == 1
        call.cancel()
    finally:
        channel.close()
        runner.call(server.stop())
        runner.close()


async def _prefill_server(engine: Engine, fingerprint: str, config: PrefillServiceConfig) -> PrefillServer:
    return PrefillServer(engine, fingerprint, config)


def test_logit_bias_over_the_limit_is_refused_on_both_doors_before_conversion(model_dir):
    """~380k entries once cost ~0.25 s of GIL-held Python per refused request; the count is checked first."""
    grpc_server = start_server(model_dir, limits=RequestLimits(max_logit_bias=8))
    http_server = Server(model_dir, limits=RequestLimits(max_logit_bias=8))
    try:
        request = hello()
        request.sampling.logit_bias.update({token_id: -1.0 for token_id in range(9)})
        with pytest.raises(grpc.RpcError) as caught:
            list(grpc_server.stub.Generate(request, timeout=60))
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert (
            "logit_bias has 9 entries" in caught.value.details()
            and "--max-logit-bias" in caught.value.details()
        )

        huge = {str(token_id): "not even a number" for token_id in range(100_000)}
        status, body = http_call(
            http_server, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": huge}
        )
        assert status == 400 and body["error"]["param"] == "logit_bias"
        assert "logit_bias has 100000 entries" in body["error"]["message"]

        within = hello()
        within.sampling.logit_bias[5] = -1.0
        assert list(grpc_server.stub.Generate(within, timeout=60))[-1].finish_reason == pb.LENGTH
        assert wait_until(grpc_server.pool_is_full) and wait_until(http_server.idle)
    finally:
        grpc_server.close()
        http_server.close()


def test_chat_turns_over_the_limit_are_refused_on_both_doors_before_rendering(model_dir):
    """110k tiny turns once took 4.1 s of GIL-held conversion and templating to refuse; now the count is
    checked first, on both doors."""
    grpc_server = start_server(model_dir, limits=RequestLimits(max_chat_messages=4))
    http_server = Server(model_dir, limits=RequestLimits(max_chat_messages=4))
    try:
        request = pb.GenerateRequest(
            messages=[pb.ChatMessage(role="user", content="hi")] * 5,
            stopping=pb.StoppingParams(max_tokens=2, ignore_eos=True),
        )
        refused = refusal(grpc_server, request)
        assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "messages has 5 turns" in refused.details() and "--max-chat-messages" in refused.details()

        # Not even the turns' shape is looked at: the count refuses first.
        turns = [{"role": 7, "content": None}] * 10_000
        status, body = http_call(
            http_server, "POST", "/v1/chat/completions", {"messages": turns, "max_tokens": 2}
        )
        assert status == 400 and body["error"]["param"] == "messages"
        assert "messages has 10000 turns" in body["error"]["message"]

        within = [{"role": "user", "content": "hi"}] * 4
        status, body = http_call(
            http_server,
            "POST",
            "/v1/chat/completions",
            {"messages": within, "max_tokens": 2, "ignore_eos": True},
        )
        assert status == 200 and body["usage"]["completion_tokens"] == 2
        request.messages.pop()
        assert list(grpc_server.stub.Generate(request, timeout=60))[-1].finish_reason == pb.LENGTH
        assert wait_until(grpc_server.pool_is_full) and wait_until(http_server.idle)
    finally:
        grpc_server.close()
        http_server.close()


def test_an_http_body_with_too_many_json_objects_is_refused_while_parsing(model_dir):
    """110k tiny turns were parsed whole (40-100 ms holding the event loop) before their count was
    looked at; the parser now stops at the object bound. Braces inside strings do not count."""
    server = Server(model_dir, limits=RequestLimits(max_json_objects=8))
    try:
        turns = [{"role": "user", "content": "hi"}] * 110_000
        status, body = http_call(server, "POST", "/v1/chat/completions", {"messages": turns, "max_tokens": 2})
        assert status == 400 and body["error"]["param"] == "body", body
        message = body["error"]["message"]
        assert "more than 8 JSON objects" in message and "--max-json-objects" in message

        braces = {"prompt": "{" * 100 + "}", "max_tokens": 2, "logit_bias": {"5": 1.0}}
        status, body = http_call(server, "POST", "/v1/completions", braces)
        assert status == 200 and body["usage"]["completion_tokens"] == 2, body

        within = {"messages": [{"role": "user", "content": "hi"}] * 7, "max_tokens": 2}  # 8 objects
        status, body = http_call(server, "POST", "/v1/chat/completions", within)
        assert status == 200 and body["usage"]["completion_tokens"] == 2, body
        status, body = http_call(server, "POST", "/v1/chat/completions", {**within, "logit_bias": {}})
        assert status == 400 and "more than 8 JSON objects" in body["error"]["message"], body
        assert wait_until(server.idle)
    finally:
        server.close()


def test_a_whole_answer_past_the_memory_bound_is_told_to_stream(model_dir):
    """n=64, max_tokens=600, logprobs=20 once made a server hold +226 MiB for one small request. The
    worst case of a non-streamed answer is bounded; the same request streamed is served."""
    server = Server(model_dir, limits=RequestLimits(max_unstreamed_tokens=60))
    try:
        ask = {"prompt": "Hello", "n": 2, "max_tokens": 10, "logprobs": 3, "ignore_eos": True}
        status, body = http_call(server, "POST", "/v1/completions", ask)  # 2 x 10 x (1 + 3) = 80
        assert status == 400 and body["error"]["type"] == "invalid_request_error", body
        message = body["error"]["message"]
        assert "n=2 x max_tokens=10 x (1 + 3 logprobs) may hold 80 tokens" in message
        assert "--max-unstreamed-tokens" in message and "stream: true" in message

        ask["logprobs"] = 2  # 2 x 10 x 3 = 60: at the limit
        status, body = http_call(server, "POST", "/v1/completions", ask)
        assert status == 200 and len(body["choices"]) == 2

        # Unset max_tokens counts as the server's cap (4096 by default), streamed answers are not bound.
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        status, body = http_call(server, "POST", "/v1/chat/completions", chat)
        assert status == 400 and "max_tokens=4096" in body["error"]["message"]
        streamed = server.client.completions.create(
            model=MODEL,
            prompt="Hello",
            n=2,
            max_tokens=10,
            logprobs=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        assert [chunk.usage.completion_tokens for chunk in streamed if chunk.usage] == [20]
        assert wait_until(server.idle)
    finally:
        server.close()
