"""Prometheus metrics of both tiers, scraped over HTTP from real servers on a tiny model, and the
hard caps at the decode edge (max_tokens above the cap, concurrent streams per connection).

Each test computes what the counters must read from what its clients received, so a metric that
moves by the wrong amount (or not at all) fails the test.
"""

from __future__ import annotations

import asyncio
import threading
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from conftest import random_prompts, save_tiny_model
from prometheus_client import generate_latest, start_http_server
from prometheus_client.parser import text_string_to_metric_families
from tiny_tokenizer import TINY_VOCAB_SIZE

from decode_service.config import DecodeServiceConfig
from decode_service.engine_core.messages import CoreStats
from decode_service.metrics import DecodeMetrics
from decode_service.server import DecodeServer
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.model_store import model_fingerprint
from prefill_service.config import PrefillServiceConfig
from prefill_service.server import MAX_GRPC_MESSAGE_BYTES, PrefillServer
from protos.tandem.internal.v1 import prefill_pb2, prefill_pb2_grpc
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc

MAX_TOKENS_CAP = 200


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-metrics-model")
    save_tiny_model(directory, 5)
    return directory


def engine_config(max_num_seqs: int = 8) -> EngineConfig:
    return EngineConfig(
        cache=CacheConfig(block_size=8, num_blocks=128),
        max_model_len=512,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=64,
    )


class ServerThread:
    """A server (built by `factory` inside the loop) on its own event-loop thread, its registry on HTTP."""

    def __init__(self, factory) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.server = self.call(self._create(factory))
        self.port = self.call(self.server.start())
        self._httpd, _ = start_http_server(0, addr="127.0.0.1", registry=self.server.metrics.registry)
        self.metrics_url = f"http://127.0.0.1:{self._httpd.server_port}/metrics"

    @staticmethod
    async def _create(factory):
        return factory()

    def call(self, coroutine, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics by (name, sorted labels)."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            assert response.status == 200
            text = response.read().decode()
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self.call(self.server.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def value(samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture
def decode(model_dir) -> Iterator[ServerThread]:
    engine = Engine.from_pretrained(model_dir, engine_config())
    config = DecodeServiceConfig(host="127.0.0.1", port=0, max_tokens_cap=MAX_TOKENS_CAP)
    running = ServerThread(lambda: DecodeServer(engine, config))
    yield running
    running.close()


def greedy(token_ids, max_tokens=None, **stopping) -> pb.GenerateRequest:
    limits = {} if max_tokens is None else {"max_tokens": max_tokens}
    return pb.GenerateRequest(
        token_ids=list(token_ids),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingParams(ignore_eos=True, **limits, **stopping),
    )


def tokens_of(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def test_decode_metrics_move_by_what_the_clients_saw(decode):
    prompts = random_prompts(4, 3, min_len=3, max_len=20, vocab=TINY_VOCAB_SIZE)
    with grpc.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        before = decode.scrape()
        assert value(before, "tandem:generation_tokens_total") == 0
        # Three run to their length.
        runs = zip(prompts, (4, 6, 2), strict=False)
        finished = [list(stub.Generate(greedy(p, n), timeout=60)) for p, n in runs]
        # One stops on a token it generates: the first of its greedy continuation not seen before.
        continuation = tokens_of(finished[1])
        stop_at = next(i for i, t in enumerate(continuation) if t not in continuation[:i] and i > 0)
        stop_request = greedy(prompts[1], 6, stop_token_ids=[continuation[stop_at]])
        stopped = list(stub.Generate(stop_request, timeout=60))
        # One is aborted mid-stream through the Abort RPC.
        stream = stub.Generate(greedy(prompts[3], MAX_TOKENS_CAP, min_tokens=0), timeout=60)
        first = next(stream)
        assert stub.Abort(pb.AbortRequest(request_id=first.request_id)).aborted
        aborted = [first, *stream]
        # Refused before it runs: counted nowhere.
        with pytest.raises(grpc.RpcError):
            list(stub.Generate(greedy([], 3), timeout=60))
    responses = [*finished, stopped, aborted]
    samples = decode.scrape()

    assert [r[-1].finish_reason for r in responses] == [pb.LENGTH] * 3 + [pb.STOP, pb.ABORT]
    assert len(tokens_of(stopped)) == stop_at + 1
    counts = [len(tokens_of(r)) for r in responses]
    prompt_lengths = [len(p) for p in prompts[:3]] + [len(prompts[1]), len(prompts[3])]
    assert value(samples, "tandem:generation_tokens_total") == sum(counts)
    assert value(samples, "tandem:prompt_tokens_total") == sum(prompt_lengths)
    assert value(samples, "tandem:request_success_total", finished_reason="length") == 3
    assert value(samples, "tandem:request_success_total", finished_reason="stop") == 1
    assert value(samples, "tandem:request_success_total", finished_reason="abort") == 1
    assert value(samples, "tandem:time_to_first_token_seconds_count") == 5
    assert value(samples, "tandem:request_queue_time_seconds_count") == 5
    assert value(samples, "tandem:e2e_request_latency_seconds_count") == 5
    # Every token after a request's first is one inter-token gap.
    assert value(samples, "tandem:inter_token_latency_seconds_count") == sum(counts) - 5
    assert value(samples, "tandem:time_to_first_token_seconds_sum") > 0
    # Live state after everything ended: nothing running or waiting, every block back.
    assert value(samples, "tandem:num_requests_running") == 0
    assert value(samples, "tandem:num_requests_waiting") == 0
    assert value(samples, "tandem:kv_cache_usage_perc") == 0
    assert value(samples, "tandem:num_preemptions_total") == 0
    assert value(samples, "tandem:kv_transfer_bytes_total") == 0


def test_prefix_cache_counters_count_tokens_looked_up_and_found(decode):
    # Block size 8: a 21-token prompt resent with one more token finds its 2 full blocks cached.
    prompt = random_prompts(1, 9, min_len=21, max_len=21, vocab=TINY_VOCAB_SIZE)[0]
    before = decode.scrape()
    with grpc.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        first = list(stub.Generate(greedy(prompt, 2), timeout=60))
        again = list(stub.Generate(greedy(prompt + [5], 2), timeout=60))
    samples = decode.scrape()
    queries = value(samples, "tandem:prefix_cache_queries_total") - value(
        before, "tandem:prefix_cache_queries_total"
    )
    hits = value(samples, "tandem:prefix_cache_hits_total") - value(before, "tandem:prefix_cache_hits_total")
    assert (queries, hits) == (21 + 22, 16)
    assert (first[-1].usage.cached_tokens, again[-1].usage.cached_tokens) == (0, 16)
    assert value(samples, "tandem:kv_cache_usage_perc") == 0, "cached blocks count as free"


def test_gauges_read_live_state_at_scrape_time(decode):
    with grpc.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        stream = stub.Generate(greedy(list(range(1, 30)), MAX_TOKENS_CAP), timeout=60)
        next(stream)
        samples = decode.scrape()
        stream.cancel()
    assert value(samples, "tandem:num_requests_running") == 1
    assert value(samples, "tandem:kv_cache_usage_perc") > 0


def test_the_core_counters_are_exported_as_read_at_scrape_time():
    stats = CoreStats(
        num_running=3,
        num_waiting=4,
        kv_usage=0.5,
        num_preemptions=6,
        prefix_cache_queries=100,
        prefix_cache_hits=40,
        kv_transfer_bytes=123456,
        remote_prefills_completed=5,
        kv_transfer_seconds=0.75,
        kv_blocks_skipped=7,
        kv_transfer_failures=3,
        local_prefills=2,
        remote_prefills_failed=1,
        prefill_retries=2,
        prefill_local_fallbacks=1,
    )
    metrics = DecodeMetrics(lambda: stats)

    def scrape():
        text = generate_latest(metrics.registry).decode()
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    samples = scrape()
    assert value(samples, "tandem:num_requests_running") == 3
    assert value(samples, "tandem:num_requests_waiting") == 4
    assert value(samples, "tandem:kv_cache_usage_perc") == 0.5
    assert value(samples, "tandem:num_preemptions_total") == 6
    assert value(samples, "tandem:prefix_cache_queries_total") == 100
    assert value(samples, "tandem:prefix_cache_hits_total") == 40
    assert value(samples, "tandem:kv_transfer_bytes_total") == 123456
    assert value(samples, "tandem:kv_transfer_failures_total") == 3
    assert value(samples, "tandem:kv_transfer_seconds_count") == 5
    assert value(samples, "tandem:kv_transfer_seconds_sum") == 0.75
    assert value(samples, "tandem:prefills_total", outcome="remote") == 5
    assert value(samples, "tandem:prefills_total", outcome="local") == 2
    assert value(samples, "tandem:prefills_total", outcome="remote_failed") == 1
    assert value(samples, "tandem:prefill_retries_total") == 2
    assert value(samples, "tandem:prefill_local_fallbacks_total") == 1
    assert value(samples, "tandem:kv_transfer_blocks_skipped_total") == 7
    stats.kv_transfer_bytes += 1000
    assert value(scrape(), "tandem:kv_transfer_bytes_total") == 124456


def test_two_servers_in_one_process_keep_separate_registries(decode, model_dir):
    engine = Engine.from_pretrained(model_dir, engine_config())
    other = ServerThread(lambda: DecodeServer(engine, DecodeServiceConfig(host="127.0.0.1", port=0)))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{other.port}") as channel:
            list(generation_pb2_grpc.GenerationStub(channel).Generate(greedy([1, 2, 3], 3), timeout=60))
        assert value(other.scrape(), "tandem:generation_tokens_total") == 3
        assert value(decode.scrape(), "tandem:generation_tokens_total") == 0
    finally:
        other.close()


def test_max_tokens_above_the_cap_is_rejected_not_clipped(decode):
    with grpc.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(greedy([1, 2, 3], MAX_TOKENS_CAP + 1), timeout=60))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert str(MAX_TOKENS_CAP) in refused.value.details()
        at_cap = list(stub.Generate(greedy([1, 2, 3], MAX_TOKENS_CAP), timeout=60))
        unset = list(stub.Generate(greedy([1, 2, 3]), timeout=60))
    assert len(tokens_of(at_cap)) == MAX_TOKENS_CAP
    assert len(tokens_of(unset)) == MAX_TOKENS_CAP


def test_concurrent_streams_per_connection_are_capped(model_dir):
    """With a cap of 2, three calls on one connection never run three at once on the server.

    Asserted on what the server decided, step by step: how many of the calls each step's batch held.
    Long answers (200 tokens) make the first two overlap however slowly a busy machine sends them."""
    engine = Engine.from_pretrained(model_dir, engine_config())
    config = DecodeServiceConfig(host="127.0.0.1", port=0)
    running = ServerThread(lambda: DecodeServer(engine, config, max_concurrent_streams=2))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            list(stub.Generate(greedy([1], 1), timeout=60))  # the connection now knows the server's limit
            calls = [stub.Generate(greedy([i + 1, i + 2], 200, min_tokens=0), timeout=120) for i in range(3)]
            results = [list(call) for call in calls]
        records = running.server.events.snapshot()
        ids = {r[0].request_id for r in results}
        together = [len(ids & set(rec.request_ids)) for rec in records]
        assert max(together) == 2, together
        assert all(len(tokens_of(r)) == 200 for r in results)
    finally:
        running.close()


@pytest.fixture
def prefill(model_dir) -> Iterator[ServerThread]:
    engine = Engine.from_pretrained(model_dir, engine_config())
    config = PrefillServiceConfig(host="127.0.0.1", port=0)
    running = ServerThread(lambda: PrefillServer(engine, model_fingerprint(model_dir), config))
    yield running
    running.close()


def test_prefill_metrics_count_prompts_bytes_and_outcomes(prefill):
    prompts = random_prompts(2, 8, min_len=10, max_len=40, vocab=TINY_VOCAB_SIZE)
    options = [("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES)]
    with grpc.insecure_channel(f"127.0.0.1:{prefill.port}", options=options) as channel:
        stub = prefill_pb2_grpc.PrefillStub(channel)
        own_hash = stub.GetInfo(prefill_pb2.GetInfoRequest()).compatibility_hash
        payload = 0
        for i, prompt in enumerate(prompts):
            request = prefill_pb2.PrefillRequest(
                request_id=f"p{i}",
                prompt_token_ids=prompt,
                compatibility_hash=own_hash,
                sampling=pb.SamplingParams(temperature=0.0),
            )
            responses = list(stub.Prefill(request, timeout=60))
            assert responses[-1].WhichOneof("kind") == "done"
            payload += sum(len(r.kv.payload) for r in responses if r.WhichOneof("kind") == "kv")
        with pytest.raises(grpc.RpcError):
            list(
                stub.Prefill(
                    prefill_pb2.PrefillRequest(
                        request_id="bad", prompt_token_ids=[1], compatibility_hash="nope"
                    ),
                    timeout=60,
                )
            )
    samples = prefill.scrape()
    assert value(samples, "tandem:prompt_tokens_total") == sum(len(p) for p in prompts)
    assert value(samples, "tandem:kv_transfer_bytes_total") == payload > 0
    assert value(samples, "tandem:prefill_requests_total", outcome="finished") == 2
    assert value(samples, "tandem:prefill_requests_total", outcome="refused") == 1
    assert value(samples, "tandem:prefill_requests_total", outcome="failed") == 0
    assert value(samples, "tandem:request_queue_time_seconds_count") == 2
    assert value(samples, "tandem:request_prefill_time_seconds_count") == 2
    assert value(samples, "tandem:prefill_queue_depth") == 0
    assert value(samples, "tandem:num_requests_running") == 0
