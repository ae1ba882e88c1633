"""Prometheus metrics of the prefill tier (`tandem:` prefix, vLLM's names where one exists).

Per-call series (queue and prefill time, prompt tokens, KV bytes sent, how each call ended) are
recorded by the servicer when a call ends, from the counts it already keeps for its log line. Live
state (queue depth, prompts in progress, pool usage) is read at scrape time by a custom collector,
so it is never stale. `tandem:prefill_queue_depth` is the signal to autoscale the prefill tier on.

Each server has its own `CollectorRegistry` (several servers in one test process do not collide);
`tandem serve prefill --metrics-port` serves it over HTTP at `/metrics`. Labels are bounded: only the
call's `outcome`, never request ids.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.engine import Engine
from prefill_service.scheduler import ChunkedPrefillScheduler
from serving.cache_metrics import kv_event_metrics, prefix_cache_metrics

PREFIX = "tandem:"
OUTCOMES = ("finished", "failed", "cancelled", "refused")

QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PREFILL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _LiveStateCollector(Collector):
    """Queue depth, prompts in progress and pool usage, read from the engine thread's state at scrape.

    `len()` of the scheduler's deque and list is atomic under the GIL, so no lock is taken.
    """

    def __init__(self, scheduler: ChunkedPrefillScheduler, engine: Engine) -> None:
        self._scheduler = scheduler
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            f"{PREFIX}prefill_queue_depth",
            "Prompts waiting for admission (their blocks not yet reserved).",
            value=len(self._scheduler.waiting),
        )
        yield GaugeMetricFamily(
            f"{PREFIX}num_requests_running",
            "Prompts admitted and being prefilled.",
            value=len(self._scheduler.running),
        )
        yield GaugeMetricFamily(
            f"{PREFIX}kv_cache_usage_perc",
            "Fraction of the prefill KV pool in use (0 to 1), including computed KV not yet sent.",
            value=self._engine.kv_usage,
        )
        blocks = self._engine.block_manager
        yield from prefix_cache_metrics(blocks.num_queried_tokens, blocks.num_hit_tokens)
        publisher = self._engine.kv_events
        if publisher is None:
            yield from kv_event_metrics(0, 0)
        else:
            yield from kv_event_metrics(publisher.num_published, publisher.num_dropped)


class PrefillMetrics:
    """The prefill tier's metrics in their own registry; the `call_*` methods run on the event loop."""

    def __init__(
        self, scheduler: ChunkedPrefillScheduler, engine: Engine, registry: CollectorRegistry | None = None
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.request_queue_time = Histogram(
            f"{PREFIX}request_queue_time_seconds",
            "From the Prefill call's arrival to its admission.",
            buckets=QUEUE_BUCKETS,
            registry=self.registry,
        )
        self.request_prefill_time = Histogram(
            f"{PREFIX}request_prefill_time_seconds",
            "From a prompt's first chunk to its first token.",
            buckets=PREFILL_BUCKETS,
            registry=self.registry,
        )
        self.kv_transfer_seconds = Histogram(
            f"{PREFIX}kv_transfer_seconds",
            "From the Prefill call's arrival to its last message sent.",
            buckets=PREFILL_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}prompt_tokens", "Prompt tokens prefilled and sent.", registry=self.registry
        )
        self.kv_transfer_bytes = Counter(
            f"{PREFIX}kv_transfer_bytes",
            "KV cache payload bytes sent to the decode tier.",
            registry=self.registry,
        )
        self.kv_transfer_failures = Counter(
            f"{PREFIX}kv_transfer_failures",
            "Prefill calls that failed after being accepted.",
            registry=self.registry,
        )
        self.requests = Counter(
            f"{PREFIX}prefill_requests",
            "Prefill calls, by how they ended.",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.registry.register(_LiveStateCollector(scheduler, engine))

    def call_finished(
        self,
        prompt_tokens: int,
        kv_bytes: int,
        queue_seconds: float,
        prefill_seconds: float,
        total_seconds: float,
    ) -> None:
        self.requests.labels("finished").inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.kv_transfer_bytes.inc(kv_bytes)
        self.request_queue_time.observe(queue_seconds)
        self.request_prefill_time.observe(prefill_seconds)
        self.kv_transfer_seconds.observe(total_seconds)

    def call_failed(self, kv_bytes: int) -> None:
        self.requests.labels("failed").inc()
        self.kv_transfer_bytes.inc(kv_bytes)
        self.kv_transfer_failures.inc()

    def call_cancelled(self, kv_bytes: int) -> None:
        """The caller went away (cancelled, deadline, connection lost): not the prefill tier's failure."""
        self.requests.labels("cancelled").inc()
        self.kv_transfer_bytes.inc(kv_bytes)

    def call_refused(self) -> None:
        self.requests.labels("refused").inc()
