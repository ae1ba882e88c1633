"""`tandem bench structured-output`: its per-token ITL window, the jump-forward replay, the /metrics
deltas, and one small end-to-end run against a real server process."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from conftest import save_tiny_model
from tiny_tokenizer import TINY_EOS_TOKEN_IDS, TINY_VOCAB_SIZE, build_tiny_tokenizer

from bench.structured_corpus import CORPUS
from bench.structured_output import Record, forced_tokens, histogram_delta, summarize
from engine.tokenizer import Tokenizer
from tandem.cli import main


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def info(tokenizer) -> xgr.TokenizerInfo:
    return xgr.TokenizerInfo.from_huggingface(
        tokenizer.hf, vocab_size=TINY_VOCAB_SIZE, stop_token_ids=list(TINY_EOS_TOKEN_IDS)
    )


def test_token_gaps_are_per_token_and_only_inside_the_window():
    record = Record("person", True, send_time=0.0)
    for at, tokens in ((1.0, 1), (1.5, 1), (2.5, 2), (4.0, 1)):
        record.chunk_times.append(at)
        record.chunk_tokens.append(tokens)
    # 1.0 -> 1.5: one token in 0.5 s; 1.5 -> 2.5: two tokens in 1.0 s; 2.5 -> 4.0 ends past the window.
    assert record.token_gaps(0.0, 3.0) == [0.5, 0.5, 0.5]
    assert record.token_gaps(1.2, 3.0) == [0.5, 0.5]


def test_every_corpus_schema_compiles(info):
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    for case in CORPUS:
        compiler.compile_json_schema(json.dumps(case.schema), any_whitespace=False)


def test_replay_counts_tokens_inside_forced_text(tokenizer, info):
    vocab = [bytes(piece) for piece in info.decoded_vocab]
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    # Everything but the choice of word is forced: after "ye" the grammar forces "s!".
    grammar = compiler.compile_regex("(yes|no)!")
    ids = tokenizer.encode("yes!")
    replay = forced_tokens(xgr.GrammarMatcher(grammar), ids, vocab)
    assert replay["replayed"] and replay["tokens"] == len(ids)
    # The first token is a free choice; whatever follows the grammar's single continuation is forced.
    assert 0 < replay["forced"] < len(ids)
    assert replay["steps_forced"] >= replay["forced"] and replay["forced_chars"] >= 1

    constant = compiler.compile_json_schema(
        json.dumps({"type": "object", "properties": {"a": {"const": "xyz"}}, "required": ["a"]}),
        any_whitespace=False,
    )
    ids = tokenizer.encode('{"a": "xyz"}')
    replay = forced_tokens(xgr.GrammarMatcher(constant), ids, vocab)
    assert replay["forced"] == len(ids), "a constant's whole text is forced"


def test_histogram_delta_and_missing_metrics():
    before = {"m_count": 2.0, "m_sum": 0.5}
    after = {"m_count": 6.0, "m_sum": 0.9}
    assert histogram_delta(before, after, "m") == {"count": 4, "sum_s": 0.4, "mean_ms": 100.0}
    assert histogram_delta({}, {}, "m") == {"count": None, "sum_s": None, "mean_ms": None}


def test_summary_ratio_and_fill_per_step():
    def phase(label: str, constrained: bool, gap: float) -> dict:
        record = Record("person", constrained, 0.0, [1.0, 1.0 + gap, 1.0 + 2 * gap], [1, 1, 1])
        return {
            "label": label,
            "records": [record],
            "window": (0.0, 10.0),
            "fill": {"count": 2 if constrained else 0, "sum_s": 0.002 if constrained else 0.0},
            "compile": {"count": 1 if constrained else 0},
        }

    summary = summarize([phase("unconstrained-1", False, 0.020), phase("constrained-1", True, 0.022)])
    assert summary["itl_ms_unconstrained"]["p50"] == 20.0
    assert summary["itl_ratio_p50"] == 1.1 and summary["meets_target"]
    assert summary["fill_ms_per_masked_step"] == 1.0
    assert summary["server_compiles_by_constrained_phase"] == [1]


@pytest.mark.slow
def test_quick_run_against_a_real_server(tmp_path):
    model = tmp_path / "model"
    save_tiny_model(model, 4)
    result_file = tmp_path / "out" / "structured_output.json"
    status = main(
        ["bench", "structured-output", "--quick", "--model", str(model), "--result-file", str(result_file)]
    )
    result = json.loads(result_file.read_text())
    assert status == 0, result["phases"]
    assert [p["label"] for p in result["phases"]] == ["unconstrained-1", "constrained-1", "mixed"]
    assert all(p["errors"] == 0 for p in result["phases"])
    summary = result["summary"]
    assert summary["itl_ms_constrained"]["n"] > 0 and summary["itl_ms_unconstrained"]["n"] > 0
    assert summary["itl_ratio_p50"] > 0
    # The server's own metrics saw the masks and the compiles of the constrained phase.
    assert summary["fill_steps_observed"] > 0 and summary["fill_ms_per_masked_step"] > 0
    assert summary["server_compiles_by_constrained_phase"][0] >= 1
    assert result["compile"]["cold_ms_median"] > 0 and result["compile"]["xgrammar_in_process_ms_median"] > 0
    assert result["jump_forward"]["tokens"] > 0
    assert 0 < result["jump_forward"]["forced_token_fraction"] <= 1
    assert (result_file.parent / "structured_output.png").is_file()
