"""Compiles constraints (JSON schema, regex, EBNF) into grammars over the served vocabulary, within
bounds of time and of resident memory, checked in a worker process of the engine core's.

xgrammar compiles most schemas in milliseconds, but some (large bounded repetitions, big alternations)
take seconds to minutes and hundreds of MB, and a compile cannot be interrupted. So each constraint is
compiled first in a child process (spawned on the first compile, kept for the next ones) that the
caller waits on for at most `timeout_s`: a compile past it kills the child, which is restarted for the
next compile, and the request gets a `CompileTimeoutError` naming its field. The child answers a
verdict only: xgrammar's error, or the grammar's size, as xgrammar estimates it and as the child's RSS
grew to hold it. A grammar whose larger figure is above `max_grammar_bytes` is refused; one that passes
is compiled again in the caller's process, known now to finish within the timeout and the size bound
(both compiles run on one thread, so the child's time is what the caller's will take).

No grammar crosses between the processes: xgrammar's JSON of a grammar grows much faster than the
grammar (a 14 KB `anyOf` schema of 2.7 MiB of grammar on a 49k-token vocabulary: 98 MiB of JSON, 13 s
and 1.4 GiB of peak RSS to write in the child, 4 s and 1.1 GiB more to read in the core), where a
second compile takes 0.2 s and a few MiB. A child that made a large grammar is restarted, so that what
the compile took goes back to the system (the gate trims the core's heap after a large one).
`compile` blocks: the gate calls it from its compile thread, one at a time.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from base.errors import ConfigError, InvalidRequestError
from decode_service.engine_core.resident_memory import release_free_memory, resident_bytes
from serving.errors import TierUnavailableError

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)

# What `compile` understands; `json_object` ignores its spec.
KINDS = ("json_schema", "json_object", "regex", "grammar")
# Any JSON object: xgrammar's builtin JSON grammar also admits arrays and scalars.
_ANY_OBJECT_SCHEMA = '{"type": "object"}'
# Seconds the child may take to start (import xgrammar and torch, rebuild the tokenizer info).
_START_TIMEOUT_S = 120.0
# A child that made a grammar larger than this is restarted: what the compile took stays in its heap.
RESTART_ABOVE_BYTES = 16 * 2**20
# Threads of each compile, the child's and the caller's alike: the caller shares its process with the
# engine's step threads, and the child's compile time must be what the caller's will take.
COMPILE_THREADS = 1
# xgrammar's messages start with "[16:04:06] /project/cpp/json_schema_converter.cc:5082: ".
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
_MAX_MESSAGE_CHARS = 500
_SHUT_DOWN = "the grammar compiler is shut down (the server is stopping)"
_MIB = 2**20


@dataclass(frozen=True)
class GrammarConfig:
    """Bounds on constraints, read by the engine core's grammar gate and compiler.

    A constraint that does not compile within `structured_output_compile_timeout_s`, or whose compiled
    grammar holds more than `max_grammar_memory` bytes resident, is refused; a tenant may have at most
    `max_compiles_per_tenant` compiles waiting or running, and tenants take turns at the compiler. At
    most `grammar_cache_size` compiled grammars, and `grammar_cache_memory` resident bytes of them, are
    kept. A request's token masks may take `structured_output_fill_timeout_ms` to fill per token, all its
    choices together (`engine.grammar_budget`; a grammar steep on a probe is refused: `fill_vetting`).
    """

    structured_output_compile_timeout_s: float = 10.0
    grammar_cache_size: int = 256
    grammar_cache_memory: int = 512 * 2**20
    max_grammar_memory: int = 64 * 2**20
    max_compiles_per_tenant: int = 4
    structured_output_fill_timeout_ms: float = 1000.0

    def validate(self) -> None:
        for name in ("structured_output_compile_timeout_s", "structured_output_fill_timeout_ms"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("grammar_cache_size", "grammar_cache_memory"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_grammar_memory", "max_compiles_per_tenant"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")


def clean_error_message(message: str) -> str:
    """xgrammar's error without its source location, shortened: what the client can act on."""
    text = _XGRAMMAR_PREFIX.sub("", message.strip())
    return text if len(text) <= _MAX_MESSAGE_CHARS else text[: _MAX_MESSAGE_CHARS - 3] + "..."


class ConstraintError(InvalidRequestError):
    """A constraint or tool definition that cannot be enforced; `field` is the request field at fault."""

    def __init__(self, field: str, detail: str) -> None:
        self.field = field
        self.detail = detail
        super().__init__(f"{field}: {detail}")


class CompileTimeoutError(ConstraintError):
    """A constraint that xgrammar did not compile within the request's compile budget."""


class GrammarTooLargeError(ConstraintError):
    """A constraint whose compiled grammar is larger than the server allows one grammar to be."""


@dataclass(frozen=True)
class CompiledConstraint:
    """A compiled grammar and the bytes it holds resident: what the compile worker's RSS grew by to hold
    it, or xgrammar's estimate (`memory_size_bytes`) where that is larger or /proc is missing."""

    grammar: xgr.CompiledGrammar
    resident_bytes: int


def compile_in_process(compiler: xgr.GrammarCompiler, kind: str, spec: str) -> xgr.CompiledGrammar:
    """One compile with `compiler`; JSON without free whitespace, so a model cannot pad forever."""
    if kind == "json_schema":
        return compiler.compile_json_schema(spec, any_whitespace=False)
    if kind == "json_object":
        return compiler.compile_json_schema(_ANY_OBJECT_SCHEMA, any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "grammar":
        return compiler.compile_grammar(spec)
    raise ValueError(f"unknown grammar kind {kind!r}")


def _child_main(conn: Connection, tokenizer_info_path: str, max_grammar_bytes: int) -> None:
    """The compile worker. Per (kind, spec) it answers ("error", 0, message), ("too_large", size, ""), or
    ("compiled", size, ""); size is the grammar's resident bytes (`_resident_size`). Never a grammar.

    Exits when the core closes the pipe, or dies with it: a dead parent closes the pipe too.
    """
    import xgrammar as xgr

    with open(tokenizer_info_path, encoding="utf-8") as file:
        info = xgr.TokenizerInfo.deserialize_json(file.read())
    compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)
    # What any first compile sets up once is not charged to the first grammar.
    compile_in_process(compiler, "json_object", "")
    release_free_memory()
    conn.send(("ready", 0, ""))
    try:
        while True:
            kind, spec = conn.recv()
            before = resident_bytes()
            try:
                compiled = compile_in_process(compiler, kind, spec)
            except Exception as exc:  # xgrammar raises RuntimeError, ValueError, TypeError for bad input
                conn.send(("error", 0, clean_error_message(str(exc))))
                continue
            size = _resident_size(compiled, before)
            del compiled
            release_free_memory()
            conn.send(("too_large" if size > max_grammar_bytes else "compiled", size, ""))
    except (EOFError, OSError):
        return


def _resident_size(compiled: xgr.CompiledGrammar, before: int | None) -> int:
    """Bytes `compiled` holds: this process's RSS growth since `before` with the compile's free memory
    trimmed, or xgrammar's estimate where that is larger (or the RSS is unknown)."""
    release_free_memory()
    after = resident_bytes()
    grown = after - before if after is not None and before is not None else 0
    return max(compiled.memory_size_bytes, grown)


class GrammarCompiler:
    """Compiled grammars for one vocabulary, made in a worker process under a time and a size bound.

    The worker (which imports xgrammar and reads the vocabulary) takes seconds to start, so it starts
    on the first compile: a server that never sees a constraint pays nothing. `close()` ends it.
    """

    def __init__(
        self,
        info: xgr.TokenizerInfo,
        timeout_s: float,
        max_grammar_bytes: int = 64 * _MIB,
        restart_above_bytes: int = RESTART_ABOVE_BYTES,
        compile_observer: Callable[[float], None] | None = None,
    ) -> None:
        """`compile_observer` gets the seconds of each constraint's compiles, the worker's and this
        process's together."""
        self.info = info
        self.timeout_s = timeout_s
        self.max_grammar_bytes = max_grammar_bytes
        self.restart_above_bytes = restart_above_bytes
        self.compile_observer = compile_observer
        # Held by a compile while it uses the worker, and by `close`.
        self._worker_lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._closed = False
        # This process's compiler, for the grammars the worker passed; made on first use.
        self._here: xgr.GrammarCompiler | None = None

    @property
    def worker_pid(self) -> int | None:
        """The compile worker's process id while one runs (tests check it is gone after close)."""
        return self._process.pid if self._process is not None else None

    def compile(self, kind: str, spec: str, field: str) -> CompiledConstraint:
        """(kind, spec) compiled; a ConstraintError naming `field` when xgrammar refuses it, when it does
        not compile within `timeout_s` or holds more than `max_grammar_bytes` resident."""
        if kind not in KINDS:
            raise ValueError(f"unknown grammar kind {kind!r}")
        with self._worker_lock:
            status, size, message, seconds = self._compile_in_worker(kind, spec, field)
            if status != "error":
                self._restart_after(size)
        if status == "error":
            self._observe(seconds)
            raise ConstraintError(field, message)
        if status == "too_large":
            self._observe(seconds)
            raise GrammarTooLargeError(
                field,
                f"compiles to a grammar of {size / _MIB:.1f} MiB, above this server's limit of "
                f"{self.max_grammar_bytes / _MIB:.1f} MiB (--max-grammar-memory); simplify it (fewer "
                "enum values or alternatives, smaller repetition and length bounds)",
            )
        started = time.perf_counter()
        grammar = self._compile_here(kind, spec)
        self._observe(seconds + time.perf_counter() - started)
        logger.debug("compiled a %s grammar of %d resident bytes in %.3f s", kind, size, seconds)
        return CompiledConstraint(grammar, size)

    def _observe(self, seconds: float) -> None:
        if self.compile_observer is not None:
            self.compile_observer(seconds)

    def _compile_in_worker(self, kind: str, spec: str, field: str) -> tuple[str, int, str, float]:
        """The worker's verdict on (kind, spec) and the seconds it took; restarts the worker when it ran
        past the timeout (raising it) or died."""
        conn = self._ensure_worker()
        started = time.perf_counter()
        done = False
        try:
            conn.send((kind, spec))
            done = conn.poll(self.timeout_s)
            if done:
                status, size, message = conn.recv()
        except (EOFError, OSError) as exc:
            self._stop_worker()
            if self._closed:
                raise TierUnavailableError(_SHUT_DOWN) from None
            logger.error("the grammar compile worker died compiling a %s: %r", kind, exc)
            raise ConstraintError(field, "crashed the grammar compiler") from None
        seconds = time.perf_counter() - started
        if not done:
            self._stop_worker()
            logger.warning("a %s grammar did not compile within %.3g s; worker restarted", kind, seconds)
            raise CompileTimeoutError(
                field,
                f"did not compile within {self.timeout_s:g} s (--structured-output-compile-timeout); "
                "simplify it (smaller repetition bounds, fewer alternatives)",
            )
        return status, size, message, seconds

    def _restart_after(self, size: int) -> None:
        """Restart the worker after a large grammar: what the compile took stays in its heap."""
        if size > self.restart_above_bytes:
            logger.info("restarting the grammar compile worker after a grammar of %d bytes", size)
            self._stop_worker()

    def _compile_here(self, kind: str, spec: str) -> xgr.CompiledGrammar:
        """Compile in this process what the worker passed (the gate trims the heap after it caches it)."""
        if self._here is None:
            import xgrammar as xgr

            self._here = xgr.GrammarCompiler(self.info, max_threads=COMPILE_THREADS, cache_enabled=False)
        return compile_in_process(self._here, kind, spec)

    def _ensure_worker(self) -> Connection:
        """The live worker's pipe, starting the worker first if there is none."""
        if self._closed:
            raise TierUnavailableError(_SHUT_DOWN)
        if self._conn is not None and self._process is not None and self._process.poll() is None:
            return self._conn
        self._stop_worker()
        started = time.perf_counter()
        # A process of its own (not multiprocessing's: the engine core's process is a daemon, which may
        # not have children), in a session of its own (a terminal's Ctrl-C goes to the server, which
        # ends it), talking over a socket pair. The vocabulary (megabytes for a large one) goes through
        # a file.
        ours, theirs = socket.socketpair()
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".json", delete=False) as file:
            file.write(self.info.serialize_json())
        try:
            command = [
                sys.executable,
                "-m",
                __name__,
                str(theirs.fileno()),
                file.name,
                str(self.max_grammar_bytes),
            ]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
            try:
                process = subprocess.Popen(
                    command, pass_fds=(theirs.fileno(),), env=env, start_new_session=True
                )
            except OSError:
                ours.close()
                raise
            parent_conn = Connection(ours.detach())
            self._process, self._conn = process, parent_conn
            try:
                ready = parent_conn.poll(_START_TIMEOUT_S) and parent_conn.recv()[0] == "ready"
            except (EOFError, OSError):
                ready = False
        finally:
            theirs.close()
            os.unlink(file.name)
        if not ready:
            self._stop_worker()
            raise TierUnavailableError("the grammar compile worker did not start; see the server log")
        logger.info("grammar compile worker %d started in %.2f s", process.pid, time.perf_counter() - started)
        return parent_conn

    def _stop_worker(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._process is not None:
            self._process.kill()
            self._process.wait(timeout=10)
            self._process = None

    def close(self) -> None:
        """End the worker; later compiles fail with UNAVAILABLE. Safe to call twice.

        The worker is killed first, so a compile in flight ends at once rather than at its timeout.
        """
        self._closed = True
        process = self._process
        if process is not None:
            process.kill()
        with self._worker_lock:
            self._stop_worker()


if __name__ == "__main__":
    # The worker, as `GrammarCompiler` starts it: socket fd, vocabulary file, grammar size limit.
    _child_main(Connection(int(sys.argv[1])), sys.argv[2], int(sys.argv[3]))
