"""Compiles the grammars of constrained requests where the engine runs, on a thread of its own, before
the requests reach the engine loop.

The front door only parsed each constraint (a bad schema is refused there, naming its field); the one
compile happens here, through the core's `GrammarCompiler` (a worker process, bounded in time and in
size). A compile may take seconds, so it never runs on the thread that reads the front door's commands:
`GrammarGate.submit` hands a request whose grammar is cached straight to the loop, and queues the others
for the compile thread, which hands each to the loop once compiled, or ends it with the compiler's error
(INVALID_ARGUMENT naming the field). Requests without a constraint pass at once, so they never wait
behind a compile.

Requests with the same constraint share its compile. Tenants take turns at the compiler (round robin),
and a tenant may have at most `max_compiles_per_tenant` distinct constraints waiting or compiling (more:
RESOURCE_EXHAUSTED), so a client sending slow schemas delays another tenant's new one by at most one
compile of its own. An abort of a request still waiting drops it (its stream gets its ABORT delta), and
a compile nobody waits for any more is not started.

Compiled grammars are cached by (kind, spec) in a `GrammarCache` bounded in resident bytes (each grammar
charged what the compile worker measured it to hold) as well as entries, and this process trims its heap
after a large compile or an eviction, so what they freed leaves its RSS. Constraints xgrammar refused
are remembered too, so that a repeated bad one costs no compile: by a digest of the spec and the error's
text (at most `grammar_cache_size` of them, about 600 bytes each), never by the spec, which may be
megabytes.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from base.errors import TandemError
from decode_service.engine_core.fill_vetting import vet_fill_cost
from decode_service.engine_core.grammar_compiler import (
    CompiledConstraint,
    CompileTimeoutError,
    ConstraintError,
    GrammarCompiler,
    GrammarConfig,
)
from decode_service.engine_core.messages import GrammarSource
from decode_service.engine_core.resident_memory import release_free_memory
from engine.grammar import GrammarState, control_free_tokens
from engine.grammar_budget import FillBudget
from engine.utf8_tokens import Utf8Tokens
from serving import tracing
from serving.errors import QueueFullError

if TYPE_CHECKING:
    import torch
    import xgrammar as xgr

    from decode_service.engine_core.engine_loop import EngineLoop
    from decode_service.engine_core.request import ServedRequest
    from engine.engine import Engine
    from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

GrammarKey = tuple[str, str]
# What a refused constraint is remembered by: its kind and the SHA-256 of its spec.
RefusalKey = tuple[str, bytes]
# After caching a grammar at least this large, or evicting any, the gate trims its heap: a trim walks the
# whole heap (40 ms for 1 GB of half-freed small blocks, AMD EPYC), too much for every small schema.
TRIM_AFTER_BYTES = 2**20


class GrammarCache:
    """Compiled grammars by (kind, spec), least recently used dropped first, at most `max_entries` of
    them and `max_bytes` in all (each counted as the resident bytes it was measured to hold, plus its
    spec).

    A grammar larger than the whole budget is not kept: the requests using it hold it while they run.
    Thread-safe.
    """

    def __init__(self, max_bytes: int, max_entries: int) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.num_bytes = 0
        self._entries: OrderedDict[GrammarKey, tuple[xgr.CompiledGrammar, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: GrammarKey) -> bool:
        return key in self._entries

    def get(self, key: GrammarKey) -> xgr.CompiledGrammar | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: GrammarKey, compiled: CompiledConstraint) -> int:
        """Keep `compiled` (unless it alone is over the budget); returns the bytes of what it evicted."""
        size = compiled.resident_bytes + len(key[0]) + len(key[1])
        if size > self.max_bytes or self.max_entries < 1:
            return 0
        evicted = 0
        with self._lock:
            previous = self._entries.pop(key, None)
            if previous is not None:
                self.num_bytes -= previous[1]
            self._entries[key] = (compiled.grammar, size)
            self.num_bytes += size
            while self.num_bytes > self.max_bytes or len(self._entries) > self.max_entries:
                _, (_, dropped) = self._entries.popitem(last=False)
                self.num_bytes -= dropped
                evicted += dropped
        return evicted


@dataclass(frozen=True)
class _Vocabulary:
    """What every grammar of one vocabulary shares: the compiler and the masks ANDed with its own."""

    compiler: GrammarCompiler
    control_free: torch.Tensor
    utf8: Utf8Tokens


@dataclass
class _Pending:
    """One constraint waiting for (or in) its compile, and the requests waiting for it, in order."""

    source: GrammarSource
    tenant: str
    requests: list[ServedRequest] = field(default_factory=list)
    started: bool = False


class GrammarGate:
    """The engine loop's way in: constrained requests wait here for their grammar, compiled on a thread
    of its own; the rest pass straight through.

    It has the loop's interface (`submit`, `abort`, `stop_at_string`; `start`, `wait_ready`, `stop`), so
    the server and the core process use it in the loop's place. `stop` drops the requests still
    waiting (each gets its ABORT delta), ends the compile worker and stops the loop.
    """

    def __init__(
        self,
        loop: EngineLoop,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        config: GrammarConfig,
        compile_observer: Callable[[float], None] | None = None,
    ) -> None:
        self.loop = loop
        self.config = config
        self.cache = GrammarCache(config.grammar_cache_memory, config.grammar_cache_size)
        # Seconds of each real compile (cache misses, refusals included): the compile metric.
        self.compile_observer = compile_observer
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._vocabulary: _Vocabulary | None = None
        # Constraints xgrammar refused (not timeouts), least recently refused first: the error's class and
        # detail (at most 500 characters: `clean_error_message`).
        self._refused: OrderedDict[RefusalKey, tuple[type[ConstraintError], str]] = OrderedDict()
        self._pending: dict[GrammarKey, _Pending] = {}
        # Tenants with constraints to compile, the next one's turn first; each tenant's in arrival order.
        self._turns: OrderedDict[str, deque[GrammarKey]] = OrderedDict()
        self._per_tenant: dict[str, int] = {}
        self._condition = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    @classmethod
    def for_engine(
        cls,
        loop: EngineLoop,
        engine: Engine,
        config: GrammarConfig,
        compile_observer: Callable[[float], None] | None = None,
    ) -> GrammarGate:
        return cls(loop, engine.tokenizer, engine.vocab_size, config, compile_observer)

    @property
    def num_compiling(self) -> int:
        """Requests waiting for their grammar (tests watch a compile hold one back)."""
        with self._condition:
            return sum(len(pending.requests) for pending in self._pending.values())

    @property
    def worker_pid(self) -> int | None:
        """The compile worker's process id while one runs."""
        return self._vocabulary.compiler.worker_pid if self._vocabulary is not None else None

    # -- the engine loop's interface ---------------------------------------------------------------

    def submit(self, request: ServedRequest) -> None:
        """Hand a constrained `request` to the loop once its grammar is compiled (a request without one
        goes to the loop directly: `EngineCore.apply`); raises the cached refusal of its constraint, or a
        QueueFullError when its tenant has too many compiles waiting."""
        source = request.grammar
        assert source is not None, "the gate takes constrained requests only"
        key = (source.kind, source.source)
        with self._condition:
            compiled = self.cache.get(key)
            if compiled is not None:
                request.seq.grammar = self._state(compiled, source)
                self.loop.submit(request)
                return
            refused = self._refused.get(_refusal_key(key))
            if refused is not None:
                error_type, detail = refused
                raise error_type(source.field, detail)
            pending = self._pending.get(key)
            if pending is None:
                self._queue(key, source, request.tenant)
                pending = self._pending[key]
            pending.requests.append(request)

    def _queue(self, key: GrammarKey, source: GrammarSource, tenant: str) -> None:
        """A new constraint for the compile thread, at the back of its tenant's queue."""
        count = self._per_tenant.get(tenant, 0)
        if count >= self.config.max_compiles_per_tenant:
            who = f"tenant {tenant!r}" if tenant else "requests without a tenant"
            raise QueueFullError(
                f"{who} already have {count} grammar compiles waiting or running, this server's limit "
                "(--max-compiles-per-tenant); retry later"
            )
        self._per_tenant[tenant] = count + 1
        self._pending[key] = _Pending(source, tenant)
        self._turns.setdefault(tenant, deque()).append(key)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="grammar-compile", daemon=True)
            self._thread.start()
        self._condition.notify_all()

    def abort(self, request_id: str) -> None:
        """Abort a request, in the loop or still waiting (dropped: its stream gets its ABORT delta)."""
        with self._condition:
            for key, pending in list(self._pending.items()):
                dropped = [request for request in pending.requests if request.request_id == request_id]
                if not dropped:
                    continue
                for request in dropped:
                    pending.requests.remove(request)
                    self.loop.drop(request)
                if not pending.requests and not pending.started:
                    self._forget(key, pending)
                return
        self.loop.abort(request_id)

    def stop_at_string(self, request_id: str, index: int, stop: str) -> None:
        self.loop.stop_at_string(request_id, index, stop)

    def start(self, warm_up: bool = True) -> None:
        self.loop.start(warm_up)

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self.loop.wait_ready(timeout)

    def stop(self, timeout: float | None = 10.0) -> None:
        """Drop the requests still waiting, end the compile worker and thread, stop the loop."""
        with self._condition:
            self._stopping = True
            for pending in self._pending.values():
                for request in pending.requests:
                    self.loop.drop(request)
                pending.requests.clear()
            self._condition.notify_all()
        if self._vocabulary is not None:
            self._vocabulary.compiler.close()
        self.loop.stop(timeout)

    # -- the compile thread --------------------------------------------------------------------------

    def _run(self) -> None:
        while (turn := self._next_turn()) is not None:
            key, pending = turn
            started = time.monotonic()
            try:
                compiled = self._compiled(key, pending.source)
            except Exception as exc:  # the compiler's refusals, and a shut-down or broken compiler
                self._hand_over(key, pending, None, exc, started)
            else:
                self._hand_over(key, pending, compiled, None, started)

    def _next_turn(self) -> tuple[GrammarKey, _Pending] | None:
        """The next tenant's oldest constraint still wanted (None: the gate stops); blocks for one."""
        with self._condition:
            while True:
                if self._stopping:
                    return None
                if self._turns:
                    tenant, keys = self._turns.popitem(last=False)
                    key = keys.popleft()
                    if keys:
                        self._turns[tenant] = keys  # to the back of the round
                    pending = self._pending.get(key)
                    if pending is not None:
                        pending.started = True
                        return key, pending
                else:
                    self._condition.wait()

    def _hand_over(
        self,
        key: GrammarKey,
        pending: _Pending,
        compiled: xgr.CompiledGrammar | None,
        error: Exception | None,
        started: float,
    ) -> None:
        """Each request still waiting for `key`: to the loop with its grammar, or ended with `error`; the
        compile (from `started`) is a span of each one's trace."""
        with self._condition:
            self._forget(key, pending)
            waiting = list(pending.requests)
            for request in waiting:
                source = request.grammar
                if compiled is not None and source is not None:
                    request.seq.grammar = self._state(compiled, source)
                    self.loop.submit(request)
                else:
                    self.loop.drop(request, _for_field(error, source))
        if tracing.enabled():
            attributes = {"tandem.grammar.kind": pending.source.kind}
            for request in waiting:
                span = tracing.start_span("grammar compile", request.traceparent, attributes, started)
                tracing.end_span(span, error=None if error is None else f"{type(error).__name__}: {error}")

    def _forget(self, key: GrammarKey, pending: _Pending) -> None:
        """`key` is no longer waited for: its tenant's count goes down (under the condition)."""
        if self._pending.get(key) is not pending:
            return
        del self._pending[key]
        count = self._per_tenant[pending.tenant] - 1
        if count:
            self._per_tenant[pending.tenant] = count
        else:
            del self._per_tenant[pending.tenant]

    def _compiled(self, key: GrammarKey, source: GrammarSource) -> xgr.CompiledGrammar:
        """`key`'s grammar from the cache or the compiler; a refusal xgrammar gave is remembered."""
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        try:
            compiled = self._vocab().compiler.compile(source.kind, source.source, source.field)
        except CompileTimeoutError:
            raise
        except ConstraintError as exc:
            with self._condition:
                self._refused[_refusal_key(key)] = (type(exc), exc.detail)
                while len(self._refused) > max(self.config.grammar_cache_size, 1):
                    self._refused.popitem(last=False)
            raise
        # Before anything can use it: a grammar whose masks are already slow to fill is refused, uncached.
        vet_fill_cost(self._state(compiled.grammar, source), source.field, self._fill_limit_s())
        evicted = self.cache.put(key, compiled)
        if evicted or compiled.resident_bytes >= TRIM_AFTER_BYTES:
            # What the evicted grammars freed (those no running request holds) and the heap the compile
            # left go back to the system: glibc would keep both in this process's RSS.
            release_free_memory()
        return compiled.grammar

    def _vocab(self) -> _Vocabulary:
        """The compiler and masks of the engine's vocabulary, built on first use (seconds, on this thread)."""
        if self._vocabulary is None:
            import xgrammar as xgr

            if self._tokenizer is None:
                raise TandemError("the engine has no tokenizer to compile grammars with")
            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer.hf,
                vocab_size=self._vocab_size,
                stop_token_ids=sorted(self._tokenizer.eos_token_ids),
            )
            compiler = GrammarCompiler(
                info,
                self.config.structured_output_compile_timeout_s,
                self.config.max_grammar_memory,
                compile_observer=self.compile_observer,
            )
            self._vocabulary = _Vocabulary(compiler, control_free_tokens(info), Utf8Tokens.of(info))
            if self._stopping:
                compiler.close()  # `stop` came while this was built: no worker is started after it
        return self._vocabulary

    def _state(self, compiled: xgr.CompiledGrammar, source: GrammarSource) -> GrammarState:
        """A fresh state over `compiled`; JSON kinds also forbid control characters."""
        vocabulary = self._vocab()
        allowed = vocabulary.control_free if source.control_free else None
        key = (source.kind, source.source)
        budget = FillBudget(self._fill_limit_s(), source.field)
        return GrammarState(compiled, source.activate_after, allowed, key, vocabulary.utf8, budget)

    def _fill_limit_s(self) -> float:
        return self.config.structured_output_fill_timeout_ms / 1000


def _refusal_key(key: GrammarKey) -> RefusalKey:
    return key[0], hashlib.sha256(key[1].encode("utf-8", "surrogatepass")).digest()


def _for_field(error: Exception | None, source: GrammarSource | None) -> Exception | None:
    """A constraint's error as one request sees it: naming that request's field (requests sharing a
    compile may have sent the same spec in different fields)."""
    if isinstance(error, ConstraintError) and source is not None:
        return type(error)(source.field, error.detail)
    return error
