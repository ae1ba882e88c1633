"""The prefix-cache counters both tiers export, from their engine's block manager at scrape time.

One definition for both tiers, so the decode and prefill dashboards mean the same thing: tokens looked
up in the cache at admission, and tokens found there (hit rate = hits / queries); and the KV event
batches their publisher sent and dropped (`engine.kv_event_publisher`).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric

PREFIX = "tandem:"


def prefix_cache_metrics(queried_tokens: int, hit_tokens: int) -> Iterator[Metric]:
    """`prefix_cache_queries_total` and `prefix_cache_hits_total`, in tokens."""
    yield CounterMetricFamily(
        f"{PREFIX}prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache at admission (0 with caching off).",
        value=queried_tokens,
    )
    yield CounterMetricFamily(
        f"{PREFIX}prefix_cache_hits",
        "Prompt tokens found in the prefix cache at admission, so not computed again.",
        value=hit_tokens,
    )


def kv_event_metrics(published: int, dropped: int) -> Iterator[Metric]:
    """`kv_events_published_total` and `kv_events_dropped_total`, in batches (0 with KV events off)."""
    yield CounterMetricFamily(
        f"{PREFIX}kv_events_published",
        "KV event batches sent to subscribers (--kv-events-config).",
        value=published,
    )
    yield CounterMetricFamily(
        f"{PREFIX}kv_events_dropped",
        "KV event batches dropped because the publisher's queue was full (subscribers see the gap).",
        value=dropped,
    )
