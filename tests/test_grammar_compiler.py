"""The engine core's grammar compiler: compiled grammars (or an error naming the field) from a worker
process, bounded in time and in size per grammar; and the front door's parse-only check."""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
from pathlib import Path

import pytest
import xgrammar as xgr
from tiny_tokenizer import TINY_EOS_TOKEN_IDS, TINY_VOCAB_SIZE, build_tiny_tokenizer

from decode_service.engine_core.grammar_compiler import (
    CompileTimeoutError,
    ConstraintError,
    GrammarCompiler,
    GrammarTooLargeError,
    _child_main,
    clean_error_message,
    compile_in_process,
)
from decode_service.front_door.constraints import Constraints, GrammarSpec
from engine.tokenizer import Tokenizer

# Compiles in about 1 s on a 2-core Xeon (xgrammar 0.2.9, the tiny vocabulary): far past SLOW_TIMEOUT_S.
SLOW_REGEX = "(" + "|".join(f"[a-z]{{{i}}}x" for i in range(1, 800)) + ")"
SLOW_TIMEOUT_S = 0.2
SCHEMA = json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def tokenizer_info(tokenizer: Tokenizer) -> xgr.TokenizerInfo:
    return xgr.TokenizerInfo.from_huggingface(
        tokenizer.hf, vocab_size=TINY_VOCAB_SIZE, stop_token_ids=list(TINY_EOS_TOKEN_IDS)
    )


def make_compiler(tokenizer: Tokenizer, timeout_s: float = 30.0, **kwargs) -> GrammarCompiler:
    return GrammarCompiler(tokenizer_info(tokenizer), timeout_s, **kwargs)


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
    """xgrammar in this process, over the same vocabulary: what the worker's grammars are checked against."""
    return xgr.GrammarCompiler(compiler.info, cache_enabled=False)


def process_exists(pid: int) -> bool:
    """True while `pid` runs (a zombie, reaped or not, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_each_kind_compiles_to_what_it_says(bare: xgr.GrammarCompiler) -> None:
    """What the worker runs for each kind: `compile_in_process`."""
    schema = compile_in_process(bare, "json_schema", SCHEMA)
    assert accepts(schema, '{"city": "Paris"}') and not accepts(schema, '{"town": "Paris"}')
    any_object = compile_in_process(bare, "json_object", "")
    assert accepts(any_object, '{"a": [1, {"b": null}]}')
    assert not accepts(any_object, "[1]") and not accepts(any_object, '"text"')
    regex = compile_in_process(bare, "regex", "[0-9]{3}-[a-z]+")
    assert accepts(regex, "123-abc") and not accepts(regex, "12-abc")
    grammar = compile_in_process(bare, "grammar", 'root ::= "yes" | "no"')
    assert accepts(grammar, "no") and not accepts(grammar, "maybe")


def test_the_worker_answers_a_verdict_never_a_grammar(compiler: GrammarCompiler, bare, tmp_path) -> None:
    """Over the pipe: that it compiled and the bytes the grammar holds resident (at least xgrammar's
    estimate), or the error, and nothing more; `compile` then compiles it here, to the same language."""
    info_path = tmp_path / "info.json"
    info_path.write_text(compiler.info.serialize_json())
    ours, theirs = multiprocessing.Pipe()
    worker = threading.Thread(target=_child_main, args=(theirs, str(info_path), 2**30), daemon=True)
    worker.start()
    try:
        assert ours.recv()[0] == "ready"
        ours.send(("json_schema", SCHEMA))
        estimate = compile_in_process(bare, "json_schema", SCHEMA).memory_size_bytes
        status, size, message = ours.recv()
        assert (status, message) == ("compiled", "") and size >= estimate
        assert not ours.poll(0.5)
        ours.send(("regex", "(ab"))
        status, _, message = ours.recv()
        assert status == "error" and "parenthesis" in message
    finally:
        ours.close()
        worker.join(10)
    assert not worker.is_alive()
    compiled = compiler.compile("json_schema", SCHEMA, "structured_output.json_schema")
    grammar = compiled.grammar
    assert accepts(grammar, '{"city": "Paris"}') and not accepts(grammar, '{"town": "Paris"}')
    assert grammar.memory_size_bytes == estimate and compiled.resident_bytes >= estimate


def test_every_call_compiles_the_cache_is_the_gates(tokenizer: Tokenizer) -> None:
    seconds: list[float] = []
    compiler = make_compiler(tokenizer, compile_observer=seconds.append)
    try:
        for _ in range(2):
            assert accepts(compiler.compile("regex", "a+", "f").grammar, "aaa")
        # One observation a constraint: the worker's compile and this process's together.
        assert len(seconds) == 2 and min(seconds) > 0
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
    """Refused alike by the core's compile and by the front door's parse, which catches them first."""
    from decode_service.front_door.constraints import check_grammar

    for refuse in (compiler.compile, check_grammar):
        with pytest.raises(ConstraintError) as caught:
            refuse(kind, spec, "structured_output.x")
        assert caught.value.field == "structured_output.x"
        message = str(caught.value)
        assert message.startswith("structured_output.x: ") and needle in message
        assert "/project/cpp" not in message and ".cc:" not in message
    # The worker survives a refusal.
    assert accepts(compiler.compile("regex", "ok", "f").grammar, "ok")


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
        assert accepts(compiler.compile("regex", "[0-9]+", "f").grammar, "12")
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
        "import xgrammar as xgr\n"
        "from engine.tokenizer import Tokenizer\n"
        "from decode_service.engine_core.grammar_compiler import GrammarCompiler\n"
        "if __name__ == '__main__':\n"
        f"    tok = Tokenizer.from_pretrained({str(Path(tokenizer.hf.name_or_path))!r})\n"
        f"    info = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size={TINY_VOCAB_SIZE})\n"
        "    c = GrammarCompiler(info, 30)\n"
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
        assert compiler.compile("regex", "ab", "f").resident_bytes <= 4096
        big_schema = json.dumps({"enum": [f"value-{i}" for i in range(300)]})
        with pytest.raises(GrammarTooLargeError) as caught:
            compiler.compile("json_schema", big_schema, "tools[2].parameters_json")
        message = str(caught.value)
        assert message.startswith("tools[2].parameters_json: compiles to a grammar of ")
        assert "above this server's limit of 0.0 MiB (--max-grammar-memory)" in message
        assert status_for(caught.value)[0].name == "INVALID_ARGUMENT"
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
        assert accepts(compiler.compile("regex", "cd", "f").grammar, "cd")
        assert compiler.worker_pid not in (None, small_worker)
    finally:
        compiler.close()


def test_a_tool_that_does_not_parse_is_named_by_the_front_door(tokenizer: Tokenizer) -> None:
    """When a forced tool call's whole schema does not parse, each tool's is parsed to name the one at
    fault; a whole that fails with every part good keeps its own field."""
    good = GrammarSpec("json_schema", SCHEMA, "tools[0].parameters_json")
    bad = GrammarSpec("json_schema", '{"type": "nonsense"}', "tools[1].parameters_json")
    whole = GrammarSpec("json_schema", '{"type": "nonsense"}', "tools", (good, bad))
    constraints = Constraints(tokenizer)
    with pytest.raises(ConstraintError, match=r'^tools\[1\].parameters_json: Unsupported type "nonsense"'):
        constraints.check(whole)
    with pytest.raises(ConstraintError, match=r'^tools: Unsupported type "nonsense"'):
        constraints.check(GrammarSpec("json_schema", '{"type": "nonsense"}', "tools", (good,)))
    source = constraints.check(GrammarSpec("regex", "[0-9]+", "structured_output.regex"))
    assert source is not None and (source.kind, source.source, source.field) == (
        "regex",
        "[0-9]+",
        "structured_output.regex",
    )
    with pytest.raises(ConstraintError, match="^structured_output.regex: this server has no tokenizer"):
        Constraints(None).check(GrammarSpec("regex", "[0-9]+", "structured_output.regex"))
