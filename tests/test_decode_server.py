"""The decode tier's public gRPC API on loopback: a real `DecodeServer` on a tiny model saved to disk
(weights + tiny tokenizer, loaded the way users load models), driven by real gRPC clients."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate
from pathlib import Path

import grpc
import pytest
from conftest import hf_greedy, random_prompts, save_tiny_model, wait_until
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tiny_tokenizer import TINY_VOCAB_SIZE

from decode_service.config import DecodeServiceConfig
from decode_service.server import DecodeServer
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.tokenizer import Tokenizer
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc
from serving.config import TLSConfig

MAX_MODEL_LEN = 256
NUM_BLOCKS = 128


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny random Llama saved with the tiny tokenizer; returns (directory, the HF reference model)."""
    directory = tmp_path_factory.mktemp("tiny-model")
    return directory, save_tiny_model(directory, 12)


class RunningServer:
    """A DecodeServer on its own event-loop thread, with a blocking client channel to it."""

    def __init__(self, model_dir, engine_config: EngineConfig, config: DecodeServiceConfig) -> None:
        self.engine = Engine.from_pretrained(model_dir, engine_config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.server: DecodeServer = self.call(self._create(config))
        self.port = self.call(self.server.start())
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    async def _create(self, config: DecodeServiceConfig) -> DecodeServer:
        return DecodeServer(self.engine, config)

    def call(self, coroutine, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def pool_is_full(self) -> bool:
        manager = self.engine.block_manager
        return manager.num_free_blocks == manager.num_blocks and len(self.server.registry) == 0

    def close(self) -> None:
        self.channel.close()
        self.call(self.server.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def start_server(
    model_dir, max_num_seqs=8, max_model_len=MAX_MODEL_LEN, num_blocks=NUM_BLOCKS, **config_kwargs
) -> RunningServer:
    engine_config = EngineConfig(
        cache=CacheConfig(block_size=8, num_blocks=num_blocks),
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=64,
    )
    config = DecodeServiceConfig(host="127.0.0.1", port=0, **config_kwargs)
    return RunningServer(model_dir, engine_config, config)


@pytest.fixture(scope="module")
def server(model):
    running = start_server(model[0])
    yield running
    running.close()


def greedy_request(token_ids=(), max_tokens=None, **kwargs) -> pb.GenerateRequest:
    stopping = (
        pb.StoppingParams(ignore_eos=True, max_tokens=max_tokens)
        if max_tokens
        else pb.StoppingParams(ignore_eos=True)
    )
    return pb.GenerateRequest(
        token_ids=list(token_ids), sampling=pb.SamplingParams(temperature=0.0), stopping=stopping, **kwargs
    )


def output_tokens(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def test_concurrent_streams_match_hf_greedy(server, model):
    hf = model[1]
    prompts = random_prompts(32, 40, min_len=1, max_len=60, vocab=TINY_VOCAB_SIZE)
    max_tokens = [1 + (i * 7) % 20 for i in range(32)]

    def generate(i: int) -> list[pb.GenerateResponse]:
        request = greedy_request(prompts[i], max_tokens[i], request_id=f"stream-{i}")
        return list(server.stub.Generate(request, timeout=120))

    with ThreadPoolExecutor(max_workers=32) as pool:
        results = list(pool.map(generate, range(32)))

    for i, responses in enumerate(results):
        assert output_tokens(responses) == hf_greedy(hf, prompts[i], max_tokens[i]), f"stream {i} diverged"
        # One token per message while the writer keeps up; tokens that piled up behind a busy event loop
        # go out together (coalesced), never out of order and never an empty message before the last.
        assert 1 <= len(responses) <= max_tokens[i]
        assert all(r.token_ids for r in responses)
        assert all(r.request_id == f"stream-{i}" for r in responses)
        assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
        last = responses[-1]
        assert last.finish_reason == pb.LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompts[i]), max_tokens[i])
        assert last.timings.first_token_seconds > 0
        assert last.timings.queue_seconds >= 0 and last.timings.prefill_seconds > 0
        assert all(not r.HasField("usage") and not r.HasField("timings") for r in responses[:-1])
    assert wait_until(server.pool_is_full)


def test_logprobs_are_streamed_per_token(server, model):
    prompt = random_prompts(1, 41, min_len=5, max_len=5, vocab=TINY_VOCAB_SIZE)[0]
    request = greedy_request(prompt, 4)
    request.sampling.logprobs = 3
    responses = list(server.stub.Generate(request, timeout=60))
    assert sum(len(r.token_ids) for r in responses) == 4
    for response in responses:  # one entry per token, also in a message that carries several
        assert [entry.token_id for entry in response.logprobs] == list(response.token_ids)
    for entry in (entry for response in responses for entry in response.logprobs):
        assert len(entry.top) == 3
        assert entry.top[0].token_id == entry.token_id
        assert entry.logprob == pytest.approx(entry.top[0].logprob)
        assert entry.top[0].logprob >= entry.top[1].logprob >= entry.top[2].logprob
    plain = list(server.stub.Generate(greedy_request(prompt, 4), timeout=60))
    assert all(not r.logprobs for r in plain)


def test_stop_token_id_ends_the_stream_and_is_reported(server, model):
    prompt = random_prompts(1, 42, min_len=6, max_len=6, vocab=TINY_VOCAB_SIZE)[0]
    full = hf_greedy(model[1], prompt, 8)
    stop = full[4]
    cut = full.index(stop)
    request = greedy_request(prompt, 8)
    request.stopping.stop_token_ids.append(stop)
    responses = list(server.stub.Generate(request, timeout=60))
    assert output_tokens(responses) == full[: cut + 1]
    assert responses[-1].finish_reason == pb.STOP
    assert responses[-1].WhichOneof("matched_stop") == "stop_token_id"
    assert responses[-1].stop_token_id == stop


def test_text_prompt_chat_and_stop_string(server, model):
    tokenizer = Tokenizer.from_pretrained(model[0])
    text_prompt = "Hello, world! How are you today?"
    request = pb.GenerateRequest(
        prompt=text_prompt,
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingParams(max_tokens=24, ignore_eos=True),
    )
    responses = list(server.stub.Generate(request, timeout=60))
    prompt_ids = tokenizer.encode(text_prompt)
    assert responses[-1].usage.prompt_tokens == len(prompt_ids)
    assert output_tokens(responses) == hf_greedy(model[1], prompt_ids, 24)
    text = "".join(r.text for r in responses)

    stop = text.strip()[3:6]
    assert stop
    request.stopping.stop.append(stop)
    stopped = list(server.stub.Generate(request, timeout=60))
    assert "".join(r.text for r in stopped) == text[: text.index(stop)]
    assert stopped[-1].finish_reason == pb.STOP
    assert stopped[-1].stop_string == stop

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = pb.GenerateRequest(
        messages=[pb.ChatMessage(**m) for m in messages],
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingParams(max_tokens=3, ignore_eos=True),
    )
    chat_ids = tokenizer.apply_chat_template(messages)
    chat_responses = list(server.stub.Generate(chat, timeout=60))
    assert chat_responses[-1].usage.prompt_tokens == len(chat_ids)
    assert output_tokens(chat_responses) == hf_greedy(model[1], chat_ids, 3)


def _with(request: pb.GenerateRequest, mutate: Callable[[pb.GenerateRequest], None]) -> pb.GenerateRequest:
    copy = pb.GenerateRequest()
    copy.CopyFrom(request)
    mutate(copy)
    return copy


VALID = greedy_request([5, 6, 7], 4)
INVALID = grpc.StatusCode.INVALID_ARGUMENT
BAD_INPUTS = [
    ("neither prompt nor token_ids", pb.GenerateRequest(), "none was given"),
    ("empty prompt", pb.GenerateRequest(prompt=""), "none was given"),
    ("prompt and token_ids", _with(VALID, lambda r: setattr(r, "prompt", "hi")), "got prompt and token_ids"),
    (
        "token_ids and messages",
        _with(VALID, lambda r: r.messages.add(role="user", content="hi")),
        "got token_ids and messages",
    ),
    ("token id past the vocab", greedy_request([5, TINY_VOCAB_SIZE], 4), "outside the vocabulary"),
    ("negative token id", greedy_request([-1], 4), "outside the vocabulary"),
    ("prompt longer than max_model_len", greedy_request([5] * MAX_MODEL_LEN, 4), "max_model_len"),
    ("max_tokens 0", _with(VALID, lambda r: setattr(r.stopping, "max_tokens", 0)), "max_tokens must be >= 1"),
    ("negative max_tokens", _with(VALID, lambda r: setattr(r.stopping, "max_tokens", -3)), "max_tokens"),
    ("prompt + max_tokens too long", greedy_request([5] * 200, 100), "exceeds max_model_len"),
    (
        "negative temperature",
        _with(VALID, lambda r: setattr(r.sampling, "temperature", -0.5)),
        "temperature must be >= 0",
    ),
    ("top_p 0", _with(VALID, lambda r: setattr(r.sampling, "top_p", 0.0)), "top_p must be in (0, 1]"),
    ("top_p above 1", _with(VALID, lambda r: setattr(r.sampling, "top_p", 1.5)), "top_p must be in (0, 1]"),
    ("top_k below -1", _with(VALID, lambda r: setattr(r.sampling, "top_k", -2)), "top_k"),
    ("logprobs above 20", _with(VALID, lambda r: setattr(r.sampling, "logprobs", 21)), "logprobs must be in"),
    ("negative logprobs", _with(VALID, lambda r: setattr(r.sampling, "logprobs", -1)), "logprobs must be in"),
    (
        "presence_penalty above 2",
        _with(VALID, lambda r: setattr(r.sampling, "presence_penalty", 2.5)),
        "presence_penalty must be in [-2, 2]",
    ),
    (
        "frequency_penalty below -2",
        _with(VALID, lambda r: setattr(r.sampling, "frequency_penalty", -3.0)),
        "frequency_penalty must be in [-2, 2]",
    ),
    (
        "repetition_penalty 0",
        _with(VALID, lambda r: setattr(r.sampling, "repetition_penalty", 0.0)),
        "repetition_penalty must be > 0",
    ),
    (
        "logit_bias token past the vocab",
        _with(VALID, lambda r: r.sampling.logit_bias.__setitem__(TINY_VOCAB_SIZE, 1.0)),
        "logit_bias token ids",
    ),
    (
        "logit_bias value above 100",
        _with(VALID, lambda r: r.sampling.logit_bias.__setitem__(3, 101.0)),
        "logit_bias values must be in [-100, 100]",
    ),
    (
        "unknown chat role",
        pb.GenerateRequest(messages=[pb.ChatMessage(role="wizard", content="hi")]),
        "role must be one of",
    ),
    (
        "stop token past the vocab",
        _with(VALID, lambda r: r.stopping.stop_token_ids.append(TINY_VOCAB_SIZE)),
        "stop_token_ids",
    ),
    (
        "min_tokens above max_tokens",
        _with(VALID, lambda r: setattr(r.stopping, "min_tokens", 9)),
        "min_tokens",
    ),
]


def test_bad_inputs_get_invalid_argument_while_a_good_stream_runs(server, model):
    prompt = random_prompts(1, 43, min_len=8, max_len=8, vocab=TINY_VOCAB_SIZE)[0]
    good_call = server.stub.Generate(greedy_request(prompt, 200, request_id="good-stream"), timeout=120)
    good_stream = iter(good_call)
    first = next(good_stream)

    # The good stream is live (it has not sent its last message), so its id is taken.
    with pytest.raises(grpc.RpcError) as duplicate:
        list(server.stub.Generate(greedy_request([1, 2], 2, request_id="good-stream"), timeout=30))
    assert duplicate.value.code() == INVALID
    assert "already used by a live request" in duplicate.value.details()

    for name, request, message in BAD_INPUTS:
        with pytest.raises(grpc.RpcError) as error:
            list(server.stub.Generate(request, timeout=30))
        assert error.value.code() == INVALID, name
        assert message in error.value.details(), f"{name}: {error.value.details()!r}"

    responses = [first, *good_stream]
    assert output_tokens(responses) == hf_greedy(model[1], prompt, 200)
    assert responses[-1].finish_reason == pb.LENGTH
    assert wait_until(server.pool_is_full)


def test_client_cancel_frees_every_block(server):
    call = server.stub.Generate(greedy_request([3, 4, 5], 200), timeout=60)
    stream = iter(call)
    next(stream)
    next(stream)
    call.cancel()
    assert wait_until(server.pool_is_full)
    assert not server.server.scheduler.has_work


def test_abort_rpc_ends_the_stream_with_abort_and_frees_blocks(server):
    call = server.stub.Generate(greedy_request([3, 4, 5], 200, request_id="to-abort"), timeout=60)
    stream = iter(call)
    received = [next(stream)]
    assert server.stub.Abort(pb.AbortRequest(request_id="to-abort")).aborted
    received.extend(stream)
    assert received[-1].finish_reason == pb.ABORT
    assert received[-1].usage.completion_tokens == len(output_tokens(received)) < 200
    assert wait_until(server.pool_is_full)
    assert not server.stub.Abort(pb.AbortRequest(request_id="to-abort")).aborted
    assert not server.stub.Abort(pb.AbortRequest(request_id="never-existed")).aborted


def test_model_info_health_and_reflection(server):
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.max_context_length == MAX_MODEL_LEN
    assert info.vocab_size == TINY_VOCAB_SIZE
    assert sorted(info.eos_token_ids) == [0, 2]
    assert (info.dtype, info.block_size, info.mode) == ("float32", 8, pb.SERVING_MODE_AGGREGATED)
    assert info.model_name and info.server_version

    health = health_pb2_grpc.HealthStub(server.channel)
    for service in ("", "tandem.v1.Generation"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING

    reflection = reflection_pb2_grpc.ServerReflectionStub(server.channel)
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    (answer,) = reflection.ServerReflectionInfo(iter([ask]))
    names = {s.name for s in answer.list_services_response.service}
    assert {"tandem.v1.Generation", "grpc.health.v1.Health"} <= names


def test_deadline_and_queue_full(model):
    running = start_server(model[0], max_num_seqs=1, max_model_len=2048, num_blocks=512, max_queue=1)
    try:
        long_request = greedy_request([3, 4, 5], 2000)
        first = running.stub.Generate(long_request, timeout=60)
        next(iter(first))
        second = running.stub.Generate(long_request, timeout=60)
        second_reader = ThreadPoolExecutor(1).submit(lambda: list(second))
        assert wait_until(lambda: len(running.server.registry) == 2)
        with pytest.raises(grpc.RpcError) as full:
            list(running.stub.Generate(greedy_request([1], 1), timeout=30))
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        first.cancel()
        second.cancel()
        with pytest.raises(grpc.RpcError):
            second_reader.result(30)
        assert wait_until(running.pool_is_full)

        with pytest.raises(grpc.RpcError) as late:
            list(running.stub.Generate(long_request, timeout=0.5))
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert wait_until(running.pool_is_full)
    finally:
        running.close()


def test_drain_finishes_running_streams_and_refuses_new_ones(model):
    running = start_server(model[0], max_model_len=1024, drain_grace_seconds=60)
    try:
        call = running.stub.Generate(greedy_request([3, 4, 5], 600), timeout=60)
        stream = iter(call)
        received = [next(stream)]
        drain = asyncio.run_coroutine_threadsafe(running.server.drain(), running._loop)
        health = health_pb2_grpc.HealthStub(running.channel)
        assert wait_until(
            lambda: (
                health.Check(health_pb2.HealthCheckRequest()).status
                == health_pb2.HealthCheckResponse.NOT_SERVING
            )
        )
        with pytest.raises(grpc.RpcError) as refused:
            list(running.stub.Generate(greedy_request([1, 2], 2), timeout=30))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in refused.value.details()
        received.extend(stream)
        assert received[-1].finish_reason == pb.LENGTH
        assert len(output_tokens(received)) == 600
        assert drain.result(60) is True
    finally:
        running.close()


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """A throwaway P-256 certificate for localhost/127.0.0.1 that is its own trust anchor."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "tls.crt", directory / "tls.key"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


def test_tls_and_bearer_token_guard_the_public_port(model, tmp_path):
    cert, key = self_signed_certificate(tmp_path)
    running = start_server(model[0], tls=TLSConfig(cert, key), auth_token="s3cret")
    try:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(f"localhost:{running.port}", credentials) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            token = (("authorization", "Bearer s3cret"),)
            responses = list(stub.Generate(greedy_request([5, 6], 3), metadata=token, timeout=30))
            assert output_tokens(responses) == hf_greedy(model[1], [5, 6], 3)
            for metadata in ((), (("authorization", "Bearer wrong"),)):
                with pytest.raises(grpc.RpcError) as refused:
                    list(stub.Generate(greedy_request([5, 6], 3), metadata=metadata, timeout=30))
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            health = health_pb2_grpc.HealthStub(channel)
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=30).status
            assert status == health_pb2.HealthCheckResponse.SERVING
    finally:
        running.close()


def _tandem_command() -> list[str]:
    script = Path(sys.executable).with_name("tandem")
    return [str(script)] if script.exists() else [sys.executable, "-m", "tandem.cli"]


@pytest.mark.slow
def test_sigterm_drains_a_tandem_serve_decode_process(model):
    command = [
        *_tandem_command(),
        "serve",
        "decode",
        "--model",
        str(model[0]),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--threads",
        "1",
        "--block-size",
        "8",
        "--kv-cache-memory",
        "16MiB",
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "64",
        "--drain-grace-seconds",
        "60",
    ]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    port: list[int] = []
    serving = threading.Event()

    def read_log() -> None:
        for line in process.stderr:
            log.append(line)
            match = re.search(r"decode server serving .* on [0-9.]+:([0-9]+)", line)
            if match:
                port.append(int(match.group(1)))
                serving.set()

    threading.Thread(target=read_log, daemon=True).start()
    try:
        assert serving.wait(120), "server did not start:\n" + "".join(log)
        with grpc.insecure_channel(f"127.0.0.1:{port[0]}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            status = health.Check(health_pb2.HealthCheckRequest()).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            stream = iter(stub.Generate(greedy_request([3, 4, 5], 1000), timeout=120))
            received = [next(stream)]
            process.send_signal(signal.SIGTERM)
            assert wait_until(
                lambda: (
                    health.Check(health_pb2.HealthCheckRequest()).status
                    == health_pb2.HealthCheckResponse.NOT_SERVING
                )
            )
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(greedy_request([1, 2], 2), timeout=30))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "draining" in refused.value.details()
            received.extend(stream)
        assert received[-1].finish_reason == pb.LENGTH
        assert len(output_tokens(received)) == 1000
        assert process.wait(60) == 0, "".join(log)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def test_stream_interval_groups_tokens_but_sends_the_first_and_last_at_once(model):
    running = start_server(model[0], stream_interval=4)
    try:
        prompt = random_prompts(1, 41, min_len=5, max_len=20, vocab=TINY_VOCAB_SIZE)[0]
        request = greedy_request(prompt, 11)
        request.sampling.logprobs = 1
        responses = list(running.stub.Generate(request, timeout=60))
        # The engine side releases groups of [1, 4, 4, 2] tokens; the edge may merge neighbouring groups
        # when its writer is busy (never splits them), so every message ends on a group boundary.
        ends = list(accumulate(len(r.token_ids) for r in responses))
        assert set(ends) <= {1, 5, 9, 11} and ends[-1] == 11
        assert [len(r.logprobs) for r in responses] == [len(r.token_ids) for r in responses]
        assert output_tokens(responses) == hf_greedy(model[1], prompt, 11)
        assert responses[-1].finish_reason == pb.LENGTH
        assert responses[-1].usage.completion_tokens == 11
    finally:
        running.close()
