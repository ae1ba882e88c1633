"""Where the engine runs, grammars compile on a thread of their own before their request reaches the loop:
plain requests never wait behind a compile, an abort drops a request still compiling, and compiled
grammars are cached within a budget of bytes."""

from __future__ import annotations

import json
import re
import threading

import pytest
import xgrammar as xgr
from conftest import engine_for, tiny_hf_model, wait_until
from test_decode_scheduler import Harness
from tiny_tokenizer import TINY_EOS_TOKEN_IDS, TINY_VOCAB_SIZE, build_tiny_tokenizer

from decode_service.engine_core import grammar_gate
from decode_service.engine_core.grammar_gate import GrammarCache, GrammarGate
from decode_service.engine_core.messages import GrammarSource
from decode_service.engine_core.request import ServedRequest
from engine.params import SamplingParams, StoppingParams
from engine.sequence import FinishReason
from engine.tokenizer import Tokenizer

REGEX = "(yes|no)"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def bare(tokenizer) -> xgr.GrammarCompiler:
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer.hf, vocab_size=TINY_VOCAB_SIZE, stop_token_ids=list(TINY_EOS_TOKEN_IDS)
    )
    return xgr.GrammarCompiler(info, cache_enabled=False)


def test_the_cache_is_bounded_in_bytes_least_recently_used_first(bare) -> None:
    keys = {name: ("regex", f"{name}[a-z]{{1,{n}}}") for name, n in (("a", 5), ("b", 6), ("c", 7))}
    grammars = {name: bare.compile_regex(key[1]) for name, key in keys.items()}
    sizes = {name: grammars[name].memory_size_bytes + len(key[0]) + len(key[1]) for name, key in keys.items()}
    # Room for two of them: adding a third drops the least recently used, however many entries would fit.
    cache = GrammarCache(max_bytes=sizes["a"] + sizes["c"], max_entries=100)
    cache.put(keys["a"], grammars["a"])
    cache.put(keys["b"], grammars["b"])
    assert cache.get(keys["a"]) is grammars["a"]  # a is now the most recently used
    cache.put(keys["c"], grammars["c"])
    assert keys["b"] not in cache and keys["a"] in cache and keys["c"] in cache
    assert cache.num_bytes <= cache.max_bytes
    assert cache.num_bytes == sizes["a"] + sizes["c"]
    # A grammar larger than the whole budget is not kept, and drops nothing.
    big_schema = json.dumps({"enum": [f"value-{i}" for i in range(300)]})
    big = bare.compile_json_schema(big_schema)
    assert big.memory_size_bytes > cache.max_bytes
    cache.put(("json_schema", big_schema), big)
    assert ("json_schema", big_schema) not in cache and len(cache) == 2
    # The entry bound holds as well.
    counted = GrammarCache(max_bytes=2**30, max_entries=1)
    counted.put(keys["a"], grammars["a"])
    counted.put(keys["b"], grammars["b"])
    assert len(counted) == 1 and keys["b"] in counted


@pytest.fixture()
def gated(tokenizer, monkeypatch):
    """A gate over a tiny engine's loop, stepped by the test, whose compiles wait for `release`."""
    engine = engine_for(tiny_hf_model(5, vocab_size=TINY_VOCAB_SIZE), tokenizer=tokenizer)
    harness = Harness(engine)
    gate = GrammarGate(harness.loop, tokenizer, TINY_VOCAB_SIZE, GrammarCache(2**30, 16))
    release = threading.Event()
    compiling = threading.Event()
    real_compile = grammar_gate.compile_in_process

    def slow_compile(compiler, kind, spec):
        compiling.set()
        assert release.wait(60)
        return real_compile(compiler, kind, spec)

    monkeypatch.setattr(grammar_gate, "compile_in_process", slow_compile)
    yield harness, gate, release, compiling
    release.set()
    gate.stop()


def constrained(harness: Harness, request_id: str, regex: str = REGEX) -> ServedRequest:
    seq = harness.engine.make_sequence(
        [4, 5, 6], SamplingParams(temperature=0.0), StoppingParams(max_tokens=20), request_id
    )
    return ServedRequest(seq, grammar=GrammarSource("regex", regex, None, False))


def plain(harness: Harness, request_id: str) -> ServedRequest:
    stopping = StoppingParams(max_tokens=3, ignore_eos=True)
    return ServedRequest(
        harness.engine.make_sequence([7, 8, 9], SamplingParams(temperature=0.0), stopping, request_id)
    )


def test_a_plain_request_after_a_compiling_one_runs_while_the_compile_does(gated, tokenizer) -> None:
    harness, gate, release, compiling = gated
    gate.submit(constrained(harness, "slow-schema"))
    assert compiling.wait(60)
    gate.submit(plain(harness, "plain"))
    harness.loop.run_until_idle()
    # The plain request finished while the compile still held the constrained one back.
    assert harness.finish["plain"] is FinishReason.LENGTH and len(harness.tokens["plain"]) == 3
    assert "slow-schema" not in harness.tokens and gate.num_compiling == 1
    release.set()
    assert wait_until(lambda: gate.num_compiling == 0)
    harness.loop.run_until_idle()
    assert harness.finish["slow-schema"] is FinishReason.STOP
    assert re.fullmatch(REGEX, tokenizer.decode(harness.tokens["slow-schema"]))
    assert ("regex", REGEX) in gate.cache
    # Cached now: the next request with it passes at once, without a compile.
    compiling.clear()
    gate.submit(constrained(harness, "again"))
    harness.loop.run_until_idle()
    assert not compiling.is_set() and harness.finish["again"] is FinishReason.STOP


def test_an_abort_drops_a_request_still_compiling(gated) -> None:
    harness, gate, release, compiling = gated
    request = constrained(harness, "aborted")
    gate.submit(request)
    assert compiling.wait(60)
    gate.abort("aborted")
    harness.loop.run_until_idle()
    assert harness.finish["aborted"] is FinishReason.ABORT and harness.tokens["aborted"] == []
    assert gate.num_compiling == 0
    release.set()
    # The compile ends in the cache only: the request never reaches the scheduler, nothing is held.
    assert wait_until(lambda: ("regex", REGEX) in gate.cache)
    harness.loop.run_until_idle()
    assert harness.tokens["aborted"] == [] and not harness.scheduler.live_request_ids()
    assert harness.engine.num_free_blocks == harness.engine.num_blocks


def test_a_grammar_that_does_not_compile_here_ends_its_request_with_an_error(gated) -> None:
    harness, gate, release, _ = gated
    release.set()
    gate.submit(constrained(harness, "broken", regex="(ab"))
    assert wait_until(lambda: gate.num_compiling == 0)
    harness.loop.run_until_idle()
    error = harness.errors["broken"]
    assert "the constraint did not compile" in str(error)
    from serving.status import status_for

    assert status_for(error)[0].name == "INVALID_ARGUMENT"


def test_stop_drops_what_is_still_compiling(gated) -> None:
    harness, gate, release, compiling = gated
    gate.submit(constrained(harness, "at-stop"))
    assert compiling.wait(60)
    harness.loop.start(warm_up=False)
    gate.stop()
    assert harness.finish["at-stop"] is FinishReason.ABORT
