"""The benchmark's workload generator: seeded determinism, the length distributions, JSONL input and the
arrival processes."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest

from bench.workload import (
    ArrivalProcess,
    LengthDistribution,
    SyntheticWorkload,
    WorkloadError,
    load_jsonl,
    workload_summary,
)


def spec(seed=0, num=200, prompt="uniform:60:330", output="uniform:16:256") -> SyntheticWorkload:
    lengths = LengthDistribution.parse(prompt), LengthDistribution.parse(output)
    return SyntheticWorkload(num, *lengths, vocab_size=49152, seed=seed)


def test_same_seed_same_requests_other_seed_other_requests():
    assert spec(7).requests() == spec(7).requests()
    assert spec(7).requests() != spec(8).requests()


def test_synthetic_prompts_respect_lengths_and_token_range():
    requests = spec().requests()
    assert [r.index for r in requests] == list(range(200))
    for request in requests:
        assert 60 <= request.prompt_len <= 330
        assert 16 <= request.output_len <= 256
        assert all(100 <= t < 49152 for t in request.prompt_token_ids)
    summary = workload_summary(requests)
    assert summary["output_tokens"] == sum(r.output_len for r in requests)
    assert summary["prompt_len_min"] >= 60 and summary["prompt_len_max"] <= 330


def test_fixed_distribution():
    rng = random.Random(0)
    assert {LengthDistribution.parse("fixed:32").sample(rng) for _ in range(20)} == {32}


def test_uniform_distribution_covers_its_range_evenly():
    rng = random.Random(1)
    dist = LengthDistribution.parse("uniform:1:4")
    samples = [dist.sample(rng) for _ in range(4000)]
    assert set(samples) == {1, 2, 3, 4}
    assert statistics.mean(samples) == pytest.approx(2.5, abs=0.1)


def test_exponential_distribution_has_its_mean_and_its_cap():
    rng = random.Random(2)
    uncapped = LengthDistribution.parse("exp:50:100000")
    samples = [uncapped.sample(rng) for _ in range(5000)]
    assert statistics.mean(samples) == pytest.approx(50, rel=0.08)
    assert min(samples) >= 1
    capped = LengthDistribution.parse("exp:50:60")
    capped_samples = [capped.sample(rng) for _ in range(5000)]
    assert max(capped_samples) == 60
    # P(X > 60) = exp(-60/50) ~ 0.30 of samples sit on the cap.
    assert capped_samples.count(60) / 5000 == pytest.approx(math.exp(-1.2), abs=0.04)


@pytest.mark.parametrize("text", ["fixed", "uniform:5", "uniform:9:3", "exp:0:10", "normal:3:4", "fixed:x"])
def test_malformed_distributions_are_refused(text):
    with pytest.raises(WorkloadError):
        LengthDistribution.parse(text)


def test_distribution_round_trips_through_its_string():
    for text in ("fixed:8", "uniform:16:256", "exp:128:1024"):
        assert str(LengthDistribution.parse(text)) == text


class SpaceEncoder:
    """Encodes text as one token per word, enough to check the JSONL path."""

    def encode(self, text: str) -> list[int]:
        return [len(word) for word in text.split()]


def test_jsonl_prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "one two three", "output_len": 5},
        {"prompt_token_ids": [7, 8], "output_len": 3},
        {"prompt": "four five"},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    requests = load_jsonl(path, SpaceEncoder(), LengthDistribution.parse("fixed:9"))
    assert [r.prompt_token_ids for r in requests] == [(3, 3, 5), (7, 8), (4, 4)]
    assert [r.output_len for r in requests] == [5, 3, 9]
    assert len(load_jsonl(path, SpaceEncoder(), LengthDistribution.parse("fixed:9"), num_requests=2)) == 2


def test_jsonl_errors(tmp_path):
    path = tmp_path / "bad.jsonl"
    for content in ('{"prompt": "x"}', "not json", '{"output_len": 3}', ""):
        path.write_text(content)
        with pytest.raises(WorkloadError):
            load_jsonl(path, None, LengthDistribution.parse("fixed:1"))


def test_all_at_once_arrivals():
    assert ArrivalProcess().offsets(4) == [0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_arrival_rate_matches_on_average_and_is_seeded(burstiness):
    process = ArrivalProcess(rate=8.0, burstiness=burstiness, seed=3)
    offsets = process.offsets(4001)
    assert offsets == process.offsets(4001)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    gaps = [b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    assert statistics.mean(gaps) == pytest.approx(1 / 8, rel=0.08)
    # Gamma gaps with shape k have coefficient of variation 1/sqrt(k): burstier means more spread.
    cv = statistics.pstdev(gaps) / statistics.mean(gaps)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


def test_bad_arrival_parameters():
    with pytest.raises(WorkloadError):
        ArrivalProcess(rate=0)
    with pytest.raises(WorkloadError):
        ArrivalProcess(rate=1.0, burstiness=0)
