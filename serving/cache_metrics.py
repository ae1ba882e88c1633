"""The prefix-cache counters both tiers export, read from their engine's block manager at scrape time.

One definition for both tiers, so the decode and prefill dashboards mean the same thing: tokens looked
up in the cache at admission, and tokens found there (hit rate = hits / queries).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric

from engine.engine import Engine

PREFIX = "tandem:"


def prefix_cache_metrics(engine: Engine) -> Iterator[Metric]:
    """`prefix_cache_queries_total` and `prefix_cache_hits_total`, in tokens (plain int reads: no lock)."""
    block_manager = engine.block_manager
    yield CounterMetricFamily(
        f"{PREFIX}prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache at admission (0 with caching off).",
        value=block_manager.num_queried_tokens,
    )
    yield CounterMetricFamily(
        f"{PREFIX}prefix_cache_hits",
        "Prompt tokens found in the prefix cache at admission, so not computed again.",
        value=block_manager.num_hit_tokens,
    )
