"""The benchmark's metric math on hand-made traces whose answers are known."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.metrics import (
    MetricsError,
    RequestRecord,
    cdf_points,
    compute_metrics,
    distributions,
    parse_goodput,
    run_duration,
    summarize,
)


def record(index, send, chunks, end=None, prompt_len=10, expected=None, error=None) -> RequestRecord:
    """A request sent at `send` whose token-carrying messages arrived as (time, num_tokens) pairs."""
    expected = expected if expected is not None else sum(n for _, n in chunks)
    rec = RequestRecord(index, prompt_len, expected, send)
    for at, num_tokens in chunks:
        rec.add_chunk(at, num_tokens)
    rec.end_time = end if end is not None else (chunks[-1][0] if chunks else send)
    rec.error = error
    return rec


# Request 0: sent at 0, tokens at 1.0, 1.5, 2.5 -> TTFT 1.0, ITLs 0.5 and 1.0, E2E 2.5, TPOT 0.75.
# Request 1: sent at 1, 2 tokens in one message at 1.2, then 1 token at 1.4 -> TTFT 0.2, ITL 0.2,
#            E2E 0.4, 3 tokens so TPOT 0.1.
# Request 2: failed.
TRACE = [
    record(0, 0.0, [(1.0, 1), (1.5, 1), (2.5, 1)]),
    record(1, 1.0, [(1.2, 2), (1.4, 1)], prompt_len=20),
    record(2, 0.5, [], end=0.6, error="Unavailable: down"),
]


def test_per_request_definitions():
    first, second, _ = TRACE
    assert first.ttft == pytest.approx(1.0)
    assert first.itls == pytest.approx([0.5, 1.0])
    assert first.e2el == pytest.approx(2.5)
    assert first.tpot == pytest.approx(0.75)
    assert second.output_len == 3
    assert second.ttft == pytest.approx(0.2)
    assert second.itls == pytest.approx([0.2])
    assert second.tpot == pytest.approx(0.1)
    assert record(5, 0.0, [(0.3, 1)]).tpot is None


def test_run_metrics_on_the_trace():
    metrics = compute_metrics(TRACE)
    assert run_duration(TRACE) == pytest.approx(2.5)
    assert metrics["completed"] == 2 and metrics["failed"] == 1
    assert metrics["duration_s"] == pytest.approx(2.5)
    assert metrics["total_output_tokens"] == 6
    assert metrics["total_prompt_tokens"] == 30
    assert metrics["request_throughput"] == pytest.approx(2 / 2.5)
    assert metrics["output_throughput"] == pytest.approx(6 / 2.5)
    assert metrics["total_token_throughput"] == pytest.approx(36 / 2.5)
    assert metrics["ttft_ms"]["mean"] == pytest.approx(600.0)
    assert metrics["ttft_ms"]["p50"] == pytest.approx(600.0)
    assert metrics["tpot_ms"]["mean"] == pytest.approx(425.0)
    # Pooled ITLs 200, 500, 1000 ms: median 500, p90 by linear interpolation 500 + 0.8 * 500 = 900.
    assert metrics["itl_ms"]["p50"] == pytest.approx(500.0)
    assert metrics["itl_ms"]["p90"] == pytest.approx(900.0)
    assert metrics["e2el_ms"]["p99"] == pytest.approx(400 + 0.99 * 2100)
    assert metrics["output_len_mismatches"] == 0
    assert "goodput" not in metrics


def test_explicit_duration_wins():
    assert compute_metrics(TRACE, duration_s=10.0)["output_throughput"] == pytest.approx(0.6)


@pytest.mark.parametrize(
    ("slos", "good"),
    [
        ({"ttft": 1000.0}, 2),  # request 0's TTFT is exactly the limit: met
        ({"ttft": 999.0}, 1),
        ({"tpot": 100.0}, 1),
        ({"ttft": 1000.0, "tpot": 800.0, "e2el": 2000.0}, 1),  # request 0 misses E2E
        ({"e2el": 300.0}, 0),
    ],
)
def test_goodput_counts_requests_meeting_every_slo(slos, good):
    goodput = compute_metrics(TRACE, slos=slos)["goodput"]
    assert goodput["good_requests"] == good
    assert goodput["request_goodput"] == pytest.approx(good / 2.5)
    assert goodput["slos_ms"] == slos


def test_one_token_outputs_meet_any_tpot_slo():
    one = [record(0, 0.0, [(0.1, 1)])]
    assert compute_metrics(one, slos={"tpot": 1.0})["goodput"]["good_requests"] == 1


def test_short_outputs_are_counted_as_mismatches():
    short = [record(0, 0.0, [(0.1, 1), (0.2, 1)], expected=5)]
    assert compute_metrics(short)["output_len_mismatches"] == 1


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    for bad in (["ttft"], ["itl:5"], ["ttft:abc"], ["tpot:0"]):
        with pytest.raises(MetricsError):
            parse_goodput(bad)


def test_empty_inputs():
    assert summarize([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert cdf_points([]) == []
    with pytest.raises(MetricsError):
        compute_metrics([record(0, 0.0, [], end=0.0, error="x")])


def test_percentiles_of_0_to_100():
    stats = summarize([i / 1000 for i in range(101)])
    assert stats == pytest.approx({"mean": 50.0, "p50": 50.0, "p90": 90.0, "p99": 99.0})


@given(st.lists(st.floats(min_value=0.0, max_value=100.0), min_size=1, max_size=50))
def test_summary_and_cdf_are_ordered(values):
    stats = summarize(values)
    eps = 1e-9
    assert min(values) * 1000 - eps <= stats["p50"] <= stats["p90"] + eps <= stats["p99"] + 2 * eps
    assert stats["p99"] <= max(values) * 1000 + eps
    cdf = cdf_points(values)
    assert len(cdf) == 101
    assert cdf == sorted(cdf)


def test_distributions_hold_quantiles_of_ttft_and_itl():
    dist = distributions(TRACE)
    assert dist["ttft_ms_quantiles"][0] == pytest.approx(200.0)
    assert dist["ttft_ms_quantiles"][-1] == pytest.approx(1000.0)
    assert dist["itl_ms_quantiles"][50] == pytest.approx(500.0)
