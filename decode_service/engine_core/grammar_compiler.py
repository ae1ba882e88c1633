"""Checks that requests' constraints (JSON schema, regex, EBNF) compile, within bounds of time and memory,
with turns at the compiler shared fairly between tenants.

xgrammar compiles most schemas in tens of milliseconds, but some (large bounded repetitions, big
alternations) take seconds or more, and a compile cannot be interrupted. So the front door's compiles
run in a child process (spawned on the first compile, kept for the next ones) that the caller waits on
with the request's `CompileBudget`: a compile past it kills the child, which is restarted for the next
compile, and the request gets a `ConstraintError` naming its field.

The child answers a verdict, never a grammar: ok and the compiled grammar's size in bytes, or xgrammar's
error. Sent serialized, a 14 KB schema's grammar was 78-322 MB of JSON through a pipe; instead, the
process that runs the engine compiles the spec again on a thread of its own (`engine_core.grammar_gate`),
knowing now that it compiles within the bound. A grammar larger than `max_grammar_bytes` is refused, and
a child that made a large grammar is restarted, so that its memory goes back to the system.

One child serves every client, so turns at it go round robin across tenants (`FairTurns`), and a tenant
may have at most `max_per_tenant` compiles waiting or running at once (more: RESOURCE_EXHAUSTED): a client
sending slow schemas delays another tenant's new schema by at most one compile of its own.

Verdicts are kept in an LRU keyed by a digest of (kind, spec), so a schema sent again costs a dict lookup
and no turn. `compile` blocks: call it from a validation thread, never the engine thread or the event loop.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import re
import tempfile
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from base.errors import ConfigError, InvalidRequestError
from serving.errors import QueueFullError, TierUnavailableError

if TYPE_CHECKING:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerBase

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
    """Bounds on constraints, read by the front door's compiler and the core's grammar gate.

    A constraint that does not compile within `structured_output_compile_timeout_s` (one budget for all
    of a request's compiles), or whose compiled grammar is larger than `max_grammar_memory` bytes, is
    refused; a tenant may have at most `max_compiles_per_tenant` compiles waiting or running, and
    tenants take turns at the compiler. At most `grammar_cache_size` compiled grammars, and
    `grammar_cache_memory` bytes of them, are kept.
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
        super().__init__(f"{field}: {detail}")


class CompileTimeoutError(ConstraintError):
    """A constraint that xgrammar did not compile within the request's compile budget."""


class GrammarTooLargeError(ConstraintError):
    """A constraint whose compiled grammar is larger than the server allows one grammar to be."""


class CompileBudget:
    """The compile time one request may still spend in the worker: its constraint, and the compiles that
    find which of its tools fails, all come out of one timeout."""

    def __init__(self, seconds: float) -> None:
        self.total_s = seconds
        self.left_s = seconds

    def spend(self, seconds: float) -> None:
        self.left_s -= seconds


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
    """The compile worker: answers ("ok", grammar size in bytes) or ("error", message) per (kind, spec).

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
            reply: tuple[str, int | str] = ("ok", compile_in_process(compiler, kind, spec).memory_size_bytes)
        except Exception as exc:  # xgrammar raises RuntimeError, ValueError, TypeError for bad input
            reply = ("error", clean_error_message(str(exc)))
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return


class _Ticket:
    """One caller waiting for its turn."""

    granted = False


class FairTurns:
    """Whose compile runs next: tenants take turns (round robin), each tenant's callers in arrival order.

    A tenant may have at most `max_per_tenant` callers waiting or holding the turn; one more gets
    RESOURCE_EXHAUSTED at once rather than a place at the back of a long queue.
    """

    def __init__(self, max_per_tenant: int) -> None:
        self.max_per_tenant = max_per_tenant
        self._condition = threading.Condition()
        # Tenants with callers waiting, the next to be served first; each tenant's tickets in order.
        self._waiting: OrderedDict[str, deque[_Ticket]] = OrderedDict()
        self._counts: dict[str, int] = {}
        self._busy = False

    @property
    def busy(self) -> bool:
        """Whether a caller holds the turn."""
        with self._condition:
            return self._busy

    @property
    def num_waiting(self) -> int:
        """Callers waiting for a turn (tests wait for a queue to form)."""
        with self._condition:
            return sum(len(tickets) for tickets in self._waiting.values())

    @contextmanager
    def turn(self, tenant: str) -> Iterator[None]:
        """Hold the turn for the block; blocks while others hold it or are ahead in the round."""
        with self._condition:
            count = self._counts.get(tenant, 0)
            if count >= self.max_per_tenant:
                who = f"tenant {tenant!r}" if tenant else "requests without a tenant"
                raise QueueFullError(
                    f"{who} already have {count} grammar compiles waiting or running, this server's limit "
                    "(--max-compiles-per-tenant); retry later"
                )
            self._counts[tenant] = count + 1
            if self._busy:
                ticket = _Ticket()
                self._waiting.setdefault(tenant, deque()).append(ticket)
                self._condition.wait_for(lambda: ticket.granted)
            else:
                self._busy = True
        try:
            yield
        finally:
            with self._condition:
                self._counts[tenant] -= 1
                if not self._counts[tenant]:
                    del self._counts[tenant]
                self._pass_on()

    def _pass_on(self) -> None:
        """Give the turn to the first waiting caller of the next tenant in the round (or free it)."""
        if not self._waiting:
            self._busy = False
            return
        tenant, tickets = self._waiting.popitem(last=False)
        tickets.popleft().granted = True
        if tickets:
            self._waiting[tenant] = tickets  # to the back of the round
        self._condition.notify_all()


class GrammarCompiler:
    """Verdicts on constraints for one model's vocabulary: the compiled size in bytes, or why not.

    The tokenizer info and the worker process (which imports xgrammar) take seconds to make, so they are
    made on the first compile and a server that never sees a constraint pays nothing. `close()` ends the
    worker; the server calls it when it stops.
    """

    def __init__(
        self,
        hf_tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Collection[int],
        timeout_s: float,
        cache_size: int,
        compile_observer: Callable[[float], None] | None = None,
        max_grammar_bytes: int = 64 * _MIB,
        max_per_tenant: int = 4,
        restart_above_bytes: int = RESTART_ABOVE_BYTES,
    ) -> None:
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self.compile_observer = compile_observer
        self.max_grammar_bytes = max_grammar_bytes
        self.restart_above_bytes = restart_above_bytes
        self.turns = FairTurns(max_per_tenant)
        self._hf_tokenizer = hf_tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._info: xgr.TokenizerInfo | None = None
        # Digest of (kind, spec) -> compiled size in bytes: a few dozen bytes an entry, whatever the grammar.
        self._verdicts: OrderedDict[bytes, int] = OrderedDict()
        self._verdicts_lock = threading.Lock()
        # Held by the turn's holder while it uses the worker, and by `close`.
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
    def worker_pid(self) -> int | None:
        """The compile worker's process id while one runs (tests check it is gone after close)."""
        return self._process.pid if self._process is not None else None

    def compile(
        self, kind: str, spec: str, field: str, tenant: str = "", budget: CompileBudget | None = None
    ) -> int:
        """The size in bytes of (kind, spec)'s compiled grammar; a ConstraintError naming `field` when it
        does not compile within `budget` (a fresh one of `timeout_s` by default) or is too large, a
        QueueFullError when `tenant` has too many compiles waiting."""
        if kind not in KINDS:
            raise ValueError(f"unknown grammar kind {kind!r}")
        key = hashlib.blake2b(f"{kind}\0{spec}".encode(), digest_size=16).digest()
        size = self._cached(key)
        if size is None:
            with self.turns.turn(tenant):
                size = self._cached(key)  # compiled by another caller while this one waited
                if size is None:
                    with self._worker_lock:
                        size = self._compile_in_worker(
                            kind, spec, field, budget or CompileBudget(self.timeout_s)
                        )
                    self._remember(key, size)
        if size > self.max_grammar_bytes:
            raise GrammarTooLargeError(
                field,
                f"compiles to a grammar of {size / _MIB:.1f} MiB, above this server's limit of "
                f"{self.max_grammar_bytes / _MIB:.1f} MiB (--max-grammar-memory); simplify it (fewer enum "
                "values or alternatives, smaller repetition and length bounds)",
            )
        return size

    def _cached(self, key: bytes) -> int | None:
        with self._verdicts_lock:
            size = self._verdicts.get(key)
            if size is not None:
                self._verdicts.move_to_end(key)
            return size

    def _remember(self, key: bytes, size: int) -> None:
        with self._verdicts_lock:
            self._verdicts[key] = size
            while len(self._verdicts) > self.cache_size:
                self._verdicts.popitem(last=False)

    def _compile_in_worker(self, kind: str, spec: str, field: str, budget: CompileBudget) -> int:
        if budget.left_s <= 0:
            raise self._timeout(field, budget)
        conn = self._ensure_worker()
        started = time.perf_counter()
        try:
            conn.send((kind, spec))
            done = conn.poll(budget.left_s)
            if done:
                status, payload = conn.recv()
        except (EOFError, OSError) as exc:
            self._stop_worker()
            if self._closed:
                raise TierUnavailableError(_SHUT_DOWN) from None
            logger.error("the grammar compile worker died compiling a %s: %r", kind, exc)
            raise ConstraintError(field, "crashed the grammar compiler") from None
        finally:
            seconds = time.perf_counter() - started
            budget.spend(seconds)
        if not done:
            self._stop_worker()
            logger.warning("a %s grammar did not compile within %.3g s; worker restarted", kind, seconds)
            raise self._timeout(field, budget)
        if status == "error":
            raise ConstraintError(field, payload)
        logger.debug("compiled a %s grammar of %d bytes in %.3f s", kind, payload, seconds)
        if self.compile_observer is not None:
            self.compile_observer(seconds)
        if payload > self.restart_above_bytes:
            logger.info("restarting the grammar compile worker after a grammar of %d bytes", payload)
            self._stop_worker()
        return payload

    @staticmethod
    def _timeout(field: str, budget: CompileBudget) -> CompileTimeoutError:
        return CompileTimeoutError(
            field,
            f"did not compile within {budget.total_s:g} s (--structured-output-compile-timeout, for all of "
            "a request's constraints); simplify it (smaller repetition bounds, fewer alternatives)",
        )

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
