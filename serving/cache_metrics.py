"""The prefix-cache counters both tiers export, from their engine's block manager at scrape time.

One definition for both tiers, so the decode and prefill dashboards mean the same thing: tokens looked
up in the cache at admission, and tokens found there (hit rate = hits / queries).
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
