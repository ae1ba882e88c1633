"""Prometheus metrics of the decode tier, under the names vLLM users already chart (`tandem:` prefix).

Two sources, each read where it is cheapest and exact:

- Per-token and per-request series (TTFT, inter-token latency, end-to-end and queue time, token
  counters, finish reasons) are observed from the deltas of each step, through `observe(deltas)`: on
  the engine thread before the deltas are grouped for streaming, or as an engine-core process's step
  message arrives. Every delta passes there, including the final ABORT of a request whose client left,
  so nothing is missed or counted twice.
- Live state (running/waiting requests, KV usage, preemptions, KV-transfer and KV-event counters) is
  read at scrape time from the engine core's `CoreStats`, so the gauges are never stale and the engine
  pays nothing (a core in its own process sends its counters with each step).
- Structured outputs: grammar compile seconds (each miss of the engine core's grammar cache, timed by
  its compiler) and grammar mask seconds per engine step (fill + apply, timed by the engine only on
  steps that mask a row), both through observer callbacks that the core's step messages carry, so
  unconstrained traffic pays nothing.

Each server has its own `CollectorRegistry`, so several servers in one process (tests, benchmarks)
do not collide; `tandem serve decode --metrics-port` serves that registry over HTTP at `/metrics`, and
so does the OpenAI HTTP port, where the Gateway API Inference Extension's endpoint picker scrapes a pool's
target port: for it the registry also carries the gateway protocol's gauges in vLLM's names.
Labels are small and bounded (`finished_reason`, prefill `outcome`), never request ids or tenants.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from decode_service.engine_core.messages import CoreStats, Delta, Submit
from engine.sequence import FinishReason
from serving.cache_metrics import kv_event_metrics, prefix_cache_metrics

PREFIX = "tandem:"

# Seconds; a CPU replica of a small model sits in the middle, a busy GPU one at the low end.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0)
INTER_TOKEN_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# A JSON schema compiles in milliseconds to seconds; the compile timeout defaults to 10 s.
GRAMMAR_COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Masking one step costs tens of microseconds per constrained row; a step is a few to tens of ms.
GRAMMAR_FILL_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


class _LiveStateCollector(Collector):
    """Gauges and counters of the engine core's live state, read at scrape time from `stats()`: the
    core's counters themselves in process (each an atomic read under the GIL, no lock), or the latest
    ones an engine-core process sent with its last step."""

    def __init__(self, stats: Callable[[], CoreStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        yield GaugeMetricFamily(
            f"{PREFIX}num_requests_running",
            "Requests holding KV blocks: in the decode batch or being prefilled.",
            value=stats.num_running,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}num_requests_waiting",
            "Requests queued for admission (holding no blocks).",
            value=stats.num_waiting,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}kv_cache_usage_perc",
            "Fraction of the KV block pool in use (0 to 1).",
            value=stats.kv_usage,
        )
        yield CounterMetricFamily(
            f"{PREFIX}num_preemptions",
            "Preemptions: requests whose blocks were freed to make room.",
            value=stats.num_preemptions,
        )
        yield from prefix_cache_metrics(stats.prefix_cache_queries, stats.prefix_cache_hits)
        yield from kv_event_metrics(stats.kv_events_published, stats.kv_events_dropped)
        yield from _transfer_metrics(stats)
        yield from _speculation_metrics(stats)


@dataclass(frozen=True)
class ServedCache:
    """What the gateway's prefix scorer reads about this replica's KV pool, and the model it serves."""

    model_name: str
    block_size: int
    num_blocks: int


class _GatewayCollector(Collector):
    """The Gateway API Inference Extension's model-server protocol, in vLLM's names (what its endpoint
    picker scrapes by default): queued and running requests and KV usage as gauges, the block size and
    pool size as labels of `vllm:cache_config_info`, and `vllm:lora_requests_info` saying no adapter
    can be loaded (tandem serves none). Read at scrape time like the `tandem:` gauges."""

    def __init__(self, stats: Callable[[], CoreStats], cache: ServedCache) -> None:
        self._stats = stats
        self._cache = cache

    def collect(self) -> Iterator[Metric]:
        stats, cache = self._stats(), self._cache
        model = [cache.model_name]
        for name, documentation, value in (
            ("vllm:num_requests_waiting", "Requests queued for admission.", stats.num_waiting),
            (
                "vllm:num_requests_running",
                "Requests holding KV blocks (decoding or prefilling).",
                stats.num_running,
            ),
            ("vllm:kv_cache_usage_perc", "Fraction of the KV block pool in use (1 = 100%).", stats.kv_usage),
        ):
            gauge = GaugeMetricFamily(name, documentation, labels=["model_name"])
            gauge.add_metric(model, value)
            yield gauge
        config = GaugeMetricFamily(
            "vllm:cache_config_info",
            "The KV cache's configuration, in labels (block_size in tokens, num_gpu_blocks in the pool).",
            labels=["model_name", "block_size", "num_gpu_blocks"],
        )
        config.add_metric([*model, str(cache.block_size), str(cache.num_blocks)], 1.0)
        yield config
        lora = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "LoRA adapters: none can be loaded (max_lora 0); the value is the time of this reading.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        lora.add_metric(["0", "", ""], time.time())
        yield lora


def _speculation_metrics(stats: CoreStats) -> Iterator[Metric]:
    """Speculative decoding, in vLLM's names so its dashboards read them; all zero without --speculative."""
    yield CounterMetricFamily(
        "vllm:spec_decode_num_drafts",
        "Drafts verified (one per sequence and step).",
        value=stats.spec_num_drafts,
    )
    yield CounterMetricFamily(
        "vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", value=stats.spec_num_draft_tokens
    )
    yield CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens",
        "Draft tokens accepted (kept in the output).",
        value=stats.spec_num_accepted_tokens,
    )
    per_position = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted at each position of the draft (0: the first).",
        labels=["position"],
    )
    for position, accepted in enumerate(stats.spec_accepted_per_position):
        per_position.add_metric([str(position)], accepted)
    yield per_position


def _transfer_metrics(stats: CoreStats) -> Iterator[Metric]:
    """KV transfer from the prefill tier; all zero in aggregated mode."""
    yield CounterMetricFamily(
        f"{PREFIX}kv_transfer_bytes",
        "KV cache bytes received from the prefill tier.",
        value=stats.kv_transfer_bytes,
    )
    yield SummaryMetricFamily(
        f"{PREFIX}kv_transfer_seconds",
        "Remote prefills completed, and their total seconds from the Prefill call to the last KV block.",
        count_value=stats.remote_prefills_completed,
        sum_value=stats.kv_transfer_seconds,
    )
    yield CounterMetricFamily(
        f"{PREFIX}kv_transfer_blocks_skipped",
        "KV blocks not transferred because this replica's prefix cache already held them.",
        value=stats.kv_blocks_skipped,
    )
    yield CounterMetricFamily(
        f"{PREFIX}kv_transfer_failures",
        "Prefill calls whose KV transfer failed (each attempt counts).",
        value=stats.kv_transfer_failures,
    )
    outcomes = CounterMetricFamily(
        f"{PREFIX}prefills",
        "Prompts prefilled, by where: remote, local, or remote given up.",
        labels=["outcome"],
    )
    outcomes.add_metric(["remote"], stats.remote_prefills_completed)
    outcomes.add_metric(["local"], stats.local_prefills)
    outcomes.add_metric(["remote_failed"], stats.remote_prefills_failed)
    yield outcomes
    yield CounterMetricFamily(
        f"{PREFIX}prefill_retries",
        "Prefill calls retried on another replica.",
        value=stats.prefill_retries,
    )
    yield CounterMetricFamily(
        f"{PREFIX}prefill_local_fallbacks",
        "Prompts prefilled here because no prefill replica could.",
        value=stats.prefill_local_fallbacks,
    )


class DecodeMetrics:
    """The decode tier's metrics over one scheduler and engine, in their own registry.

    `observe(deltas)` must be called from one thread only (the engine thread, or the event loop): it
    keeps each live request's last token time to measure inter-token latency without a lock.
    """

    def __init__(
        self,
        stats: Callable[[], CoreStats],
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
        cache: ServedCache | None = None,
    ) -> None:
        """`cache`: the served model and its KV pool, for the gateway protocol's metrics (None: not
        exported)."""
        self.registry = registry if registry is not None else CollectorRegistry()
        self._clock = clock
        # By (submission, choice index): when each live choice's latest token arrived.
        self._last_token_time: dict[tuple[int, int], float] = {}
        self.time_to_first_token = Histogram(
            f"{PREFIX}time_to_first_token_seconds",
            "From the request's arrival to its first token.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            f"{PREFIX}inter_token_latency_seconds",
            "Between consecutive tokens of one request.",
            buckets=INTER_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.e2e_request_latency = Histogram(
            f"{PREFIX}e2e_request_latency_seconds",
            "From the request's arrival to its last message.",
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.request_queue_time = Histogram(
            f"{PREFIX}request_queue_time_seconds",
            "From the request's arrival to its admission.",
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}prompt_tokens",
            "Prompt tokens of requests that got their first token.",
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            f"{PREFIX}generation_tokens", "Tokens generated and streamed.", registry=self.registry
        )
        self.request_success = Counter(
            f"{PREFIX}request_success",
            "Requests that ended, by finish reason.",
            ["finished_reason"],
            registry=self.registry,
        )
        self.request_errors = Counter(
            f"{PREFIX}request_errors",
            "Requests that ended with a server error (a failed step).",
            registry=self.registry,
        )
        for reason in FinishReason:
            self.request_success.labels(reason.value)
        self.structured_output_requests = Counter(
            f"{PREFIX}structured_output_requests",
            "Grammar-constrained requests (schema, regex, choice, tool call) that got their first token.",
            registry=self.registry,
        )
        self.structured_output_compile_seconds = Histogram(
            f"{PREFIX}structured_output_compile_seconds",
            "Grammar compiles in the engine core (constraints not in its compiled-grammar cache; each is "
            "compiled once), in seconds.",
            buckets=GRAMMAR_COMPILE_BUCKETS,
            registry=self.registry,
        )
        self.structured_output_fill_seconds = Histogram(
            f"{PREFIX}structured_output_fill_seconds",
            "Per engine step that masks any row: seconds spent filling its constrained rows' grammar masks.",
            buckets=GRAMMAR_FILL_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_LiveStateCollector(stats))
        if cache is not None:
            self.registry.register(_GatewayCollector(stats, cache))

    def observe(self, deltas: list[Delta], request_of: Callable[[int], Submit | None]) -> None:
        """Account for one step's deltas: new tokens, first tokens, finished requests; `request_of` finds
        a delta's request by its submission number (None: its stream is gone, so its tokens are not
        streamed, and not counted)."""
        now = self._clock()
        num_tokens = 0
        for delta in deltas:
            request = request_of(delta.submission)
            if request is None:
                continue
            if delta.token_ids:
                num_tokens += len(delta.token_ids)
                self._observe_tokens(request, delta, now)
            if delta.finish_reason is not None or delta.error is not None:
                self._observe_end(request, delta, now)
        # One increment per step: each takes the counter's lock.
        if num_tokens:
            self.generation_tokens.inc(num_tokens)

    def _observe_tokens(self, request: Submit, delta: Delta, now: float) -> None:
        key = (delta.submission, delta.index)
        previous = self._last_token_time.get(key)
        if previous is None:
            state = delta.state
            arrival = request.arrival_time if request.arrival_time is not None else now
            first_token = state.first_token_time if state is not None else None
            self.time_to_first_token.observe(max(0.0, (first_token or now) - arrival))
            if state is not None and state.admitted_time is not None:
                self.request_queue_time.observe(max(0.0, state.admitted_time - arrival))
            self.prompt_tokens.inc(len(request.prompt_token_ids))
            if request.grammar is not None:
                self.structured_output_requests.inc()
        else:
            self.inter_token_latency.observe(max(0.0, now - previous))
        self._last_token_time[key] = now

    def _observe_end(self, request: Submit, delta: Delta, now: float) -> None:
        self._last_token_time.pop((delta.submission, delta.index), None)
        if delta.error is not None:
            self.request_errors.inc()
            return
        if delta.finish_reason is not None:
            self.request_success.labels(delta.finish_reason).inc()
        if request.arrival_time is not None:
            self.e2e_request_latency.observe(max(0.0, now - request.arrival_time))
