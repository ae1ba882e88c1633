"""Disaggregated serving on loopback: real decode servers calling real prefill servers (in-process, or
`tandem serve prefill` processes where a test kills one), all on a tiny random model saved to disk.

Every test ends by checking that both tiers' block pools are full again: whatever happened to a
request (finished, cancelled, retried, failed), no KV block stays behind.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import random
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from conftest import hf_greedy, save_tiny_model, wait_until
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from tiny_tokenizer import TINY_VOCAB_SIZE

from decode_service.config import DecodeServiceConfig
from decode_service.engine_core.remote_prefill.pool import ReplicaState
from decode_service.server import DecodeServer
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.model_store import model_fingerprint
from engine.speculation import SpeculativeConfig
from prefill_service.config import PrefillServiceConfig
from prefill_service.server import PrefillServer
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc
from serving.config import TLSConfig

BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny random Llama saved with the tiny tokenizer; returns (directory, the HF reference model)."""
    directory = tmp_path_factory.mktemp("tiny-disagg-model")
    return directory, save_tiny_model(directory, 33)


class LoopThread:
    """An asyncio loop on its own thread, for a server under test."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def call(self, coroutine, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class StepGate:
    """Wraps an engine's `step` so a test can hold the engine thread (a hung server) or slow it down."""

    def __init__(self, engine: Engine) -> None:
        self._step = engine.step
        self.is_open = threading.Event()
        self.is_open.set()
        self.entered = threading.Event()
        self.delay_s = 0.0
        engine.step = self

    def __call__(self, chunks):
        self.entered.set()
        self.is_open.wait(60)
        if self.delay_s:
            time.sleep(self.delay_s)
        return self._step(chunks)


class RunningPrefill:
    """A PrefillServer in this process."""

    def __init__(
        self,
        model_dir: Path,
        block_size: int = BLOCK_SIZE,
        dtype: torch.dtype = torch.float32,
        token_budget: int = 64,
        num_blocks: int = 512,
        tls: TLSConfig | None = None,
        prefix_caching: bool = True,
        kv_cache_dtype: str = "auto",
        quantization: str = "none",
        max_model_len: int = MAX_MODEL_LEN,
    ) -> None:
        engine_config = EngineConfig(
            dtype=dtype,
            cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
            max_model_len=max_model_len,
            max_num_seqs=16,
            max_num_batched_tokens=token_budget,
            enable_prefix_caching=prefix_caching,
            kv_cache_dtype=kv_cache_dtype,
            quantization=quantization,
        )
        self.engine = Engine.from_pretrained(model_dir, engine_config)
        self.runner = LoopThread()
        self.server: PrefillServer = self.runner.call(self._create(model_dir, tls))
        self.port = self.runner.call(self.server.start())
        self.gate = StepGate(self.engine)

    async def _create(self, model_dir: Path, tls: TLSConfig | None) -> PrefillServer:
        config = PrefillServiceConfig(host="127.0.0.1", port=0, tls=tls)
        return PrefillServer(self.engine, model_fingerprint(model_dir), config)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def prefilled_request_ids(self) -> set[str]:
        return {rid for step in self.server.events.snapshot() for rid, _ in step.chunks}

    def pool_is_full(self) -> bool:
        manager = self.engine.block_manager
        return manager.num_free_blocks == manager.num_blocks and len(self.server.registry) == 0

    def close(self) -> None:
        self.gate.is_open.set()
        self.runner.call(self.server.stop())
        self.runner.close()


class RunningDecode:
    """A DecodeServer in this process, with a blocking client to it."""

    def __init__(
        self,
        model_dir: Path,
        num_blocks: int = 1024,
        prefix_caching: bool = True,
        kv_cache_dtype: str = "auto",
        quantization: str = "none",
        max_model_len: int = MAX_MODEL_LEN,
        speculative: SpeculativeConfig | None = None,
        **config_kwargs,
    ) -> None:
        engine_config = EngineConfig(
            cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
            max_model_len=max_model_len,
            max_num_seqs=16,
            max_num_batched_tokens=64,
            enable_prefix_caching=prefix_caching,
            kv_cache_dtype=kv_cache_dtype,
            quantization=quantization,
            speculative=speculative or SpeculativeConfig(),
        )
        self.engine = Engine.from_pretrained(model_dir, engine_config)
        self.runner = LoopThread()
        config = DecodeServiceConfig(host="127.0.0.1", port=0, **config_kwargs)
        fingerprint = model_fingerprint(model_dir)
        self.server: DecodeServer = self.runner.call(self._create(config, fingerprint))
        self.port = self.runner.call(self.server.start())
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    async def _create(self, config: DecodeServiceConfig, fingerprint: str) -> DecodeServer:
        return DecodeServer(self.engine, config, model_fingerprint=fingerprint)

    @property
    def stats(self):
        return self.server.remote_prefill.stats

    @property
    def pool(self):
        return self.server.remote_prefill.pool

    def replica(self, address: str):
        return next(r for r in self.pool.replicas if r.address == address)

    def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        request_id: str,
        timeout: float = 120,
        salt: str = "",
        **kwargs,
    ):
        request = pb.GenerateRequest(
            request_id=request_id,
            token_ids=prompt,
            cache_salt=salt,
            sampling=pb.SamplingParams(temperature=0.0, **kwargs),
            stopping=pb.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
        )
        return list(self.stub.Generate(request, timeout=timeout))

    def locally_prefilled_request_ids(self) -> set[str]:
        return {rid for step in self.server.events.snapshot() for rid in step.prefill_ids}

    def pool_is_full(self) -> bool:
        manager = self.engine.block_manager
        return manager.num_free_blocks == manager.num_blocks and len(self.server.registry) == 0

    def close(self) -> None:
        self.channel.close()
        self.runner.call(self.server.stop())
        self.runner.close()


def tokens_of(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(n)] for n in lengths]


def kv_bytes_of(engine: Engine, num_tokens: int) -> int:
    """Payload bytes of a prompt's KV: every block, every layer, K and V."""
    model = engine.model_config
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    return num_blocks * model.num_layers * 2 * BLOCK_SIZE * model.num_kv_heads * model.head_dim * 4


@pytest.fixture(scope="module")
def two_prefills(model):
    replicas = [RunningPrefill(model[0]), RunningPrefill(model[0])]
    yield replicas
    for replica in replicas:
        replica.close()


def test_disaggregated_equals_aggregated_equals_hf_greedy(model, two_prefills):
    """16 concurrent prompts of 5 to 600 tokens: prefilled on two prefill replicas (several chunks
    each), their KV streamed into decode, decoded there; token for token what the aggregated server
    and Hugging Face produce. The KV really crossed the wire: decode counted every byte of it."""
    model_dir, hf = model
    lengths = [5, 16, 17, 33, 64, 95, 128, 150, 200, 257, 300, 350, 420, 480, 555, 600]
    prompts = prompts_of(lengths, seed=1)
    max_tokens = [1 + (i * 3) % 9 for i in range(len(prompts))]
    targets = ",".join(p.address for p in two_prefills)
    disaggregated = RunningDecode(model_dir, prefill=targets)
    aggregated = RunningDecode(model_dir)
    try:
        assert [r.state for r in disaggregated.pool.replicas] == [ReplicaState.READY] * 2
        info = disaggregated.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert info.mode == pb.SERVING_MODE_DISAGGREGATED
        assert aggregated.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).mode == (
            pb.SERVING_MODE_AGGREGATED
        )

        def run(server: RunningDecode) -> list[list[pb.GenerateResponse]]:
            with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
                futures = [
                    pool.submit(server.generate, prompts[i], max_tokens[i], f"p{i}", logprobs=2)
                    for i in range(len(prompts))
                ]
                return [future.result(180) for future in futures]

        remote, local = run(disaggregated), run(aggregated)
        for i, prompt in enumerate(prompts):
            expected = hf_greedy(hf, prompt, max_tokens[i])
            assert tokens_of(remote[i]) == expected, f"disaggregated prompt of {len(prompt)} tokens diverged"
            assert tokens_of(local[i]) == expected, f"aggregated prompt of {len(prompt)} tokens diverged"
            assert remote[i][-1].finish_reason == pb.LENGTH
            assert remote[i][-1].usage.prompt_tokens == len(prompt)
            # The first token's logprobs came from the prefill replica; they match the local ones.
            first_remote, first_local = remote[i][0].logprobs[0], local[i][0].logprobs[0]
            assert [t.token_id for t in first_remote.top] == [t.token_id for t in first_local.top]
            assert first_remote.logprob == pytest.approx(first_local.logprob, abs=1e-4)

        stats = disaggregated.stats
        assert stats.remote_prefills_completed == len(prompts) and stats.local_prefills == 0
        assert stats.kv_bytes_received == sum(kv_bytes_of(disaggregated.engine, n) for n in lengths)
        assert stats.kv_messages_received >= len(prompts)
        assert stats.attempt_failures == 0
        registry = disaggregated.server.metrics.registry
        assert registry.get_sample_value("tandem:kv_transfer_bytes_total") == stats.kv_bytes_received
        assert not disaggregated.locally_prefilled_request_ids(), "a prompt was prefilled on decode"
        # Both replicas took a share, and each computed its prompts in several chunks.
        for replica in two_prefills:
            assert disaggregated.replica(replica.address).prefills_completed > 0
            steps = replica.server.events.snapshot()
            assert all(step.num_tokens <= 64 for step in steps)
        prefilled = set().union(*(p.prefilled_request_ids() for p in two_prefills))
        assert prefilled == {f"p{i}" for i in range(len(prompts))}
        assert wait_until(disaggregated.pool_is_full) and wait_until(aggregated.pool_is_full)
        assert all(wait_until(p.pool_is_full) for p in two_prefills)
    finally:
        disaggregated.close()
        aggregated.close()


def test_incompatible_prefill_replicas_are_refused(model, caplog):
    """Prefill replicas with another block size or dtype are refused at the handshake: no prompt is
    ever sent to them. Without fallback the request fails with UNAVAILABLE naming what differs; with
    --fallback-local it is prefilled on decode and still correct."""
    model_dir, hf = model
    other_block = RunningPrefill(model_dir, block_size=8)
    other_dtype = RunningPrefill(model_dir, dtype=torch.bfloat16)
    targets = f"{other_block.address},{other_dtype.address}"
    prompt = prompts_of([90], seed=2)[0]
    try:
        with caplog.at_level(logging.ERROR, logger="decode_service.engine_core.remote_prefill.pool"):
            strict = RunningDecode(model_dir, prefill=targets)
        lenient = RunningDecode(model_dir, prefill=targets, fallback_local=True)
        try:
            for decode in (strict, lenient):
                assert [r.state for r in decode.pool.replicas] == [ReplicaState.INCOMPATIBLE] * 2
            messages = [record.getMessage() for record in caplog.records]
            refusals = [m for m in messages if "refusing prefill replica" in m]
            assert any("block_size 8 != ours 16" in m and other_block.address in m for m in refusals)
            assert any("dtype torch.bfloat16 != ours torch.float32" in m for m in refusals)

            with pytest.raises(grpc.RpcError) as failed:
                strict.generate(prompt, 4, "strict")
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no prefill replica is available" in failed.value.details()
            details = failed.value.details()
            assert "incompatible" in details and "block_size 8 != ours 16" in details

            assert tokens_of(lenient.generate(prompt, 4, "lenient")) == hf_greedy(hf, prompt, 4)
            assert lenient.locally_prefilled_request_ids() == {"lenient"}
            assert lenient.stats.local_prefills == 1
            assert not other_block.prefilled_request_ids() and not other_dtype.prefilled_request_ids()
            assert wait_until(strict.pool_is_full) and wait_until(lenient.pool_is_full)
        finally:
            strict.close()
            lenient.close()
    finally:
        other_block.close()
        other_dtype.close()


def test_int8_kv_disaggregated_equals_aggregated_and_other_kv_dtypes_are_refused(model, caplog):
    """Both tiers on an int8 KV cache: the prompts' quantized KV and scales cross the wire (about 0.27x
    of fp32's bytes) and decode continues token for token as an aggregated int8 server does. A tier on
    another KV dtype is refused at the handshake, naming the dtypes and the flag."""
    model_dir, _ = model
    int8_prefill = RunningPrefill(model_dir, kv_cache_dtype="int8")
    fp32_prefill = RunningPrefill(model_dir)
    with caplog.at_level(logging.ERROR, logger="decode_service.engine_core.remote_prefill.pool"):
        int8_decode = RunningDecode(model_dir, kv_cache_dtype="int8", prefill=int8_prefill.address)
        mismatched = [
            RunningDecode(model_dir, prefill=int8_prefill.address),
            RunningDecode(model_dir, kv_cache_dtype="int8", prefill=fp32_prefill.address),
        ]
    aggregated = RunningDecode(model_dir, kv_cache_dtype="int8")
    prompts = prompts_of([40, 130, 260], seed=4)
    try:
        for i, prompt in enumerate(prompts):  # one at a time: both prefill the prompt in the same chunks
            remote = int8_decode.generate(prompt, 6, f"remote-{i}")
            assert tokens_of(remote) == tokens_of(aggregated.generate(prompt, 6, f"local-{i}"))
        assert not int8_decode.locally_prefilled_request_ids()
        fp32_bytes = sum(kv_bytes_of(int8_decode.engine, len(p)) for p in prompts)
        assert int8_decode.stats.kv_bytes_received == pytest.approx(fp32_bytes * 68 / 256)

        refusals = [r.getMessage() for r in caplog.records if "refusing prefill replica" in r.getMessage()]
        assert any("dtype torch.int8 != ours torch.float32" in m for m in refusals)
        assert any("dtype torch.float32 != ours torch.int8" in m for m in refusals)
        assert all("--kv-cache-dtype" in m for m in refusals) and len(refusals) == 2
        for decode in mismatched:
            assert [r.state for r in decode.pool.replicas] == [ReplicaState.INCOMPATIBLE]
            with pytest.raises(grpc.RpcError) as failed:
                decode.generate(prompts[0], 2, "mismatched")
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "--kv-cache-dtype" in failed.value.details()
        assert not fp32_prefill.prefilled_request_ids()
        for server in (int8_decode, aggregated, *mismatched, int8_prefill):
            assert wait_until(server.pool_is_full)
    finally:
        for server in (int8_decode, aggregated, *mismatched, int8_prefill, fp32_prefill):
            server.close()


def test_short_prompts_prefill_locally_long_ones_remotely(model, two_prefills):
    model_dir, hf = model
    decode = RunningDecode(model_dir, prefill=two_prefills[0].address, local_prefill_threshold=32)
    try:
        lengths = {"short-1": 5, "short-31": 31, "long-32": 32, "long-200": 200}
        prompts = dict(zip(lengths, prompts_of(list(lengths.values()), seed=3), strict=True))
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            outputs = pool.map(lambda i: decode.generate(prompts[i], 5, i), prompts)
            results = dict(zip(prompts, outputs, strict=True))
        for request_id, prompt in prompts.items():
            assert tokens_of(results[request_id]) == hf_greedy(hf, prompt, 5), request_id
        assert decode.locally_prefilled_request_ids() == {"short-1", "short-31"}
        assert {"long-32", "long-200"} <= two_prefills[0].prefilled_request_ids()
        assert not {"short-1", "short-31"} & two_prefills[0].prefilled_request_ids()
        assert (decode.stats.local_prefills, decode.stats.remote_prefills_completed) == (2, 2)

        # A first token that must not be EOS (min_tokens) is sampled here: Prefill cannot suppress it.
        suppressed = pb.GenerateRequest(
            request_id="min-tokens",
            token_ids=prompts["long-200"],
            sampling=pb.SamplingParams(temperature=0.0),
            stopping=pb.StoppingParams(max_tokens=3, min_tokens=2),
        )
        assert list(decode.stub.Generate(suppressed, timeout=60))[-1].usage.completion_tokens >= 2
        assert "min-tokens" in decode.locally_prefilled_request_ids()
        assert wait_until(decode.pool_is_full) and wait_until(two_prefills[0].pool_is_full)
    finally:
        decode.close()


def test_first_token_from_prefill_can_finish_the_request(model, two_prefills):
    """max_tokens=1 and a stop token that is the first token: the request ends as prefill completes."""
    model_dir, hf = model
    decode = RunningDecode(model_dir, prefill=two_prefills[1].address)
    try:
        prompt = prompts_of([70], seed=4)[0]
        first = hf_greedy(hf, prompt, 1)[0]
        (only,) = decode.generate(prompt, 1, "one-token")
        assert list(only.token_ids) == [first] and only.finish_reason == pb.LENGTH
        request = pb.GenerateRequest(
            request_id="stopped",
            token_ids=prompt,
            sampling=pb.SamplingParams(temperature=0.0),
            stopping=pb.StoppingParams(max_tokens=20, stop_token_ids=[first], ignore_eos=True),
        )
        (stopped,) = list(decode.stub.Generate(request, timeout=60))
        assert stopped.finish_reason == pb.STOP and stopped.stop_token_id == first
        assert stopped.usage.completion_tokens == 1
        assert decode.stats.remote_prefills_completed == 2
        assert wait_until(decode.pool_is_full)
    finally:
        decode.close()


def test_client_cancel_during_transfer_frees_both_pools(model):
    """The client cancels once KV is flowing: the Prefill call is cancelled, prefill stops computing
    the prompt, and both tiers' pools are full again."""
    model_dir, _ = model
    prefill = RunningPrefill(model_dir, token_budget=32)
    decode = RunningDecode(model_dir, prefill=prefill.address)
    try:
        prompt = prompts_of([600], seed=5)[0]
        prefill.gate.delay_s = 0.05  # about a second for the whole prompt
        request = pb.GenerateRequest(
            request_id="cancel-me", token_ids=prompt, stopping=pb.StoppingParams(max_tokens=4)
        )
        call = decode.stub.Generate(request, timeout=60)
        assert wait_until(lambda: decode.stats.kv_messages_received >= 1)
        call.cancel()
        assert wait_until(lambda: decode.pool_is_full() and prefill.pool_is_full())
        steps = prefill.server.events.snapshot()
        computed = sum(n for step in steps for rid, n in step.chunks if rid == "cancel-me")
        assert computed < len(prompt), "prefill kept computing a cancelled prompt"
        assert decode.stats.remote_prefills_completed == 0 and decode.stats.attempt_failures == 0
    finally:
        prefill.gate.delay_s = 0.0
        decode.close()
        prefill.close()


VANISHING_CALLER = """
import sys, time
import grpc
from protos.tandem.internal.v1 import prefill_pb2, prefill_pb2_grpc
from protos.tandem.v1 import generation_pb2
address, compatibility_hash, prompt = sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3].split(",")]
stub = prefill_pb2_grpc.PrefillStub(grpc.insecure_channel(address))
request = prefill_pb2.PrefillRequest(
    request_id="vanishing", prompt_token_ids=prompt, compatibility_hash=compatibility_hash,
    sampling=generation_pb2.SamplingParams(temperature=0.0),
)
for response in stub.Prefill(request, timeout=120):
    print(response.WhichOneof("kind"), flush=True)
    time.sleep(120)
"""


def test_prefill_frees_everything_when_its_caller_process_dies(model):
    """A decode process killed mid-transfer never cancels its call; the broken connection alone makes
    the prefill replica drop the prompt and free its blocks."""
    model_dir, _ = model
    prefill = RunningPrefill(model_dir, token_budget=32)
    prefill.gate.delay_s = 0.05
    prompt = prompts_of([600], seed=13)[0]
    caller = subprocess.Popen(
        [
            sys.executable,
            "-c",
            VANISHING_CALLER,
            prefill.address,
            prefill.server.compatibility_hash,
            ",".join(map(str, prompt)),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    try:
        assert caller.stdout.readline().strip() == "kv"
        assert not prefill.pool_is_full()
        caller.send_signal(signal.SIGKILL)
        caller.wait(10)
        assert wait_until(prefill.pool_is_full, timeout=10)
        steps = prefill.server.events.snapshot()
        assert sum(n for step in steps for rid, n in step.chunks if rid == "vanishing") < len(prompt)
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait(10)
        prefill.close()


def test_hung_prefill_hits_the_deadline_then_retries_or_fails(model):
    """A prefill replica that never answers: past --prefill-timeout its call is cancelled and the
    prompt goes to the other replica; with no other, the request fails with UNAVAILABLE. Nothing stays
    stuck: the hung replica frees its blocks once it moves again, and decode's pool is full."""
    model_dir, hf = model
    hung, healthy = RunningPrefill(model_dir), RunningPrefill(model_dir)
    hung.gate.is_open.clear()
    both = RunningDecode(model_dir, prefill=f"{hung.address},{healthy.address}", prefill_timeout_s=1.0)
    only_hung = RunningDecode(model_dir, prefill=hung.address, prefill_timeout_s=1.0)
    try:
        # Under one full block: no prefix to route by, so the two calls spread by load over both replicas.
        prompts = prompts_of([12, 14], seed=6)
        with ThreadPoolExecutor(max_workers=2) as pool:
            results = list(pool.map(lambda i: both.generate(prompts[i], 3, f"hung-{i}"), range(2)))
        for prompt, responses in zip(prompts, results, strict=True):
            assert tokens_of(responses) == hf_greedy(hf, prompt, 3)
        assert both.stats.retries >= 1 and both.stats.attempt_failures >= 1
        assert both.replica(hung.address).state is ReplicaState.BACKOFF
        assert "timeout" in both.replica(hung.address).reason

        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as failed:
            only_hung.generate(prompts[0], 3, "no-way-out")
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "prefill timeout" in failed.value.details() and hung.address in failed.value.details()
        assert time.monotonic() - started < 10
        for decode in (both, only_hung):
            assert wait_until(decode.pool_is_full)
        hung.gate.is_open.set()
        assert wait_until(hung.pool_is_full) and wait_until(healthy.pool_is_full)

        # Not banned forever: after its backoff the replica is checked again and takes work.
        assert wait_until(lambda: both.replica(hung.address).state is ReplicaState.READY, timeout=10)
        with ThreadPoolExecutor(max_workers=2) as pool:
            list(pool.map(lambda i: both.generate(prompts[i], 2, f"back-{i}"), range(2)))
        assert both.replica(hung.address).prefills_completed >= 1
    finally:
        both.close()
        only_hung.close()
        hung.close()
        healthy.close()


def test_preempted_requests_are_prefilled_again_remotely_with_their_history(model, two_prefills):
    """A decode pool too small for four growing sequences preempts some; each comes back through the
    prefill tier with its prompt plus what it generated, and still ends exactly as HF greedy does."""
    model_dir, hf = model
    decode = RunningDecode(model_dir, num_blocks=40, prefill=two_prefills[0].address)
    try:
        prompts = prompts_of([150, 140, 130, 120], seed=11)
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            results = list(pool.map(lambda i: decode.generate(prompts[i], 100, f"pre-{i}"), range(4)))
        for prompt, responses in zip(prompts, results, strict=True):
            assert tokens_of(responses) == hf_greedy(hf, prompt, 100)
        assert decode.server.scheduler.num_preemptions > 0
        # Sent back, not necessarily completed: in one loaded run a re-sent Prefill was started and never
        # counted complete (5 started, 4 completed), while every reply above still equalled HF's.
        assert decode.stats.remote_prefills_started > len(prompts), f"none went back: {decode.stats}"
        assert not decode.locally_prefilled_request_ids()
        assert wait_until(decode.pool_is_full) and wait_until(two_prefills[0].pool_is_full)
    finally:
        decode.close()


def _issue(ca_key, ca_name, subject: str, directory: Path, server_name: str | None) -> tuple[Path, Path]:
    """A P-256 certificate signed by the CA: for a server with `server_name` as its only DNS name."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
    usage = ExtendedKeyUsageOID.CLIENT_AUTH if server_name is None else ExtendedKeyUsageOID.SERVER_AUTH
    builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server_name is not None:
        names = x509.SubjectAlternativeName([x509.DNSName(server_name)])
        builder = builder.add_extension(names, critical=False)
    cert_path, key_path = directory / f"{subject}.pem", directory / f"{subject}-key.pem"
    cert_path.write_bytes(builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


def test_mutual_tls_toward_prefill_through_a_dns_target(model, tmp_path):
    """Decode resolves dns:///localhost:PORT itself and dials the address it gets, checking the prefill
    certificate against the name (it names only `localhost`, no IP) and presenting its own certificate.
    A decode replica without a client certificate is refused at the handshake."""
    model_dir, hf = model
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tandem-test-ca")])
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    ca_path = tmp_path / "ca.pem"
    ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    server_cert, server_key = _issue(ca_key, ca_name, "prefill", tmp_path, server_name="localhost")
    client_cert, client_key = _issue(ca_key, ca_name, "decode", tmp_path, server_name=None)

    prefill = RunningPrefill(model_dir, tls=TLSConfig(server_cert, server_key, client_ca=ca_path))
    target = f"dns:///localhost:{prefill.port}"
    trusted = RunningDecode(
        model_dir,
        prefill=target,
        prefill_tls_ca=ca_path,
        prefill_tls_cert=client_cert,
        prefill_tls_key=client_key,
    )
    anonymous = RunningDecode(model_dir, prefill=target, prefill_tls_ca=ca_path)
    try:
        ready = [r.address for r in trusted.pool.replicas if r.state is ReplicaState.READY]
        assert ready == [prefill.address]
        prompt = prompts_of([80], seed=12)[0]
        assert tokens_of(trusted.generate(prompt, 4, "mtls")) == hf_greedy(hf, prompt, 4)
        assert trusted.stats.remote_prefills_completed == 1

        assert not anonymous.pool.has_ready
        with pytest.raises(grpc.RpcError) as refused:
            anonymous.generate(prompt, 4, "anonymous")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert prefill.prefilled_request_ids() == {"mtls"}
        assert wait_until(trusted.pool_is_full) and wait_until(prefill.pool_is_full)
    finally:
        trusted.close()
        anonymous.close()
        prefill.close()


def _tandem_command() -> list[str]:
    script = Path(sys.executable).with_name("tandem")
    return [str(script)] if script.exists() else [sys.executable, "-m", "tandem.cli"]


class PrefillProcess:
    """`tandem serve prefill` in a child process, slow on purpose (16 prompt tokens per forward), so a
    test can kill it while it streams KV."""

    def __init__(self, model_dir: Path) -> None:
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
            str(BLOCK_SIZE),
            "--kv-cache-memory",
            "64MiB",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-num-batched-tokens",
            "16",
        ]
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        self._port: list[int] = []
        self._serving = threading.Event()
        threading.Thread(target=self._read_log, daemon=True).start()
        if not self._serving.wait(120):
            self.kill()
            raise RuntimeError("prefill process did not start:\n" + "".join(self.log))

    def _read_log(self) -> None:
        for line in self.process.stderr:
            self.log.append(line)
            match = re.search(r"prefill server serving .* on [0-9.]+:([0-9]+)", line)
            if match:
                self._port.append(int(match.group(1)))
                self._serving.set()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self._port[0]}"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)


def _start_generating(decode: RunningDecode, pool: ThreadPoolExecutor, prompts, prefix: str) -> list:
    return [pool.submit(decode.generate, prompt, 4, f"{prefix}-{i}") for i, prompt in enumerate(prompts)]


@pytest.mark.slow
def test_sigkill_mid_stream_retries_on_the_second_replica(model):
    """Eight long prompts in flight across two replicas; one is SIGKILLed while it streams KV. Every
    request still completes with the right tokens (the killed replica's prompts again, elsewhere), no
    block leaks, and decode keeps serving."""
    model_dir, hf = model
    doomed = PrefillProcess(model_dir)
    survivor = RunningPrefill(model_dir)
    decode = RunningDecode(model_dir, prefill=f"{doomed.address},{survivor.address}")
    try:
        prompts = prompts_of([600 - 7 * i for i in range(8)], seed=7)
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            futures = _start_generating(decode, pool, prompts, "kill")
            victim = decode.replica(doomed.address)
            assert wait_until(lambda: decode.stats.remote_prefills_started == len(prompts))
            assert wait_until(lambda: victim.kv_bytes_received > 0)
            assert victim.in_flight >= 1 and victim.prefills_completed == 0, "nothing was mid-stream"
            doomed.kill()
            results = [future.result(120) for future in futures]
        for prompt, responses in zip(prompts, results, strict=True):
            assert tokens_of(responses) == hf_greedy(hf, prompt, 4)
        stats = decode.stats
        assert stats.retries >= 1 and stats.attempt_failures >= 1 and stats.remote_prefills_failed == 0
        assert victim.state is ReplicaState.BACKOFF
        assert wait_until(decode.pool_is_full) and wait_until(survivor.pool_is_full)

        after = prompts_of([300], seed=8)[0]
        assert tokens_of(decode.generate(after, 3, "after-kill")) == hf_greedy(hf, after, 3)
        assert wait_until(decode.pool_is_full)
    finally:
        doomed.kill()
        decode.close()
        survivor.close()


@pytest.mark.slow
def test_sigkill_of_the_only_replica_fails_unavailable_or_falls_back(model):
    """The only prefill replica dies mid-stream with eight prompts from each of two decode replicas in
    flight: without --fallback-local each fails with UNAVAILABLE and a message naming the replica, with
    it each is prefilled locally and correct. Both decodes free every block and keep serving."""
    model_dir, hf = model
    doomed = PrefillProcess(model_dir)
    strict = RunningDecode(model_dir, prefill=doomed.address, local_prefill_threshold=32)
    lenient = RunningDecode(model_dir, prefill=doomed.address, fallback_local=True)
    try:
        prompts = prompts_of([600 - 5 * i for i in range(8)], seed=9)
        with ThreadPoolExecutor(max_workers=2 * len(prompts)) as pool:
            strict_futures = _start_generating(strict, pool, prompts, "strict")
            lenient_futures = _start_generating(lenient, pool, prompts, "lenient")
            replicas = [decode.replica(doomed.address) for decode in (strict, lenient)]
            assert wait_until(lambda: all(r.in_flight == len(prompts) for r in replicas))
            assert wait_until(lambda: strict.stats.kv_bytes_received + lenient.stats.kv_bytes_received > 0)
            assert strict.stats.remote_prefills_completed + lenient.stats.remote_prefills_completed == 0
            doomed.kill()
            for future in strict_futures:
                with pytest.raises(grpc.RpcError) as failed:
                    future.result(120)
                assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
                assert doomed.address in failed.value.details()
                assert "prefill failed on every replica tried" in failed.value.details()
            lenient_results = [future.result(120) for future in lenient_futures]
        for prompt, responses in zip(prompts, lenient_results, strict=True):
            assert tokens_of(responses) == hf_greedy(hf, prompt, 4)
        assert lenient.stats.fallbacks_local == len(prompts)
        assert strict.stats.remote_prefills_failed == len(prompts)
        for decode in (strict, lenient):
            assert wait_until(decode.pool_is_full)

        short, long = prompts_of([20, 300], seed=10)
        assert tokens_of(strict.generate(short, 3, "short-after")) == hf_greedy(hf, short, 3)
        assert tokens_of(lenient.generate(long, 3, "long-after")) == hf_greedy(hf, long, 3)
        with pytest.raises(grpc.RpcError) as refused:
            strict.generate(long, 3, "long-after")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        for decode in (strict, lenient):
            assert wait_until(decode.pool_is_full)
    finally:
        doomed.kill()
        strict.close()
        lenient.close()


@pytest.mark.slow
def test_tandem_serve_decode_with_prefill_flags(model, two_prefills):
    """The command line end to end: `tandem serve decode --prefill ... --local-prefill-threshold N`
    fingerprints its model, handshakes the prefill replica and serves long prompts through it."""
    model_dir, hf = model
    prefill = two_prefills[0]
    command = [
        *_tandem_command(),
        "serve",
        "decode",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--threads",
        "1",
        "--block-size",
        str(BLOCK_SIZE),
        "--kv-cache-memory",
        "16MiB",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--prefill",
        prefill.address,
        "--local-prefill-threshold",
        "20",
        "--prefill-timeout",
        "30",
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
        assert serving.wait(120), "decode did not start:\n" + "".join(log)
        assert any(f"disaggregated, prefill tier at {prefill.address}" in line for line in log)
        short, long = prompts_of([10, 150], seed=14)
        with grpc.insecure_channel(f"127.0.0.1:{port[0]}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            for request_id, prompt in (("cli-short", short), ("cli-long", long)):
                request = pb.GenerateRequest(
                    request_id=request_id,
                    token_ids=prompt,
                    sampling=pb.SamplingParams(temperature=0.0),
                    stopping=pb.StoppingParams(max_tokens=4, ignore_eos=True),
                )
                assert tokens_of(stub.Generate(request, timeout=60)) == hf_greedy(hf, prompt, 4)
        prefilled = prefill.prefilled_request_ids()
        assert "cli-long" in prefilled and "cli-short" not in prefilled
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, "".join(log)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    assert wait_until(prefill.pool_is_full)
