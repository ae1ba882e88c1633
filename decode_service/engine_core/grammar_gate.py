"""Compiles the grammars of constrained requests where the engine runs, on a thread of its own, before
the requests reach the engine loop.

The front door checked each constraint already (`GrammarCompiler`: it compiles within the request's time
budget and its grammar is not too large), but its worker answers only that verdict: a compiled grammar
is hundreds of MB once serialized, so it never crosses a pipe. The process that runs the engine (the
engine-core process, or the server's with `--engine-in-process`) compiles the spec once more, here.

A compile may take seconds and cannot be interrupted, so it never runs on the thread that reads the
front door's commands: `GrammarGate.submit` hands a request whose grammar is cached straight to the loop,
and queues the others for the compile thread, which hands each to the loop once compiled (xgrammar
releases the GIL while it compiles). Requests without a constraint pass at once, so they never wait
behind a compile. An abort of a request still compiling drops it: the loop delivers its final ABORT
delta, and its compile, if running, ends in the cache only.

Compiled grammars are cached by (kind, spec) in a `GrammarCache` bounded in bytes as well as entries.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from base.errors import InvalidRequestError, TandemError
from decode_service.engine_core.grammar_compiler import GrammarConfig, compile_in_process
from decode_service.engine_core.messages import GrammarSource
from engine.grammar import GrammarState, control_free_tokens
from engine.utf8_tokens import Utf8Tokens

if TYPE_CHECKING:
    import torch
    import xgrammar as xgr

    from decode_service.engine_core.engine_loop import EngineLoop
    from decode_service.engine_core.request import ServedRequest
    from engine.engine import Engine
    from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

GrammarKey = tuple[str, str]


class _CompileFailedError(InvalidRequestError):
    """A checked constraint that did not compile where the engine runs (the request ends with it)."""


class GrammarCache:
    """Compiled grammars by (kind, spec), least recently used dropped first, at most `max_entries` of
    them and `max_bytes` in all (each counted as xgrammar's `memory_size_bytes` plus its spec).

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

    def put(self, key: GrammarKey, compiled: xgr.CompiledGrammar) -> None:
        size = compiled.memory_size_bytes + len(key[0]) + len(key[1])
        if size > self.max_bytes or self.max_entries < 1:
            return
        with self._lock:
            previous = self._entries.pop(key, None)
            if previous is not None:
                self.num_bytes -= previous[1]
            self._entries[key] = (compiled, size)
            self.num_bytes += size
            while self.num_bytes > self.max_bytes or len(self._entries) > self.max_entries:
                _, (_, dropped) = self._entries.popitem(last=False)
                self.num_bytes -= dropped


@dataclass(frozen=True)
class _Vocabulary:
    """What every grammar of one vocabulary shares: the compiler and the masks ANDed with its own."""

    compiler: xgr.GrammarCompiler
    control_free: torch.Tensor
    utf8: Utf8Tokens


class GrammarGate:
    """The engine loop's way in: constrained requests wait here for their grammar, compiled on a thread
    of its own; the rest pass straight through.

    It has the loop's interface (`submit`, `abort`, `stop_at_string`; `start`, `wait_ready`, `stop`), so
    the server and the core process use it in the loop's place. `stop` drops the requests still
    compiling (each gets its ABORT delta) before it stops the loop.
    """

    def __init__(
        self, loop: EngineLoop, tokenizer: Tokenizer | None, vocab_size: int, cache: GrammarCache
    ) -> None:
        self.loop = loop
        self.cache = cache
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._vocabulary: _Vocabulary | None = None
        # Submitted and not yet handed to the loop (or dropped), in submission order.
        self._compiling: dict[ServedRequest, None] = {}
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[ServedRequest, GrammarSource] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        # Real compiles (cache misses), for the core's stats.
        self.num_compiles = 0

    @classmethod
    def for_engine(cls, loop: EngineLoop, engine: Engine, config: GrammarConfig) -> GrammarGate:
        cache = GrammarCache(config.grammar_cache_memory, config.grammar_cache_size)
        return cls(loop, engine.tokenizer, engine.vocab_size, cache)

    @property
    def num_compiling(self) -> int:
        """Requests waiting for their grammar (tests watch a compile hold one back)."""
        with self._lock:
            return len(self._compiling)

    # -- the engine loop's interface ---------------------------------------------------------------

    def submit(self, request: ServedRequest) -> None:
        """Hand `request` to the loop, once its grammar is compiled when it has one."""
        source = request.grammar
        if source is None or request.seq.grammar is not None:
            self.loop.submit(request)
            return
        with self._lock:
            compiled = self.cache.get((source.kind, source.source))
            if compiled is not None:
                request.seq.grammar = self._state(compiled, source)
                self.loop.submit(request)
                return
            self._compiling[request] = None
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="grammar-compile", daemon=True)
                self._thread.start()
        self._queue.put((request, source))

    def abort(self, request_id: str) -> None:
        """Abort a request, in the loop or still compiling (dropped: its stream gets its ABORT delta)."""
        with self._lock:
            dropped = [request for request in self._compiling if request.request_id == request_id]
            for request in dropped:
                del self._compiling[request]
                self.loop.drop(request)
            if not dropped:
                self.loop.abort(request_id)

    def stop_at_string(self, request_id: str, index: int, stop: str) -> None:
        self.loop.stop_at_string(request_id, index, stop)

    def start(self, warm_up: bool = True) -> None:
        self.loop.start(warm_up)

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self.loop.wait_ready(timeout)

    def stop(self, timeout: float | None = 10.0) -> None:
        """Drop the requests still compiling, end the compile thread (after its compile), stop the loop."""
        with self._lock:
            for request in self._compiling:
                self.loop.drop(request)
            self._compiling.clear()
        self._queue.put(None)
        self.loop.stop(timeout)

    # -- the compile thread --------------------------------------------------------------------------

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            request, source = item
            with self._lock:
                if request not in self._compiling:
                    continue  # aborted while it waited
            try:
                state = self._state(self._compiled(source), source)
            except Exception as exc:  # xgrammar's errors for a spec the front door found good are bugs
                logger.exception("a %s grammar the front door checked did not compile here", source.kind)
                self._hand_over(request, None, _CompileFailedError(f"the constraint did not compile: {exc}"))
                continue
            self._hand_over(request, state, None)

    def _hand_over(self, request: ServedRequest, state: GrammarState | None, error: Exception | None) -> None:
        """To the loop with its grammar, or dropped with `error`; not if it was aborted meanwhile."""
        with self._lock:
            if request not in self._compiling:
                return
            del self._compiling[request]
            if state is None:
                self.loop.drop(request, error)
                return
            request.seq.grammar = state
            self.loop.submit(request)

    def _compiled(self, source: GrammarSource) -> xgr.CompiledGrammar:
        key = (source.kind, source.source)
        compiled = self.cache.get(key)
        if compiled is None:
            started = time.perf_counter()
            compiled = compile_in_process(self._vocab().compiler, source.kind, source.source)
            self.num_compiles += 1
            logger.debug(
                "compiled a %s grammar of %d bytes in %.3f s",
                source.kind,
                compiled.memory_size_bytes,
                time.perf_counter() - started,
            )
            self.cache.put(key, compiled)
        return compiled

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
            compiler = xgr.GrammarCompiler(info, cache_enabled=False)
            self._vocabulary = _Vocabulary(compiler, control_free_tokens(info), Utf8Tokens.of(info))
        return self._vocabulary

    def _state(self, compiled: xgr.CompiledGrammar, source: GrammarSource) -> GrammarState:
        """A fresh state over `compiled`; JSON kinds also forbid control characters."""
        vocabulary = self._vocab()
        allowed = vocabulary.control_free if source.control_free else None
        key = (source.kind, source.source)
        return GrammarState(compiled, source.activate_after, allowed, key, vocabulary.utf8)
