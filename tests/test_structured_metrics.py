"""The structured-output metrics: grammar mask time per engine step, compile time per real compile, and
constrained requests, each moving by exactly what the engine and the compile service did.

The engine's observer fires once per step that masks any row, so a lone constrained request adds one
fill observation per token it samples and unconstrained traffic adds none; the compile service reports
compiles, never cache hits.
"""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from conftest import engine_for, random_prompts, tiny_hf_model
from test_decode_scheduler import Harness
from tiny_tokenizer import TINY_EOS_TOKEN_IDS, TINY_VOCAB_SIZE, build_tiny_tokenizer

from decode_service.engine_core.messages import CoreStats
from decode_service.engine_core.request import ServedRequest
from decode_service.metrics import DecodeMetrics
from engine.grammar import GrammarState
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


@pytest.fixture(scope="module")
def regex_grammar(tokenizer) -> xgr.CompiledGrammar:
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer.hf, vocab_size=TINY_VOCAB_SIZE, stop_token_ids=list(TINY_EOS_TOKEN_IDS)
    )
    return xgr.GrammarCompiler(info, max_threads=1).compile_regex("(yes|no)( maybe)?")


def histogram(histogram_metric, suffix: str) -> float:
    """One sample (`_count` or `_sum`) of an unlabelled histogram, read without a scrape."""
    [family] = histogram_metric.collect()
    return next(s.value for s in family.samples if s.name.endswith(suffix))


def counter(counter_metric) -> float:
    [family] = counter_metric.collect()
    return next(s.value for s in family.samples if s.name.endswith("_total"))


def test_fill_time_is_observed_once_per_masked_step_and_unconstrained_steps_pay_nothing(
    tokenizer, regex_grammar
):
    # Without jump-forward every output token is sampled, so each one costs exactly one masked step.
    engine = engine_for(
        tiny_hf_model(5, vocab_size=TINY_VOCAB_SIZE), tokenizer=tokenizer, grammar_jump_forward=False
    )
    harness = Harness(engine)
    metrics = DecodeMetrics(CoreStats)
    engine.grammar_fill_observer = metrics.structured_output_fill_seconds.observe
    deliver = harness.loop._deliver

    def observe_then_deliver(deltas):
        metrics.observe(deltas)
        deliver(deltas)

    harness.loop._deliver = observe_then_deliver

    for i, prompt in enumerate(random_prompts(3, 1, min_len=3, max_len=12, vocab=TINY_VOCAB_SIZE)):
        harness.submit(f"free{i}", prompt, 6)
    harness.run()
    assert histogram(metrics.structured_output_fill_seconds, "_count") == 0
    assert counter(metrics.structured_output_requests) == 0

    stopping = StoppingParams(max_tokens=20)
    grammar = GrammarState(regex_grammar)
    seq = engine.make_sequence([4, 5, 6], GREEDY, stopping, "constrained", grammar=grammar)
    harness.loop.submit(ServedRequest(seq))
    harness.submit("beside-it", [7, 8, 9], 12)
    harness.run()

    text = tokenizer.decode(harness.tokens["constrained"])
    assert text in ("yes", "no", "yes maybe", "no maybe")
    # One masked step per sampled token, the grammar's end (EOS) included, whatever ran beside it.
    masked_steps = len(seq.output_token_ids) + (seq.output_token_ids[-1] not in TINY_EOS_TOKEN_IDS)
    assert histogram(metrics.structured_output_fill_seconds, "_count") == masked_steps
    assert histogram(metrics.structured_output_fill_seconds, "_sum") > 0
    assert counter(metrics.structured_output_requests) == 1


def test_compile_time_is_observed_per_compile_not_per_cache_hit(tokenizer):
    from decode_service.engine_core.grammar_compiler import GrammarCompiler

    metrics = DecodeMetrics(CoreStats)
    compiler = GrammarCompiler(
        tokenizer.hf, TINY_VOCAB_SIZE, TINY_EOS_TOKEN_IDS, timeout_s=60.0, cache_size=8
    )
    metrics.watch_grammar_compiler(compiler)
    try:
        schema = json.dumps(SCHEMA)
        for _ in range(3):
            compiler.compile("json_schema", schema, "structured_output.json_schema")
        compiler.compile("regex", "(yes|no)", "structured_output.regex")
    finally:
        compiler.close()
    assert histogram(metrics.structured_output_compile_seconds, "_count") == 2
    assert histogram(metrics.structured_output_compile_seconds, "_sum") > 0
