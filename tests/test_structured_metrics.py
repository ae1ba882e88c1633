"""The structured-output metrics: grammar mask time per engine step, compile time per real compile, and
constrained requests, each moving by exactly what the engine and the compile service did.

The engine's observer fires once per step that masks any row, so a lone constrained request adds one
fill observation per token it samples and unconstrained traffic adds none; the compile service reports
compiles, never cache hits.
"""

from __future__ import annotations

import json

import pytest
from conftest import engine_for, random_prompts, tiny_hf_model, wait_until
from tiny_tokenizer import TINY_EOS_TOKEN_IDS, TINY_VOCAB_SIZE, build_tiny_tokenizer

from decode_service.engine_core.config import CoreConfig
from decode_service.engine_core.core import EngineCore
from decode_service.engine_core.messages import CoreStats, GrammarSource, StepOut, Submit
from decode_service.metrics import DecodeMetrics
from engine.params import SamplingParams, StoppingParams
from engine.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0.0)
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def histogram(histogram_metric, suffix: str) -> float:
    """One sample (`_count` or `_sum`) of an unlabelled histogram, read without a scrape."""
    [family] = histogram_metric.collect()
    return next(s.value for s in family.samples if s.name.endswith(suffix))


def counter(counter_metric) -> float:
    [family] = counter_metric.collect()
    return next(s.value for s in family.samples if s.name.endswith("_total"))


class _Core:
    """An engine core behind the front door's messages (`EngineCore`, what both shapes run), its steps
    observed by `metrics` as the server does."""

    def __init__(self, engine, metrics: DecodeMetrics) -> None:
        self.metrics = metrics
        self.submitted: dict[int, Submit] = {}
        self.tokens: dict[str, list[int]] = {}
        self.ended: set[int] = set()
        self.core = EngineCore(engine, CoreConfig(), self._on_step)

    def _on_step(self, step: StepOut) -> None:
        for seconds in step.grammar_fill_seconds:
            self.metrics.structured_output_fill_seconds.observe(seconds)
        for seconds in step.grammar_compile_seconds:
            self.metrics.structured_output_compile_seconds.observe(seconds)
        self.metrics.observe(step.deltas, self.submitted.get)
        for delta in step.deltas:
            self.tokens[self.submitted[delta.submission].request_id].extend(delta.token_ids)
            if delta.finish_reason is not None:
                self.ended.add(delta.submission)

    def run(self, *requests: tuple[str, list[int], int, GrammarSource | None]) -> None:
        """Submit each (id, prompt, max tokens, grammar) and wait until all ended."""
        for request_id, prompt, max_tokens, grammar in requests:
            submission = len(self.submitted) + 1
            self.submitted[submission] = submit = Submit(
                submission,
                request_id,
                prompt,
                GREEDY,
                StoppingParams(max_tokens=max_tokens, ignore_eos=grammar is None),
                "",
                grammar,
                0,
                "",
                None,
                1,
            )
            self.tokens[request_id] = []
            self.core.apply(submit)
        assert wait_until(lambda: self.ended >= set(self.submitted), timeout=60)


def test_fill_time_is_observed_once_per_masked_step_and_unconstrained_steps_pay_nothing(tokenizer):
    # Without jump-forward every output token is sampled, so each one costs exactly one masked step.
    engine = engine_for(
        tiny_hf_model(5, vocab_size=TINY_VOCAB_SIZE), tokenizer=tokenizer, grammar_jump_forward=False
    )
    metrics = DecodeMetrics(CoreStats)
    core = _Core(engine, metrics)
    core.core.grammars.start(warm_up=False)
    try:
        prompts = random_prompts(3, 1, min_len=3, max_len=12, vocab=TINY_VOCAB_SIZE)
        core.run(*((f"free{i}", prompt, 6, None) for i, prompt in enumerate(prompts)))
        assert histogram(metrics.structured_output_fill_seconds, "_count") == 0
        assert counter(metrics.structured_output_requests) == 0

        regex = GrammarSource("regex", "(yes|no)( maybe)?", "structured_output.regex", None, False)
        core.run(("constrained", [4, 5, 6], 20, regex), ("beside-it", [7, 8, 9], 12, None))
    finally:
        core.core.grammars.stop()

    output = core.tokens["constrained"]
    assert tokenizer.decode(output) in ("yes", "no", "yes maybe", "no maybe")
    # One masked step per sampled token, the grammar's end (EOS) included, whatever ran beside it.
    masked_steps = len(output) + (output[-1] not in TINY_EOS_TOKEN_IDS)
    assert histogram(metrics.structured_output_fill_seconds, "_count") == masked_steps
    assert histogram(metrics.structured_output_fill_seconds, "_sum") > 0
    assert counter(metrics.structured_output_requests) == 1


def test_compile_time_is_observed_per_compile_not_per_cache_hit(tokenizer):
    """The core compiles each new constraint once (its worker), and the step after carries the time."""
    engine = engine_for(tiny_hf_model(5, vocab_size=TINY_VOCAB_SIZE), tokenizer=tokenizer)
    metrics = DecodeMetrics(CoreStats)
    core = _Core(engine, metrics)
    core.core.grammars.start(warm_up=False)
    schema = GrammarSource("json_schema", json.dumps(SCHEMA), "structured_output.json_schema", None, True)
    regex = GrammarSource("regex", "(yes|no)", "structured_output.regex", None, False)
    try:
        for index in range(3):
            core.run((f"schema{index}", [4, 5, 6], 30, schema))
        core.run(("regex", [4, 5, 6], 10, regex))
    finally:
        core.core.grammars.stop()
    assert histogram(metrics.structured_output_compile_seconds, "_count") == 2
    assert histogram(metrics.structured_output_compile_seconds, "_sum") > 0
