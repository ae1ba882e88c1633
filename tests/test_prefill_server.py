"""The prefill tier on loopback: a real `PrefillServer` on a tiny model saved to disk, driven by real gRPC
clients that write the streamed KV into their own engine and decode from it."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import random
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch
from conftest import hf_greedy, random_prompts, save_tiny_model, wait_until
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tiny_tokenizer import TINY_VOCAB_SIZE

from base.auth import channel_credentials
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.model_runner import ScheduledChunk
from engine.model_store import model_fingerprint
from engine.params import SamplingParams, StoppingParams
from kv_transfer import MAX_MESSAGE_BYTES, KVLayout, compatibility_hash, write_chunk
from prefill_service.config import PrefillServiceConfig
from prefill_service.server import MAX_GRPC_MESSAGE_BYTES, PrefillServer
from protos.tandem.internal.v1 import prefill_pb2, prefill_pb2_grpc
from protos.tandem.v1 import generation_pb2
from serving.config import TLSConfig

BLOCK_SIZE = 16
NUM_BLOCKS = 128
TOKEN_BUDGET = 48  # not a multiple of BLOCK_SIZE: chunks end mid-block
MAX_MODEL_LEN = 1024
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny random Llama saved with the tiny tokenizer; returns (directory, the HF reference model)."""
    directory = tmp_path_factory.mktemp("tiny-prefill-model")
    return directory, save_tiny_model(directory, 21)


class StepGate:
    """Wraps an engine's `step` so a test can hold the engine thread between steps or slow it down.

    Installed after warm-up; while closed, the engine thread waits at the start of its next forward.
    """

    def __init__(self, engine: Engine) -> None:
        self._step = engine.step
        self.is_open = threading.Event()
        self.is_open.set()
        self.entered = threading.Event()
        self.delay_s = 0.0
        engine.step = self

    def close(self) -> None:
        self.entered.clear()
        self.is_open.clear()

    def open(self) -> None:
        self.is_open.set()

    def __call__(self, chunks):
        self.entered.set()
        self.is_open.wait(60)
        if self.delay_s:
            time.sleep(self.delay_s)
        return self._step(chunks)


class RunningServer:
    """A PrefillServer on its own event-loop thread, with a blocking client channel to it."""

    def __init__(self, model_dir: Path, engine_config: EngineConfig, config: PrefillServiceConfig) -> None:
        self.model_dir = model_dir
        self.engine = Engine.from_pretrained(model_dir, engine_config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.server: PrefillServer = self.call(self._create(config))
        self.port = self.call(self.server.start())
        self.gate = StepGate(self.engine)
        self.channel = grpc.insecure_channel(
            f"127.0.0.1:{self.port}", options=[("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES)]
        )
        self.stub = prefill_pb2_grpc.PrefillStub(self.channel)

    async def _create(self, config: PrefillServiceConfig) -> PrefillServer:
        return PrefillServer(self.engine, model_fingerprint(self.model_dir), config)

    def call(self, coroutine, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def submit(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    @property
    def compatibility_hash(self) -> str:
        return self.server.compatibility_hash

    def pool_is_full(self) -> bool:
        manager = self.engine.block_manager
        return manager.num_free_blocks == manager.num_blocks and len(self.server.registry) == 0

    def close(self) -> None:
        self.gate.open()
        self.channel.close()
        self.call(self.server.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def start_server(model_dir: Path, num_blocks: int = NUM_BLOCKS, **config_kwargs) -> RunningServer:
    engine_config = EngineConfig(
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8,
        max_num_batched_tokens=TOKEN_BUDGET,
    )
    config = PrefillServiceConfig(host="127.0.0.1", port=0, **config_kwargs)
    return RunningServer(model_dir, engine_config, config)


@pytest.fixture(scope="module")
def server(model):
    running = start_server(model[0])
    yield running
    running.close()


def prefill_request(
    server: RunningServer, prompt, request_id: str = "r", **sampling
) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling=generation_pb2.SamplingParams(temperature=0.0, **sampling),
        compatibility_hash=server.compatibility_hash,
    )


@dataclass
class Received:
    """One Prefill stream as the client saw it."""

    chunks: list[prefill_pb2.KVChunk] = field(default_factory=list)
    done: prefill_pb2.PrefillDone | None = None
    wire_bytes: int = 0  # serialized size of every message of the stream


def collect(responses) -> Received:
    received = Received()
    for response in responses:
        received.wire_bytes += response.ByteSize()
        assert received.done is None, "a message followed PrefillDone"
        if response.WhichOneof("kind") == "kv":
            received.chunks.append(response.kv)
        else:
            received.done = response.done
    return received


class LocalDecoder:
    """The test's own engine on the same checkpoint: receives KV into blocks it reserved, then decodes."""

    def __init__(self, model_dir: Path, layout: KVLayout, seed: int) -> None:
        num_blocks = 256
        order = list(range(num_blocks))
        random.Random(seed).shuffle(order)
        config = EngineConfig(cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks))
        self.engine = Engine.from_pretrained(model_dir, config, block_order=order)
        self.layout = layout

    def receive(self, prompt: list[int], received: Received, max_tokens: int):
        """Reserve the prompt's blocks, write every chunk, and append the first token like decode does."""
        engine = self.engine
        seq = engine.make_sequence(prompt, GREEDY, StoppingParams(max_tokens=max_tokens, ignore_eos=True))
        engine.allocate(seq, len(prompt))
        for chunk in received.chunks:
            write_chunk(
                chunk,
                self.layout,
                seq.block_table,
                len(seq.block_table),
                engine.kv_cache.k,
                engine.kv_cache.v,
            )
        seq.num_computed_tokens = len(prompt)
        seq.append_token(received.done.first_token_id, engine.eos_token_ids, engine.max_model_len)
        return seq

    def decode(self, seqs) -> None:
        """Continue every sequence one token per step, all in one batch, until each reaches max_tokens."""
        running = [s for s in seqs if not s.is_finished]
        while running:
            for seq in running:
                self.engine.allocate(seq, seq.num_tokens)
            self.engine.step([ScheduledChunk(seq, 1) for seq in running])
            running = [s for s in running if not s.is_finished]


def test_streamed_kv_decodes_to_hf_greedy(server, model):
    """Several prompts prefilled concurrently in small chunks; their KV, written into another engine's
    randomly placed blocks, continues to exactly Hugging Face's greedy output."""
    model_dir, hf = model
    lengths = [5, 16, 17, 47, 96, 131, 300]
    rng = random.Random(7)
    prompts = [[rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(n)] for n in lengths]
    max_tokens = 6
    info = server.stub.GetInfo(prefill_pb2.GetInfoRequest())
    layout = KVLayout.from_proto(info.kv_layout)

    server.gate.close()  # hold the engine so every prompt is queued before the first forward runs
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        futures = [
            pool.submit(
                lambda i=i: collect(server.stub.Prefill(prefill_request(server, prompts[i], f"kv-{i}")))
            )
            for i in range(len(prompts))
        ]
        assert wait_until(lambda: len(server.server.registry) == len(prompts))
        server.gate.open()
        results = [future.result(120) for future in futures]

    decoder = LocalDecoder(model_dir, layout, seed=3)
    payload_bytes = wire_bytes = 0
    seqs = []
    for prompt, received in zip(prompts, results, strict=True):
        assert received.done is not None
        assert received.done.num_prompt_tokens == len(prompt)
        num_blocks = -(-len(prompt) // BLOCK_SIZE)
        covered = sorted(
            (chunk.block_start + b, chunk.layer_start + layer)
            for chunk in received.chunks
            for b in range(chunk.num_blocks)
            for layer in range(chunk.num_layers)
        )
        assert covered == [(b, layer) for b in range(num_blocks) for layer in range(layout.num_layers)]
        assert all(len(chunk.payload) <= MAX_MESSAGE_BYTES for chunk in received.chunks)
        payload_bytes += sum(len(chunk.payload) for chunk in received.chunks)
        wire_bytes += received.wire_bytes
        seqs.append(decoder.receive(prompt, received, max_tokens))
        # Full blocks go out as chunks complete them: a multi-chunk prompt arrives in several messages.
        if len(prompt) > TOKEN_BUDGET + BLOCK_SIZE:
            assert len(received.chunks) >= 2
    decoder.decode(seqs)
    for prompt, seq, received in zip(prompts, seqs, results, strict=True):
        expected = hf_greedy(hf, prompt, max_tokens)
        assert received.done.first_token_id == expected[0]
        assert seq.output_token_ids == expected, f"prompt of {len(prompt)} tokens diverged"

    total_blocks = sum(-(-n // BLOCK_SIZE) for n in lengths)
    assert payload_bytes == total_blocks * layout.num_layers * layout.block_bytes()
    assert payload_bytes < wire_bytes < payload_bytes * 1.01  # framing is a small overhead on raw KV

    steps = server.server.events.snapshot()
    assert all(step.num_tokens <= TOKEN_BUDGET for step in steps)
    assert max(len(step.request_ids) for step in steps) >= 2, "no forward packed chunks of several prompts"
    assert wait_until(server.pool_is_full)


def test_first_token_logprobs_and_timings(server, model):
    prompt = random_prompts(1, 5, min_len=30, max_len=30, vocab=TINY_VOCAB_SIZE)[0]
    received = collect(server.stub.Prefill(prefill_request(server, prompt, "logprobs", logprobs=3)))
    done = received.done
    with torch.no_grad():
        logits = model[1](torch.tensor([prompt])).logits[0, -1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    top = logprobs.topk(3)
    assert done.first_token_id == int(top.indices[0])
    assert [t.token_id for t in done.top_logprobs] == top.indices.tolist()
    assert done.first_token_logprob == pytest.approx(float(top.values[0]), abs=1e-4)
    assert [t.logprob for t in done.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert done.timings.queue_seconds >= 0 and done.timings.prefill_seconds > 0


def test_get_info_health_and_reflection(server, model):
    info = server.stub.GetInfo(prefill_pb2.GetInfoRequest())
    fingerprint = model_fingerprint(model[0])
    layout = KVLayout.from_proto(info.kv_layout)
    model_config = server.engine.model_config
    assert info.model_fingerprint == fingerprint
    assert layout == KVLayout(
        model_config.num_layers, model_config.num_kv_heads, model_config.head_dim, BLOCK_SIZE, torch.float32
    )
    assert info.compatibility_hash == compatibility_hash(fingerprint, layout)
    assert info.version

    health = health_pb2_grpc.HealthStub(server.channel)
    for service in ("", "tandem.internal.v1.Prefill"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING

    reflection = reflection_pb2_grpc.ServerReflectionStub(server.channel)
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    (answer,) = reflection.ServerReflectionInfo(iter([ask]))
    names = {s.name for s in answer.list_services_response.service}
    assert {"tandem.internal.v1.Prefill", "grpc.health.v1.Health"} <= names


def test_cancel_after_first_kv_message_frees_the_pool(server, model):
    prompt = random_prompts(1, 9, min_len=600, max_len=600, vocab=TINY_VOCAB_SIZE)[0]
    server.gate.delay_s = 0.1  # a slow forward, so the cancel lands while the prompt is still prefilling
    try:
        call = server.stub.Prefill(prefill_request(server, prompt, "to-cancel"), timeout=60)
        first = next(iter(call))
        assert first.WhichOneof("kind") == "kv"
        call.cancel()
        assert wait_until(server.pool_is_full)
    finally:
        server.gate.delay_s = 0.0
    computed = sum(
        n for step in server.server.events.snapshot() for rid, n in step.chunks if rid == "to-cancel"
    )
    assert computed < len(prompt), "the cancelled prompt kept being prefilled"

    # The server keeps serving.
    short = prompt[:40]
    received = collect(server.stub.Prefill(prefill_request(server, short, "after-cancel"), timeout=60))
    assert received.done.first_token_id == hf_greedy(model[1], short, 1)[0]
    assert wait_until(server.pool_is_full)


def test_deadline_drops_the_request_and_frees_the_pool(server):
    prompt = random_prompts(1, 10, min_len=600, max_len=600, vocab=TINY_VOCAB_SIZE)[0]
    server.gate.delay_s = 0.1
    try:
        with pytest.raises(grpc.RpcError) as late:
            collect(server.stub.Prefill(prefill_request(server, prompt, "late"), timeout=0.3))
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert wait_until(server.pool_is_full)
    finally:
        server.gate.delay_s = 0.0


def test_refusals_while_a_good_request_runs(model):
    """Queue full, bad compatibility hash and invalid prompts are refused with their codes while
    admitted and queued requests are held mid-flight, and those then complete unharmed."""
    model_dir, hf = model
    running = start_server(model_dir, max_queue=1)
    try:
        good = [random_prompts(1, 11 + i, min_len=70, max_len=90, vocab=TINY_VOCAB_SIZE)[0] for i in range(2)]
        running.gate.close()
        pool = ThreadPoolExecutor(max_workers=2)
        first = pool.submit(
            lambda: collect(running.stub.Prefill(prefill_request(running, good[0], "good-0")))
        )
        assert running.gate.entered.wait(30)  # admitted; its first forward is held at the gate
        second = pool.submit(
            lambda: collect(running.stub.Prefill(prefill_request(running, good[1], "good-1")))
        )
        assert wait_until(lambda: len(running.server.registry) == 2)

        def refusal(request) -> grpc.RpcError:
            with pytest.raises(grpc.RpcError) as refused:
                collect(running.stub.Prefill(request, timeout=30))
            return refused.value

        full = refusal(prefill_request(running, [1, 2, 3], "over-the-limit"))
        assert full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue" in full.details()

        bad_hash = prefill_request(running, [1, 2, 3], "bad-hash")
        bad_hash.compatibility_hash = "0" * 64
        error = refusal(bad_hash)
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "compatibility_hash" in error.details()
        no_hash = prefill_request(running, [1, 2, 3], "no-hash")
        no_hash.compatibility_hash = ""
        assert refusal(no_hash).code() == grpc.StatusCode.FAILED_PRECONDITION

        invalid = {
            "empty prompt": prefill_request(running, [], "empty"),
            "token out of vocab": prefill_request(running, [1, TINY_VOCAB_SIZE], "oov"),
            "prompt too long": prefill_request(running, [1] * MAX_MODEL_LEN, "too-long"),
            "bad sampling": prefill_request(running, [1, 2], "bad-sampling", top_p=1.5),
            "too many logprobs": prefill_request(running, [1, 2], "bad-logprobs", logprobs=1000),
        }
        for case, request in invalid.items():
            assert refusal(request).code() == grpc.StatusCode.INVALID_ARGUMENT, case

        running.gate.open()
        for prompt, future in zip(good, (first, second), strict=True):
            assert future.result(60).done.first_token_id == hf_greedy(hf, prompt, 1)[0]
        pool.shutdown()
        assert wait_until(running.pool_is_full)
    finally:
        running.close()


def test_prompt_larger_than_the_pool_is_invalid_and_small_pool_admits_in_turn(model):
    """A pool of 8 blocks: one 100-token prompt (7 blocks) at a time, FIFO; a 200-token one can never fit."""
    model_dir, hf = model
    running = start_server(model_dir, num_blocks=8)
    try:
        with pytest.raises(grpc.RpcError) as too_big:
            collect(running.stub.Prefill(prefill_request(running, [5] * 200, "too-big"), timeout=30))
        assert too_big.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "blocks" in too_big.value.details()

        prompts = [
            random_prompts(1, 30 + i, min_len=100, max_len=100, vocab=TINY_VOCAB_SIZE)[0] for i in range(3)
        ]
        with ThreadPoolExecutor(max_workers=3) as pool:
            results = list(
                pool.map(
                    lambda i: collect(
                        running.stub.Prefill(prefill_request(running, prompts[i], f"turn-{i}"))
                    ),
                    range(3),
                )
            )
        for prompt, received in zip(prompts, results, strict=True):
            assert received.done.first_token_id == hf_greedy(hf, prompt, 1)[0]
        steps = running.server.events.snapshot()
        assert all(len(step.request_ids) == 1 for step in steps), "two 7-block prompts shared an 8-block pool"
        assert wait_until(running.pool_is_full)
    finally:
        running.close()


def test_drain_finishes_in_flight_prefills_and_refuses_new_ones(model):
    model_dir, hf = model
    running = start_server(model_dir, drain_grace_seconds=60)
    try:
        prompt = random_prompts(1, 12, min_len=200, max_len=200, vocab=TINY_VOCAB_SIZE)[0]
        running.gate.close()
        in_flight = ThreadPoolExecutor(1).submit(
            lambda: collect(running.stub.Prefill(prefill_request(running, prompt, "in-flight")))
        )
        assert running.gate.entered.wait(30)
        drain = running.submit(running.server.drain())
        health = health_pb2_grpc.HealthStub(running.channel)
        assert wait_until(
            lambda: (
                health.Check(health_pb2.HealthCheckRequest()).status
                == health_pb2.HealthCheckResponse.NOT_SERVING
            )
        )
        with pytest.raises(grpc.RpcError) as refused:
            collect(running.stub.Prefill(prefill_request(running, [1, 2], "during-drain"), timeout=30))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in refused.value.details()
        running.gate.open()
        assert in_flight.result(60).done.first_token_id == hf_greedy(hf, prompt, 1)[0]
        assert drain.result(60) is True
    finally:
        running.close()


def test_drain_past_its_grace_fails_unfinished_prefills_with_unavailable(model):
    running = start_server(model[0])
    try:
        prompt = random_prompts(1, 14, min_len=600, max_len=600, vocab=TINY_VOCAB_SIZE)[0]
        running.gate.delay_s = 0.2  # 13 slow forwards: far longer than the grace period
        call = running.stub.Prefill(prefill_request(running, prompt, "cut-off"), timeout=60)
        stream = iter(call)
        assert next(stream).WhichOneof("kind") == "kv"
        assert running.call(running.server.drain(grace_seconds=0.3)) is False
        with pytest.raises(grpc.RpcError) as cut:
            collect(stream)
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "stopped before" in cut.value.details()
    finally:
        running.close()


def _issue(directory: Path, name: str, issuer_key, issuer_name, san: bool = False, ca: bool = False):
    """A P-256 certificate and key for `name`, signed by the issuer (itself when issuer_key is None)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name or subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path, key, subject


def test_mutual_tls_admits_only_callers_with_a_certificate_from_the_client_ca(model, tmp_path):
    model_dir, hf = model
    ca_cert, _, ca_key, ca_name = _issue(tmp_path, "ca", None, None, ca=True)
    server_cert, server_key, _, _ = _issue(tmp_path, "prefill", ca_key, ca_name, san=True)
    client_cert, client_key, _, _ = _issue(tmp_path, "decode", ca_key, ca_name)
    _, _, rogue_key, rogue_name = _issue(tmp_path, "rogue-ca", None, None, ca=True)
    rogue_cert, rogue_client_key, _, _ = _issue(tmp_path, "rogue-decode", rogue_key, rogue_name)
    running = start_server(model_dir, tls=TLSConfig(server_cert, server_key, client_ca=ca_cert))
    try:
        target = f"127.0.0.1:{running.port}"
        with grpc.secure_channel(target, channel_credentials(ca_cert, client_cert, client_key)) as channel:
            stub = prefill_pb2_grpc.PrefillStub(channel)
            assert stub.GetInfo(prefill_pb2.GetInfoRequest(), timeout=30).compatibility_hash
            received = collect(stub.Prefill(prefill_request(running, [5, 6, 7], "mtls"), timeout=30))
            assert received.done.first_token_id == hf_greedy(hf, [5, 6, 7], 1)[0]
        refused_clients = {
            "no client certificate": channel_credentials(ca_cert),
            "certificate from another CA": channel_credentials(ca_cert, rogue_cert, rogue_client_key),
        }
        for case, credentials in refused_clients.items():
            with grpc.secure_channel(target, credentials) as channel:
                with pytest.raises(grpc.RpcError) as refused:
                    prefill_pb2_grpc.PrefillStub(channel).GetInfo(prefill_pb2.GetInfoRequest(), timeout=30)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, case
        with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError):
            prefill_pb2_grpc.PrefillStub(channel).GetInfo(prefill_pb2.GetInfoRequest(), timeout=30)
    finally:
        running.close()


def _tandem_command() -> list[str]:
    script = Path(sys.executable).with_name("tandem")
    return [str(script)] if script.exists() else [sys.executable, "-m", "tandem.cli"]


@pytest.mark.slow
def test_sigterm_drains_a_tandem_serve_prefill_process(model):
    model_dir, hf = model
    command = [
        *_tandem_command(),
        "serve",
        "prefill",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--threads",
        "1",
        "--block-size",
        "16",
        "--kv-cache-memory",
        "4MiB",
        "--max-num-batched-tokens",
        "32",
        "--max-queue",
        "8",
        "--drain-grace-seconds",
        "60",
        "--log-format",
        "json",
    ]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    port: list[int] = []
    serving = threading.Event()

    def read_log() -> None:
        for line in process.stderr:
            log.append(line)
            match = re.search(r"prefill server serving .* on [0-9.]+:([0-9]+)", line)
            if match:
                port.append(int(match.group(1)))
                serving.set()

    threading.Thread(target=read_log, daemon=True).start()
    prompt = random_prompts(1, 13, min_len=900, max_len=900, vocab=TINY_VOCAB_SIZE)[0]
    try:
        assert serving.wait(120), "server did not start:\n" + "".join(log)
        with grpc.insecure_channel(f"127.0.0.1:{port[0]}") as channel:
            stub = prefill_pb2_grpc.PrefillStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            assert (
                health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
            )
            own_hash = stub.GetInfo(prefill_pb2.GetInfoRequest()).compatibility_hash
            request = prefill_pb2.PrefillRequest(
                request_id="sigterm",
                prompt_token_ids=prompt,
                sampling=generation_pb2.SamplingParams(temperature=0.0),
                compatibility_hash=own_hash,
            )
            stream = iter(stub.Prefill(request, timeout=120))
            first = next(stream)
            process.send_signal(signal.SIGTERM)
            assert wait_until(
                lambda: (
                    health.Check(health_pb2.HealthCheckRequest()).status
                    == health_pb2.HealthCheckResponse.NOT_SERVING
                )
            )
            with pytest.raises(grpc.RpcError) as refused:
                collect(stub.Prefill(request, timeout=30))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            received = collect(stream)
        assert first.WhichOneof("kind") == "kv"
        assert received.done.first_token_id == hf_greedy(hf, prompt, 1)[0]
        assert process.wait(60) == 0, "".join(log)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    events = [json.loads(line) for line in log if line.startswith("{")]
    finished = [e for e in events if e.get("event") == "prefill finished"]
    assert [e["request_id"] for e in finished] == ["sigterm"]
    assert finished[0]["prompt_tokens"] == len(prompt) and finished[0]["kv_bytes"] > 0
