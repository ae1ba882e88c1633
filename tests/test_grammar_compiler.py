"""The grammar compile service: cached, bounded in time by a worker process, errors naming the field."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import xgrammar as xgr
from tiny_tokenizer import TINY_EOS_TOKEN_IDS, TINY_VOCAB_SIZE, build_tiny_tokenizer

from decode_service.engine_core.grammar_compiler import GrammarCompiler, clean_error_message
from decode_service.front_door.constraints import CompileTimeoutError, ConstraintError
from engine.tokenizer import Tokenizer

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


def process_exists(pid: int) -> bool:
    """True while `pid` runs (a zombie, reaped or not, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_each_kind_compiles_to_what_it_says(compiler: GrammarCompiler) -> None:
    schema = compiler.compile("json_schema", SCHEMA, "structured_output.json_schema")
    assert accepts(schema, '{"city": "Paris"}') and not accepts(schema, '{"town": "Paris"}')
    any_object = compiler.compile("json_object", "", "structured_output.json_object")
    assert accepts(any_object, '{"a": [1, {"b": null}]}')
    assert not accepts(any_object, "[1]") and not accepts(any_object, '"text"')
    regex = compiler.compile("regex", "[0-9]{3}-[a-z]+", "structured_output.regex")
    assert accepts(regex, "123-abc") and not accepts(regex, "12-abc")
    grammar = compiler.compile("grammar", 'root ::= "yes" | "no"', "structured_output.grammar")
    assert accepts(grammar, "no") and not accepts(grammar, "maybe")


def test_a_repeated_spec_is_served_from_the_cache(tokenizer: Tokenizer) -> None:
    seconds: list[float] = []
    compiler = make_compiler(tokenizer, cache_size=2, compile_observer=seconds.append)
    try:
        first = compiler.compile("regex", "a+", "f")
        started = time.perf_counter()
        assert compiler.compile("regex", "a+", "f") is first
        hit_seconds = time.perf_counter() - started
        assert len(seconds) == 1 and seconds[0] > 0
        assert hit_seconds < 0.01, hit_seconds
        # LRU: touching a+ keeps it while b+ is evicted by c+.
        compiler.compile("regex", "b+", "f")
        compiler.compile("regex", "a+", "f")
        compiler.compile("regex", "c+", "f")
        assert len(seconds) == 3
        assert compiler.compile("regex", "a+", "f") is first
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
    assert accepts(compiler.compile("regex", "ok", "f"), "ok")


def test_clean_error_message_strips_the_source_location() -> None:
    raw = (
        "[16:04:06] /project/cpp/json_schema_converter.cc:5077: Check failed: (error.empty()) is false: Bad\n"
    )
    assert clean_error_message(raw) == "Bad"
    assert clean_error_message("x" * 2000).endswith("...")


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
        assert accepts(compiler.compile("regex", "[0-9]+", "f"), "42")
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
