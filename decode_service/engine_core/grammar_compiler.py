"""Compiles constraints (JSON schema, regex, EBNF) into grammars over the served vocabulary, within
bounds of time and memory, in a worker process of the engine core's.

xgrammar compiles most schemas in milliseconds, but some (large bounded repetitions, big alternations)
take seconds to minutes and hundreds of MB, and a compile cannot be interrupted. So compiles run in a
child process (spawned on the first compile, kept for the next ones) that the caller waits on for at
most `timeout_s`: a compile past it kills the child, which is restarted for the next compile, and the
request gets a `CompileTimeoutError` naming its field. A child that made a large grammar is restarted
as well, so that what the compile took goes back to the system.

The child says it compiled (and the grammar's size: one larger than `max_grammar_bytes` is refused
there), then sends the grammar in xgrammar's JSON, so that is a constraint's only compile: the front
door parses it and no more (`front_door.constraints`), and the engine core's `GrammarGate` caches what
comes back. On SmolLM2's vocabulary writing the JSON costs about what the compile did and reading it a
quarter to a third, on one thread. The JSON can grow much faster than the grammar, though (27x, 1.1 GB
in 65 s, for a 42 MiB grammar on a tiny vocabulary): when it does not come within `timeout_s` either,
the child is restarted and the grammar, known now to compile within the timeout, is compiled again in
the caller's process. `compile` blocks: the gate calls it from its compile thread, one at a time.
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
# xgrammar's messages start with "[16:04:06] /project/cpp/json_schema_converter.cc:5082: ".
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
_MAX_MESSAGE_CHARS = 500
_SHUT_DOWN = "the grammar compiler is shut down (the server is stopping)"
_MIB = 2**20


@dataclass(frozen=True)
class GrammarConfig:
    """Bounds on constraints, read by the engine core's grammar gate and compiler.

    A constraint that does not compile within `structured_output_compile_timeout_s`, or whose compiled
    grammar is larger than `max_grammar_memory` bytes, is refused; a tenant may have at most
    `max_compiles_per_tenant` compiles waiting or running, and tenants take turns at the compiler. At
    most `grammar_cache_size` compiled grammars, and `grammar_cache_memory` bytes of them, are kept.
    """

    structured_output_compile_timeout_s: float = 10.0
    grammar_cache_size: int = 256
    grammar_cache_memory: int = 512 * 2**20
    max_grammar_memory: int = 64 * 2**20
    max_compiles_per_tenant: int = 4

    def validate(self) -> None:
        if not self.structured_output_compile_timeout_s > 0:
            raise ConfigError(
                "structured_output_compile_timeout_s must be > 0, got "
                f"{self.structured_output_compile_timeout_s}"
            )
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
    ("compiled", size, "") followed by ("grammar", size, the grammar's JSON); sizes in bytes.

    Exits when the core closes the pipe, or dies with it: a dead parent closes the pipe too.
    """
    import xgrammar as xgr

    with open(tokenizer_info_path, encoding="utf-8") as file:
        info = xgr.TokenizerInfo.deserialize_json(file.read())
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    conn.send(("ready", 0, ""))
    try:
        while True:
            kind, spec = conn.recv()
            try:
                compiled = compile_in_process(compiler, kind, spec)
            except Exception as exc:  # xgrammar raises RuntimeError, ValueError, TypeError for bad input
                conn.send(("error", 0, clean_error_message(str(exc))))
                continue
            size = compiled.memory_size_bytes
            if size > max_grammar_bytes:
                conn.send(("too_large", size, ""))
                continue
            conn.send(("compiled", size, ""))
            conn.send(("grammar", size, compiled.serialize_json()))
    except (EOFError, OSError):
        return


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
        json_timeout_s: float | None = None,
    ) -> None:
        """`json_timeout_s`: how long the grammar's JSON may take to arrive after the compile (default
        `timeout_s`)."""
        self.info = info
        self.timeout_s = timeout_s
        self.json_timeout_s = timeout_s if json_timeout_s is None else json_timeout_s
        self.max_grammar_bytes = max_grammar_bytes
        self.restart_above_bytes = restart_above_bytes
        self.compile_observer = compile_observer
        # Held by a compile while it uses the worker, and by `close`.
        self._worker_lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._closed = False
        # For grammars whose JSON the worker did not send in time, made on first use.
        self._here: xgr.GrammarCompiler | None = None

    @property
    def worker_pid(self) -> int | None:
        """The compile worker's process id while one runs (tests check it is gone after close)."""
        return self._process.pid if self._process is not None else None

    def compile(self, kind: str, spec: str, field: str) -> xgr.CompiledGrammar:
        """(kind, spec) compiled; a ConstraintError naming `field` when xgrammar refuses it, when it does
        not compile within `timeout_s` or is too large."""
        if kind not in KINDS:
            raise ValueError(f"unknown grammar kind {kind!r}")
        with self._worker_lock:
            status, size, message, seconds = self._compile_in_worker(kind, spec, field)
            # Read before anything here can raise: a JSON left in the pipe would answer the next compile.
            text = self._grammar_json(kind, size) if status == "compiled" else None
            if status == "too_large":
                self._restart_after(size)
        if self.compile_observer is not None:
            self.compile_observer(seconds)
        if status == "error":
            raise ConstraintError(field, message)
        if status == "too_large":
            raise GrammarTooLargeError(
                field,
                f"compiles to a grammar of {size / _MIB:.1f} MiB, above this server's limit of "
                f"{self.max_grammar_bytes / _MIB:.1f} MiB (--max-grammar-memory); simplify it (fewer "
                "enum values or alternatives, smaller repetition and length bounds)",
            )
        logger.debug("compiled a %s grammar of %d bytes in %.3f s", kind, size, seconds)
        if text is None:
            return self._compile_here(kind, spec)
        import xgrammar as xgr

        return xgr.CompiledGrammar.deserialize_json(text, self.info)

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

    def _grammar_json(self, kind: str, size: int) -> str | None:
        """The JSON the worker writes after it compiled, or None when it did not come within
        `json_timeout_s` (the worker is then restarted)."""
        text = None
        conn = self._conn
        try:
            if conn is not None and conn.poll(self.json_timeout_s):
                text = conn.recv()[2]
        except (EOFError, OSError):
            pass
        if text is None:
            logger.warning("a %s grammar of %d bytes was not sent in time; compiling it here", kind, size)
            self._stop_worker()
        else:
            self._restart_after(size)
        return text

    def _restart_after(self, size: int) -> None:
        """Restart the worker after a large grammar: what the compile took stays in its heap."""
        if size > self.restart_above_bytes:
            logger.info("restarting the grammar compile worker after a grammar of %d bytes", size)
            self._stop_worker()

    def _compile_here(self, kind: str, spec: str) -> xgr.CompiledGrammar:
        """Compile again in this process what the worker compiled within the timeout but did not send."""
        if self._here is None:
            import xgrammar as xgr

            # One thread: this compile shares the process with the engine's step threads.
            self._here = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        started = time.perf_counter()
        compiled = compile_in_process(self._here, kind, spec)
        if self.compile_observer is not None:
            self.compile_observer(time.perf_counter() - started)
        return compiled

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
