"""Serving metrics from per-request stream timings, with the definitions `vllm bench serve` uses.

For one request sent at `send_time` whose stream messages carrying tokens arrived at `chunk_times`:

- TTFT (time to first token) = first chunk time - send time;
- E2E latency = time the stream ended - send time;
- TPOT (time per output token) = (E2E - TTFT) / (output tokens - 1), for requests with > 1 token;
- ITL (inter-token latency) = the gaps between consecutive chunks (one value per gap, pooled over
  requests; a chunk carrying several tokens is one gap, as in vLLM).

Throughputs divide by the run's duration (first send to last completion, warm-up excluded). Goodput
counts only requests that met every SLO given (`ttft`, `tpot`, `e2el`, in milliseconds).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from base.errors import TandemError

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")
CDF_POINTS = 101


class MetricsError(TandemError, ValueError):
    """A goodput SLO or a trace is malformed."""


@dataclass
class RequestRecord:
    """What the client saw of one request; times in seconds on one monotonic clock."""

    index: int
    prompt_len: int
    expected_output_len: int
    send_time: float
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    end_time: float | None = None
    error: str | None = None

    def add_chunk(self, at: float, num_tokens: int) -> None:
        if num_tokens > 0:
            self.chunk_times.append(at)
            self.chunk_tokens.append(num_tokens)

    @property
    def output_len(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times) and self.end_time is not None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.send_time

    @property
    def e2el(self) -> float:
        assert self.end_time is not None
        return self.end_time - self.send_time

    @property
    def tpot(self) -> float | None:
        if self.output_len < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_len - 1)

    @property
    def itls(self) -> list[float]:
        times = self.chunk_times
        return [later - earlier for earlier, later in zip(times[:-1], times[1:], strict=True)]


def parse_goodput(items: Iterable[str]) -> dict[str, float]:
    """Parse `ttft:500 tpot:50` (milliseconds) into {'ttft': 500.0, 'tpot': 50.0}."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise MetricsError(f"goodput SLO {item!r}: use NAME:MS with NAME one of {', '.join(SLO_METRICS)}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise MetricsError(f"goodput SLO {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] <= 0:
            raise MetricsError(f"goodput SLO {item!r} must be > 0 ms")
    return slos


def summarize(values_s: Sequence[float]) -> dict[str, float | None]:
    """Mean and percentiles in milliseconds (linear interpolation, like numpy and vLLM); None when empty."""
    if not values_s:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    return {"mean": float(ms.mean()), **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}


def cdf_points(values_s: Sequence[float], points: int = CDF_POINTS) -> list[float]:
    """`points` evenly spaced quantiles in ms (0th..100th), a small stand-in for the raw samples."""
    if not values_s:
        return []
    quantiles = np.percentile(np.asarray(values_s) * 1000.0, np.linspace(0, 100, points))
    return [round(float(q), 3) for q in quantiles]


def meets_slos(record: RequestRecord, slos: Mapping[str, float]) -> bool:
    """Whether a finished request met every SLO (ms); TPOT is vacuously met by one-token outputs."""
    observed = {"ttft": record.ttft, "tpot": record.tpot, "e2el": record.e2el}
    return all(observed[name] is None or observed[name] * 1000.0 <= limit for name, limit in slos.items())


def run_duration(records: Sequence[RequestRecord]) -> float:
    """First send to last completion over all requests that ended."""
    ended = [r.end_time for r in records if r.end_time is not None]
    if not ended:
        return 0.0
    return max(ended) - min(r.send_time for r in records)


def compute_metrics(
    records: Sequence[RequestRecord], duration_s: float | None = None, slos: Mapping[str, float] | None = None
) -> dict:
    """The headline numbers of a run (the `metrics` object of a result file)."""
    duration = run_duration(records) if duration_s is None else duration_s
    if duration <= 0:
        raise MetricsError(f"run duration must be > 0 s, got {duration}")
    done = [r for r in records if r.ok]
    output_tokens = sum(r.output_len for r in done)
    prompt_tokens = sum(r.prompt_len for r in done)
    metrics: dict = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        "ttft_ms": summarize([r.ttft for r in done]),
        "tpot_ms": summarize([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": summarize([gap for r in done for gap in r.itls]),
        "e2el_ms": summarize([r.e2el for r in done]),
        "output_len_mismatches": sum(1 for r in done if r.output_len != r.expected_output_len),
    }
    if slos:
        good = sum(1 for r in done if meets_slos(r, slos))
        metrics["goodput"] = {
            "slos_ms": dict(slos),
            "good_requests": good,
            "request_goodput": good / duration,
        }
    return metrics


def distributions(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Quantile summaries of TTFT and ITL (ms), enough to draw their CDFs later."""
    done = [r for r in records if r.ok]
    return {
        "ttft_ms_quantiles": cdf_points([r.ttft for r in done]),
        "itl_ms_quantiles": cdf_points([gap for r in done for gap in r.itls]),
    }
