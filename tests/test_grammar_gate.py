"""Where the engine runs, grammars compile on a thread of their own before their request reaches the loop:
plain requests never wait behind a compile, an abort drops a request still compiling, requests with one
constraint share its compile, tenants take turns within a bound, and compiled grammars (and refusals)
are cached."""

from __future__ import annotations

import json
import re
import threading

import pytest
import xgrammar as xgr
from conftest import engine_for, tiny_hf_model, wait_until
from test_decode_scheduler import Harness
from tiny_tokenizer import TINY_EOS_TOKEN_IDS, TINY_VOCAB_SIZE, build_tiny_tokenizer

from decode_service.engine_core.grammar_compiler import CompiledConstraint, GrammarCompiler, GrammarConfig
from decode_service.engine_core.grammar_gate import GrammarCache, GrammarGate
from decode_service.engine_core.messages import GrammarSource
from decode_service.engine_core.request import ServedRequest
from engine.params import SamplingParams, StoppingParams
from engine.sequence import FinishReason
from engine.tokenizer import Tokenizer
from serving.status import status_for

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


def resident(compiled: xgr.CompiledGrammar, factor: int = 2) -> CompiledConstraint:
    """`compiled` as the compiler gives it: with more resident bytes than xgrammar estimates."""
    return CompiledConstraint(compiled, compiled.memory_size_bytes * factor)


def test_the_cache_is_bounded_in_resident_bytes_least_recently_used_first(bare) -> None:
    keys = {name: ("regex", f"{name}[a-z]{{1,{n}}}") for name, n in (("a", 5), ("b", 6), ("c", 7))}
    grammars = {name: resident(bare.compile_regex(key[1])) for name, key in keys.items()}
    sizes = {name: grammars[name].resident_bytes + len(key[0]) + len(key[1]) for name, key in keys.items()}
    # Room for two of them: adding a third drops the least recently used, however many entries would fit.
    cache = GrammarCache(max_bytes=sizes["a"] + sizes["c"], max_entries=100)
    cache.put(keys["a"], grammars["a"])
    cache.put(keys["b"], grammars["b"])
    assert cache.get(keys["a"]) is grammars["a"].grammar  # a is now the most recently used
    assert cache.put(keys["c"], grammars["c"]) == sizes["b"]  # what it evicted, so the gate trims
    assert keys["b"] not in cache and keys["a"] in cache and keys["c"] in cache
    assert cache.num_bytes <= cache.max_bytes
    assert cache.num_bytes == sizes["a"] + sizes["c"]
    # A grammar larger than the whole budget is not kept, and drops nothing.
    big_schema = json.dumps({"enum": [f"value-{i}" for i in range(300)]})
    big = resident(bare.compile_json_schema(big_schema))
    assert big.resident_bytes > cache.max_bytes
    cache.put(("json_schema", big_schema), big)
    assert ("json_schema", big_schema) not in cache and len(cache) == 2
    # The entry bound holds as well.
    counted = GrammarCache(max_bytes=2**30, max_entries=1)
    counted.put(keys["a"], grammars["a"])
    counted.put(keys["b"], grammars["b"])
    assert len(counted) == 1 and keys["b"] in counted


@pytest.fixture()
def gated(tokenizer, monkeypatch):
    """A gate over a tiny engine's loop, stepped by the test, whose compiles wait for `release`; the
    specs compiled are in `compiled`, in order."""
    engine = engine_for(tiny_hf_model(5, vocab_size=TINY_VOCAB_SIZE), tokenizer=tokenizer)
    harness = Harness(engine)
    gate = GrammarGate(harness.loop, tokenizer, TINY_VOCAB_SIZE, GrammarConfig(max_compiles_per_tenant=3))
    release = threading.Event()
    compiling = threading.Event()
    compiled: list[str] = []
    real_compile = GrammarCompiler.compile

    def slow_compile(compiler, kind, spec, field):
        compiled.append(spec)
        compiling.set()
        assert release.wait(60)
        return real_compile(compiler, kind, spec, field)

    monkeypatch.setattr(GrammarCompiler, "compile", slow_compile)
    yield harness, gate, release, compiling, compiled
    release.set()
    gate.stop()


def constrained(harness: Harness, request_id: str, regex: str = REGEX, tenant: str = "") -> ServedRequest:
    seq = harness.engine.make_sequence(
        [4, 5, 6], SamplingParams(temperature=0.0), StoppingParams(max_tokens=20), request_id
    )
    return ServedRequest(
        seq, tenant=tenant, grammar=GrammarSource("regex", regex, "structured_output.regex", None, False)
    )


def plain(harness: Harness, request_id: str) -> ServedRequest:
    stopping = StoppingParams(max_tokens=3, ignore_eos=True)
    return ServedRequest(
        harness.engine.make_sequence([7, 8, 9], SamplingParams(temperature=0.0), stopping, request_id)
    )


def test_a_plain_request_after_a_compiling_one_runs_while_the_compile_does(gated, tokenizer) -> None:
    harness, gate, release, compiling, _ = gated
    gate.submit(constrained(harness, "slow-schema"))
    assert compiling.wait(60)
    harness.loop.submit(plain(harness, "plain"))
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
    harness, gate, release, compiling, _ = gated
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
    harness, gate, release, _, compiled = gated
    release.set()
    gate.submit(constrained(harness, "broken", regex="(ab"))
    assert wait_until(lambda: gate.num_compiling == 0)
    harness.loop.run_until_idle()
    error = harness.errors["broken"]
    assert str(error).startswith("structured_output.regex: ") and "parenthesis is not closed" in str(error)
    assert status_for(error)[0].name == "INVALID_ARGUMENT"
    # The refusal is remembered: the same constraint again is refused at once, without a compile.
    with pytest.raises(type(error), match="parenthesis is not closed"):
        gate.submit(constrained(harness, "broken-again", regex="(ab"))
    assert compiled == ["(ab"]


def test_stop_drops_what_is_still_compiling(gated) -> None:
    harness, gate, release, compiling, _ = gated
    gate.submit(constrained(harness, "at-stop"))
    assert compiling.wait(60)
    harness.loop.start(warm_up=False)
    gate.stop()
    assert harness.finish["at-stop"] is FinishReason.ABORT


def test_requests_with_one_constraint_share_its_compile(gated) -> None:
    harness, gate, release, compiling, compiled = gated
    for index in range(3):
        gate.submit(constrained(harness, f"same{index}"))
    assert compiling.wait(60) and gate.num_compiling == 3
    release.set()
    assert wait_until(lambda: gate.num_compiling == 0)
    harness.loop.run_until_idle()
    assert compiled == [REGEX]
    assert all(harness.finish[f"same{index}"] is FinishReason.STOP for index in range(3))


def test_tenants_take_turns_and_each_has_a_bound(gated) -> None:
    """While one compile runs, tenants' new constraints queue; they compile one per tenant per round, and
    a tenant past its bound (3 here) of distinct constraints waiting or compiling is refused at once."""
    harness, gate, release, compiling, compiled = gated
    gate.submit(constrained(harness, "bomb-a", "a[0-9]", tenant="bomb"))
    assert compiling.wait(60)
    gate.submit(constrained(harness, "bomb-b", "b[0-9]", tenant="bomb"))
    gate.submit(constrained(harness, "bomb-c", "c[0-9]", tenant="bomb"))
    with pytest.raises(Exception, match=r"tenant 'bomb' already have 3 grammar compiles waiting") as caught:
        gate.submit(constrained(harness, "bomb-x", "x[0-9]", tenant="bomb"))
    assert status_for(caught.value)[0].name == "RESOURCE_EXHAUSTED"
    # A request sharing a queued constraint takes no more of the bound.
    gate.submit(constrained(harness, "bomb-b2", "b[0-9]", tenant="bomb"))
    gate.submit(constrained(harness, "other-d", "d[0-9]", tenant="other"))
    gate.submit(constrained(harness, "other-e", "e[0-9]", tenant="other"))
    release.set()
    assert wait_until(lambda: gate.num_compiling == 0)
    assert compiled == ["a[0-9]", "b[0-9]", "d[0-9]", "c[0-9]", "e[0-9]"]
    harness.loop.run_until_idle()
    assert {"bomb-a", "bomb-b", "bomb-b2", "bomb-c", "other-d", "other-e"} <= set(harness.finish)


def test_a_constraint_nobody_waits_for_is_not_compiled(gated) -> None:
    harness, gate, release, compiling, compiled = gated
    gate.submit(constrained(harness, "running", "x[0-9]"))
    assert compiling.wait(60)
    gate.submit(constrained(harness, "left", "y[0-9]"))
    gate.abort("left")
    release.set()
    assert wait_until(lambda: gate.num_compiling == 0)
    harness.loop.run_until_idle()
    assert harness.finish["left"] is FinishReason.ABORT
    assert compiled == ["x[0-9]"]
