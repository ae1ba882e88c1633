"""Compiles requests' constraints (JSON schema, regex, EBNF) into xgrammar grammars, with bounded time.

xgrammar compiles most schemas in tens of milliseconds, but some (large bounded repetitions, big
alternations) take seconds or more, and a compile cannot be interrupted. So compiles run in a child
process (spawned on the first compile, kept for the next ones) that the caller waits on with a timeout:
a compile past `timeout_s` kills the child, which is restarted for the next compile, and the request
gets a `ConstraintError` naming its field. The child rebuilds the compiler from the serialized
`TokenizerInfo` and sends back each grammar serialized.

Compiled grammars are kept in an LRU cache keyed by (kind, spec), so a schema sent again costs a dict
lookup. `compile` blocks: call it from a validation thread, never the engine thread or the event loop.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from base.errors import InvalidRequestError
from engine.grammar import control_free_tokens
from engine.utf8_tokens import Utf8Tokens
from serving.errors import TierUnavailableError

if TYPE_CHECKING:
    import torch
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# What `compile` understands; `json_object` ignores its spec.
KINDS = ("json_schema", "json_object", "regex", "grammar")
# Any JSON object: xgrammar's builtin JSON grammar also admits arrays and scalars.
_ANY_OBJECT_SCHEMA = '{"type": "object"}'
# Seconds the child may take to start (import xgrammar and torch, rebuild the tokenizer info).
_START_TIMEOUT_S = 120.0
# xgrammar's messages start with "[16:04:06] /project/cpp/json_schema_converter.cc:5082: ".
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
_MAX_MESSAGE_CHARS = 500
_SHUT_DOWN = "the grammar compiler is shut down (the server is stopping)"


def clean_error_message(message: str) -> str:
    """xgrammar's error without its source location, shortened: what the client can act on."""
    text = _XGRAMMAR_PREFIX.sub("", message.strip())
    return text if len(text) <= _MAX_MESSAGE_CHARS else text[: _MAX_MESSAGE_CHARS - 3] + "..."


class ConstraintError(InvalidRequestError):
    """A constraint or tool definition that cannot be enforced; `field` is the request field at fault."""

    def __init__(self, field: str, detail: str) -> None:
        self.field = field
        super().__init__(f"{field}: {detail}")


class CompileTimeoutError(ConstraintError):
    """A constraint that xgrammar did not compile within the server's bound."""


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


def _child_main(conn: Connection, tokenizer_info_path: str) -> None:
    """The compile worker: answers ("ok", serialized grammar) or ("error", message) per (kind, spec).

    Exits when the server closes the pipe, or dies with it: a dead parent closes the pipe too.
    """
    import xgrammar as xgr

    with open(tokenizer_info_path, encoding="utf-8") as file:
        info = xgr.TokenizerInfo.deserialize_json(file.read())
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    conn.send(("ready", ""))
    while True:
        try:
            kind, spec = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = ("ok", compile_in_process(compiler, kind, spec).serialize_json())
        except Exception as exc:  # xgrammar raises RuntimeError, ValueError, TypeError for bad input
            reply = ("error", clean_error_message(str(exc)))
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return


class GrammarCompiler:
    """Compiled grammars for one model's vocabulary, cached, each compile bounded by `timeout_s`.

    The tokenizer info and the worker process (which imports xgrammar) take seconds to make, so they
    are made on the first compile and a server that never sees a constraint pays nothing.
    `close()` ends the worker; the server calls it when it stops.
    """

    def __init__(
        self,
        hf_tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Collection[int],
        timeout_s: float,
        cache_size: int,
        compile_observer: Callable[[float], None] | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self.compile_observer = compile_observer
        self._hf_tokenizer = hf_tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._info: xgr.TokenizerInfo | None = None
        self._control_free: torch.Tensor | None = None
        self._utf8: Utf8Tokens | None = None
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._cache_lock = threading.Lock()
        # One compile at a time through the worker; validation threads queue here.
        self._worker_lock = threading.Lock()
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        self._closed = False

    @property
    def tokenizer_info(self) -> xgr.TokenizerInfo:
        """The vocabulary as xgrammar sees it (built once, on first use)."""
        if self._info is None:
            import xgrammar as xgr

            started = time.perf_counter()
            self._info = xgr.TokenizerInfo.from_huggingface(
                self._hf_tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
            )
            logger.info("built the grammar vocabulary in %.2f s", time.perf_counter() - started)
        return self._info

    @property
    def control_free_tokens(self) -> torch.Tensor:
        """The bitmask row JSON grammars are ANDed with (see `engine.grammar.control_free_tokens`)."""
        if self._control_free is None:
            self._control_free = control_free_tokens(self.tokenizer_info)
        return self._control_free

    @property
    def utf8_tokens(self) -> Utf8Tokens:
        """What keeps constrained text valid UTF-8 in this vocabulary, shared by every grammar state."""
        if self._utf8 is None:
            self._utf8 = Utf8Tokens.of(self.tokenizer_info)
        return self._utf8

    @property
    def worker_pid(self) -> int | None:
        """The compile worker's process id while one runs (tests check it is gone after close)."""
        return self._process.pid if self._process is not None else None

    def compile(self, kind: str, spec: str, field: str) -> xgr.CompiledGrammar:
        """The compiled grammar for (kind, spec); a ConstraintError naming `field` when it cannot be."""
        if kind not in KINDS:
            raise ValueError(f"unknown grammar kind {kind!r}")
        key = (kind, spec)
        with self._cache_lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        with self._worker_lock:
            with self._cache_lock:  # compiled by another thread while this one waited
                cached = self._cache.get(key)
            if cached is not None:
                return cached
            started = time.perf_counter()
            compiled = self._compile_in_worker(kind, spec, field)
            seconds = time.perf_counter() - started
        logger.debug("compiled a %s grammar in %.3f s", kind, seconds)
        if self.compile_observer is not None:
            self.compile_observer(seconds)
        with self._cache_lock:
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile_in_worker(self, kind: str, spec: str, field: str) -> xgr.CompiledGrammar:
        import xgrammar as xgr

        conn = self._ensure_worker()
        try:
            conn.send((kind, spec))
            done = conn.poll(self.timeout_s)
            if done:
                status, payload = conn.recv()
        except (EOFError, OSError) as exc:
            self._stop_worker()
            if self._closed:
                raise TierUnavailableError(
                    "the grammar compiler is shut down (the server is stopping)"
                ) from None
            logger.error("the grammar compile worker died compiling a %s: %r", kind, exc)
            raise ConstraintError(field, "crashed the grammar compiler") from None
        if not done:
            self._stop_worker()
            logger.warning("a %s grammar did not compile within %g s; worker restarted", kind, self.timeout_s)
            raise CompileTimeoutError(
                field,
                f"did not compile within {self.timeout_s:g} s (--structured-output-compile-timeout); "
                "simplify it (smaller repetition bounds, fewer alternatives)",
            )
        if status == "error":
            raise ConstraintError(field, payload)
        return xgr.CompiledGrammar.deserialize_json(payload, self.tokenizer_info)

    def _ensure_worker(self) -> Connection:
        """The live worker's pipe, starting the worker first if there is none."""
        if self._closed:
            raise TierUnavailableError(_SHUT_DOWN)
        if self._conn is not None and self._process is not None and self._process.is_alive():
            return self._conn
        self._stop_worker()
        started = time.perf_counter()
        context = multiprocessing.get_context("spawn")
        parent_conn, child_conn = context.Pipe()
        # The vocabulary (megabytes for a large one) goes through a file: handed to Process.start(), a
        # child that died while starting would leave the parent blocked forever writing it to the child.
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".json", delete=False) as file:
            file.write(self.tokenizer_info.serialize_json())
        try:
            process = context.Process(
                target=_child_main, args=(child_conn, file.name), name="tandem-grammar-compiler", daemon=True
            )
            process.start()
            child_conn.close()
            self._process, self._conn = process, parent_conn
            try:
                ready = parent_conn.poll(_START_TIMEOUT_S) and parent_conn.recv()[0] == "ready"
            except (EOFError, OSError):
                ready = False
        finally:
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
            self._process.join(timeout=10)
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
