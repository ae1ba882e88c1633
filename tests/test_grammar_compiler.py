"""The grammar compile service: verdicts (a size or an error naming the field) from a worker process,
cached, bounded in time per request and in size per grammar, with turns shared fairly between tenants."""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
from pathlib import Path

import pytest
import xgrammar as xgr
from conftest import wait_until
from tiny_tokenizer import TINY_EOS_TOKEN_IDS, TINY_VOCAB_SIZE, build_tiny_tokenizer

from decode_service.engine_core.grammar_compiler import (
    CompileBudget,
    FairTurns,
    GrammarCompiler,
    GrammarTooLargeError,
    _child_main,
    clean_error_message,
    compile_in_process,
)
from decode_service.front_door.constraints import (
    CompileTimeoutError,
    ConstraintError,
    Constraints,
    GrammarSpec,
)
from engine.tokenizer import Tokenizer
from serving.errors import QueueFullError

# Compiles in about 1 s on a 2-core Xeon (xgrammar 0.2.9, the tiny vocabulary): far past SLOW_TIMEOUT_S.
SLOW_REGEX = "(" + "|".join(f"[a-z]{{{i}}}x" for i in range(1, 800)) + ")"
SLOW_TIMEOUT_S = 0.2
SCHEMA = json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def make_compiler(
    tokenizer: Tokenizer, timeout_s: float = 30.0, cache_size: int = 8, **kwargs
) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.hf, TINY_VOCAB_SIZE, TINY_EOS_TOKEN_IDS, timeout_s, cache_size, **kwargs)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer):
    compiler = make_compiler(tokenizer)
    yield compiler
    compiler.close()


def accepts(compiled: xgr.CompiledGrammar, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.fixture(scope="module")
def bare(compiler: GrammarCompiler) -> xgr.GrammarCompiler:
    """xgrammar in this process, over the same vocabulary: what the worker's verdicts are checked against."""
    return xgr.GrammarCompiler(compiler.tokenizer_info, cache_enabled=False)


def process_exists(pid: int) -> bool:
    """True while `pid` runs (a zombie, reaped or not, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_each_kind_compiles_to_what_it_says(bare: xgr.GrammarCompiler) -> None:
    """What the worker's verdicts are about: `compile_in_process`, which the engine's side runs too."""
    schema = compile_in_process(bare, "json_schema", SCHEMA)
    assert accepts(schema, '{"city": "Paris"}') and not accepts(schema, '{"town": "Paris"}')
    any_object = compile_in_process(bare, "json_object", "")
    assert accepts(any_object, '{"a": [1, {"b": null}]}')
    assert not accepts(any_object, "[1]") and not accepts(any_object, '"text"')
    regex = compile_in_process(bare, "regex", "[0-9]{3}-[a-z]+")
    assert accepts(regex, "123-abc") and not accepts(regex, "12-abc")
    grammar = compile_in_process(bare, "grammar", 'root ::= "yes" | "no"')
    assert accepts(grammar, "no") and not accepts(grammar, "maybe")


def test_the_worker_answers_a_size_never_a_serialized_grammar(
    compiler: GrammarCompiler, bare, tmp_path
) -> None:
    """A compiled grammar serialized to JSON is ~15x its size (a 10 KB schema: 14 MB); the worker sends
    the verdict only, and the front door keeps no grammar."""
    info_path = tmp_path / "info.json"
    info_path.write_text(compiler.tokenizer_info.serialize_json())
    ours, theirs = multiprocessing.Pipe()
    worker = threading.Thread(target=_child_main, args=(theirs, str(info_path)), daemon=True)
    worker.start()
    try:
        assert ours.recv() == ("ready", "")
        ours.send(("json_schema", SCHEMA))
        status, payload = ours.recv()
        assert status == "ok" and type(payload) is int
        assert payload == compile_in_process(bare, "json_schema", SCHEMA).memory_size_bytes
        ours.send(("regex", "(ab"))
        status, payload = ours.recv()
        assert status == "error" and "parenthesis" in payload
    finally:
        ours.close()
        worker.join(10)
    assert not worker.is_alive()
    size = compiler.compile("json_schema", SCHEMA, "structured_output.json_schema")
    assert size == compile_in_process(bare, "json_schema", SCHEMA).memory_size_bytes


def test_a_repeated_spec_is_served_from_the_cache(tokenizer: Tokenizer) -> None:
    seconds: list[float] = []
    compiler = make_compiler(tokenizer, cache_size=2, compile_observer=seconds.append)
    try:
        first = compiler.compile("regex", "a+", "f")
        assert compiler.compile("regex", "a+", "f") == first
        assert len(seconds) == 1 and seconds[0] > 0
        # LRU: touching a+ keeps it while b+ is evicted by c+.
        compiler.compile("regex", "b+", "f")
        compiler.compile("regex", "a+", "f")
        compiler.compile("regex", "c+", "f")
        assert len(seconds) == 3
        assert compiler.compile("regex", "a+", "f") == first
        compiler.compile("regex", "b+", "f")
        assert len(seconds) == 4
    finally:
        compiler.close()


@pytest.mark.parametrize(
    ("kind", "spec", "needle"),
    [
        ("json_schema", '{"type": "nonsense"}', 'Unsupported type "nonsense"'),
        ("json_schema", '{"properties": {"a": {"$ref": "#/defs/x"}}}', "Cannot find field 'defs'"),
        ("regex", "(ab", "parenthesis is not closed"),
        ("grammar", "root ::= foo", 'Rule "foo" is not defined'),
        ("grammar", 'rot ::= "a"', 'root rule with name "root" is not found'),
    ],
)
def test_what_xgrammar_refuses_names_the_field(compiler: GrammarCompiler, kind, spec, needle) -> None:
    with pytest.raises(ConstraintError) as caught:
        compiler.compile(kind, spec, "structured_output.x")
    assert caught.value.field == "structured_output.x"
    message = str(caught.value)
    assert message.startswith("structured_output.x: ") and needle in message
    assert "/project/cpp" not in message and ".cc:" not in message
    # The worker survives a refusal.
    assert compiler.compile("regex", "ok", "f") > 0


def test_clean_error_message_strips_the_source_location() -> None:
    raw = (
        "[16:04:06] /project/cpp/json_schema_converter.cc:5077: Check failed: (error.empty()) is false: Bad\n"
    )
    assert clean_error_message(raw) == "Bad"
    assert clean_error_message("x" * 2000).endswith("...")


@pytest.mark.slow
def test_a_compile_past_the_timeout_kills_the_worker_and_the_next_compile_works(tokenizer: Tokenizer) -> None:
    compiler = make_compiler(tokenizer, timeout_s=SLOW_TIMEOUT_S)
    try:
        compiler.compile("regex", "warm", "f")  # the worker starts outside the timed part
        slow_worker = compiler.worker_pid
        started = time.perf_counter()
        with pytest.raises(
            CompileTimeoutError, match=r"^structured_output.regex: did not compile within 0.2 s"
        ):
            compiler.compile("regex", SLOW_REGEX, "structured_output.regex")
        assert time.perf_counter() - started < SLOW_TIMEOUT_S + 5
        assert slow_worker is not None and not process_exists(slow_worker)
        assert compiler.compile("regex", "[0-9]+", "f") > 0
        assert compiler.worker_pid not in (None, slow_worker)
    finally:
        compiler.close()


def test_close_ends_the_worker_and_later_compiles_are_refused(tokenizer: Tokenizer) -> None:
    compiler = make_compiler(tokenizer)
    compiler.compile("regex", "a", "f")
    pid = compiler.worker_pid
    assert pid is not None and process_exists(pid)
    compiler.close()
    assert not process_exists(pid) and compiler.worker_pid is None
    from serving.errors import TierUnavailableError

    with pytest.raises(TierUnavailableError):
        compiler.compile("regex", "b", "f")
    compiler.close()


@pytest.mark.slow
def test_the_worker_exits_when_its_server_process_dies(tokenizer: Tokenizer, tmp_path: Path) -> None:
    """A killed server leaves no compile worker behind: the worker sees its pipe close and exits."""
    import subprocess
    import sys

    script = tmp_path / "server.py"
    script.write_text(
        "import sys, time\n"
        "from engine.tokenizer import Tokenizer\n"
        "from decode_service.engine_core.grammar_compiler import GrammarCompiler\n"
        "if __name__ == '__main__':\n"
        f"    tok = Tokenizer.from_pretrained({str(Path(tokenizer.hf.name_or_path))!r})\n"
        f"    c = GrammarCompiler(tok.hf, {TINY_VOCAB_SIZE}, {list(TINY_EOS_TOKEN_IDS)}, 30, 4)\n"
        "    c.compile('regex', 'a', 'f')\n"
        "    print(c.worker_pid, flush=True)\n"
        "    time.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    server = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        worker = int(server.stdout.readline())
        assert process_exists(worker)
    finally:
        server.kill()
        server.wait()
    deadline = time.monotonic() + 10
    while process_exists(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_exists(worker)


def test_a_grammar_above_the_limit_is_refused_naming_the_field_and_the_sizes(tokenizer: Tokenizer) -> None:
    from serving.status import status_for

    compiler = make_compiler(tokenizer, max_grammar_bytes=4096)
    try:
        small = compiler.compile("regex", "ab", "f")
        assert small <= 4096
        big_schema = json.dumps({"enum": [f"value-{i}" for i in range(300)]})
        with pytest.raises(GrammarTooLargeError) as caught:
            compiler.compile("json_schema", big_schema, "tools[2].parameters_json")
        message = str(caught.value)
        assert message.startswith("tools[2].parameters_json: compiles to a grammar of ")
        assert "above this server's limit of 0.0 MiB (--max-grammar-memory)" in message
        assert status_for(caught.value)[0].name == "INVALID_ARGUMENT"
        # The verdict is kept: sent again, it is refused without a compile.
        pid = compiler.worker_pid
        with pytest.raises(GrammarTooLargeError):
            compiler.compile("json_schema", big_schema, "structured_output.json_schema")
        assert compiler.worker_pid == pid
    finally:
        compiler.close()


@pytest.mark.slow
def test_the_worker_is_restarted_after_a_large_grammar(tokenizer: Tokenizer) -> None:
    """What a large compile took stays in the worker's heap: a new worker gives it back."""
    compiler = make_compiler(tokenizer, restart_above_bytes=4096)
    try:
        compiler.compile("regex", "ab", "f")
        small_worker = compiler.worker_pid
        assert small_worker is not None
        compiler.compile("json_schema", json.dumps({"enum": [f"value-{i}" for i in range(300)]}), "f")
        assert compiler.worker_pid is None and not process_exists(small_worker)
        assert compiler.compile("regex", "cd", "f") > 0
        assert compiler.worker_pid not in (None, small_worker)
    finally:
        compiler.close()


def test_tenants_take_turns_round_robin_and_each_has_a_bound() -> None:
    turns = FairTurns(max_per_tenant=2)
    order: list[str] = []

    def take(tenant: str, name: str) -> None:
        with turns.turn(tenant):
            order.append(name)

    threads = []
    with turns.turn("bomb"):  # the worker is busy
        for tenant, name in [
            ("bomb", "bomb-1"),
            ("other", "other-1"),
            ("other", "other-2"),
            ("third", "third-1"),
        ]:
            thread = threading.Thread(target=take, args=(tenant, name))
            thread.start()
            threads.append(thread)
            assert wait_until(lambda: turns.num_waiting == len(threads))
        # "bomb" holds the turn and has one waiting: a third is refused at once, others are not.
        with pytest.raises(QueueFullError, match=r"tenant 'bomb' already have 2 grammar compiles waiting"):
            with turns.turn("bomb"):
                pass
        late = threading.Thread(target=take, args=("late", "late-1"))
        late.start()
        threads.append(late)
        assert wait_until(lambda: turns.num_waiting == 5)
    for thread in threads:
        thread.join(10)
    # One turn per tenant in each round, in the order the tenants arrived; a tenant's own in order.
    assert order == ["bomb-1", "other-1", "third-1", "late-1", "other-2"]
    single = FairTurns(max_per_tenant=1)
    with single.turn(""), pytest.raises(QueueFullError, match="^requests without a tenant already have 1"):
        with single.turn(""):
            pass


def test_a_tenant_over_its_bound_is_refused_while_another_tenant_waits_its_turn(compiler) -> None:
    from serving.status import status_for

    compiler.compile("regex", "warm", "f")
    bound = compiler.turns.max_per_tenant
    results: dict[str, int] = {}

    def compile_for(tenant: str) -> None:
        results[tenant] = compiler.compile("regex", f"[0-9]+{tenant}", "structured_output.regex", tenant)

    release = threading.Event()

    def hold_a_turn() -> None:
        with compiler.turns.turn("bomb"):
            release.wait(60)

    holders = [threading.Thread(target=hold_a_turn) for _ in range(bound)]  # waiting or running
    for holder in holders:
        holder.start()
    assert wait_until(lambda: compiler.turns.busy and compiler.turns.num_waiting == bound - 1)
    with pytest.raises(QueueFullError) as caught:
        compiler.compile("regex", "x+", "structured_output.regex", "bomb")
    assert status_for(caught.value)[0].name == "RESOURCE_EXHAUSTED"
    assert f"tenant 'bomb' already have {bound} grammar compiles waiting or running" in str(caught.value)
    victim = threading.Thread(target=compile_for, args=("victim",))
    victim.start()
    assert wait_until(lambda: compiler.turns.num_waiting == bound)
    release.set()
    for holder in holders:
        holder.join(60)
    victim.join(60)
    assert results["victim"] > 0


def test_one_compile_budget_covers_a_request_and_its_per_tool_diagnosis(compiler, monkeypatch) -> None:
    """When the whole constraint fails, its tools are compiled one by one to name the one at fault; those
    compiles come out of the request's one budget, so many tools that each compile within the timeout
    cannot hold the worker for a timeout each. Each compile is made to cost 0.4 of the timeout here."""
    from types import SimpleNamespace

    from decode_service.engine_core import grammar_compiler

    compiled: list[float] = []
    compiler.compile_observer = compiled.append
    ticks = iter(range(1_000_000))
    step = compiler.timeout_s * 0.4  # between a compile's two clock reads
    monkeypatch.setattr(grammar_compiler, "time", SimpleNamespace(perf_counter=lambda: next(ticks) * step))
    parts = tuple(GrammarSpec("regex", f"budget{i}", f"tools[{i}].parameters_json") for i in range(3))
    spec = GrammarSpec("json_schema", '{"type": "nonsense"}', "tools", parts)
    try:
        with pytest.raises(ConstraintError, match=r'^tools: .*Unsupported type "nonsense"'):
            Constraints(compiler).compile(spec)
    finally:
        compiler.compile_observer = None
    # 0.4 (the whole) + 0.4 + 0.4 (two tools): the third tool is not compiled, the whole's error stands.
    assert len(compiled) == 2


def test_a_spent_budget_refuses_without_using_the_worker(compiler: GrammarCompiler) -> None:
    budget = CompileBudget(1.0)
    budget.spend(1.0)
    with pytest.raises(CompileTimeoutError, match=r"^f: did not compile within 1 s"):
        compiler.compile("regex", "never-seen-before", "f", budget=budget)
