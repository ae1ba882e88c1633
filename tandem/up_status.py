"""The live status line of `tandem up`: requests, KV usage and tok/s, read from the tiers' /metrics."""

from __future__ import annotations

import time
import urllib.request


class StatusLine:
    """A live one-line status (requests, KV usage, tok/s) read from the decode replicas' /metrics each tick.

    tok/s is the growth of `tandem:generation_tokens_total` between two scrapes over the time between them;
    requests and tokens are summed over the replicas, KV usage averaged.
    """

    def __init__(self, metrics_urls: list[str], prefill_metrics_url: str | None) -> None:
        from rich.console import Console
        from rich.live import Live

        self._urls = metrics_urls
        self._prefill_url = prefill_metrics_url
        self._console = Console(stderr=True)
        self._live = Live("starting…", console=self._console, refresh_per_second=4, transient=True)
        self._last: tuple[float, float] | None = None

    def print_line(self, line: str) -> None:
        """Print a log line above the status line, unwrapped and uncoloured, as it came."""
        self._console.print(line.rstrip("\n"), markup=False, highlight=False, soft_wrap=True)

    def __enter__(self) -> StatusLine:
        self._live.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._live.__exit__(None, None, None)

    def refresh(self) -> None:
        decode = merge_replicas([scrape(url) for url in self._urls])
        self._live.update(self.render(decode, scrape(self._prefill_url) if self._prefill_url else {}))

    def render(self, decode: dict[str, float], prefill: dict[str, float]) -> str:
        if not decode:
            return "decode metrics unavailable"
        now, tokens = time.monotonic(), decode.get("tandem:generation_tokens_total", 0.0)
        rate = 0.0
        if self._last is not None and now > self._last[0]:
            rate = max(0.0, tokens - self._last[1]) / (now - self._last[0])
        self._last = (now, tokens)
        parts = [
            f"running {decode.get('tandem:num_requests_running', 0):.0f}",
            f"waiting {decode.get('tandem:num_requests_waiting', 0):.0f}",
            f"KV {100 * decode.get('tandem:kv_cache_usage_perc', 0):.1f}%",
            f"{rate:.1f} tok/s",
        ]
        if "tandem:prefill_queue_depth" in prefill:
            parts.append(f"prefill queue {prefill['tandem:prefill_queue_depth']:.0f}")
        return " | ".join(parts)


def merge_replicas(replicas: list[dict[str, float]]) -> dict[str, float]:
    """One view of several decode replicas' samples: sums, except KV usage, a fraction, averaged; {}
    while any replica cannot be read (a partial sum would look like a drop)."""
    if not replicas or not all(replicas):
        return {}
    merged: dict[str, float] = {}
    for samples in replicas:
        for name, value in samples.items():
            merged[name] = merged.get(name, 0.0) + value
    if "tandem:kv_cache_usage_perc" in merged:
        merged["tandem:kv_cache_usage_perc"] /= len(replicas)
    return merged


def scrape(url: str, timeout: float = 0.5) -> dict[str, float]:
    """Unlabelled samples of a /metrics page by name; {} when it cannot be read right now."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            text = response.read().decode()
    except OSError:
        return {}
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }
