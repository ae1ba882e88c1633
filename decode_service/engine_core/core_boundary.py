"""The core's side of its boundary with the front door, the same whichever process the core runs in.

The front door speaks `engine_core.messages` to every core: it sends `Submit`, `Abort`, `StopAt` and
`Ping`, and reads one `StepOut` per engine step. `CoreBoundary` turns those commands into the engine
loop's calls (a `Submit` becomes the core's own `ServedRequest` here, and only here) and each step's
`StreamDelta`s into one `StepOut`, which it hands to `send`: the pipe's writer thread in a core process
of its own (`core_main`), the front door's event loop in this one (`in_process`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

from decode_service.engine_core.config import CoreConfig
from decode_service.engine_core.core import EngineCore
from decode_service.engine_core.grammar_gate import GrammarGate
from decode_service.engine_core.messages import (
    Abort,
    ChoiceState,
    Command,
    CoreStats,
    Delta,
    Failure,
    Ping,
    Pong,
    Shutdown,
    StepOut,
    StopAt,
    Submit,
)
from decode_service.engine_core.request import ServedRequest, StreamDelta
from engine.engine import Engine
from engine.sequence import Sequence
from serving.status import status_for

Send = Callable[[StepOut | Pong], None]


def failure(error: Exception) -> Failure:
    """`error` as the front door reports it: its gRPC status and message."""
    code, message = status_for(error)
    return Failure(code.name, message, getattr(error, "field", None))


def served_request(command: Submit) -> ServedRequest:
    """The core's live request for a submission the front door validated."""
    seq = Sequence(
        command.request_id,
        command.prompt_token_ids,
        command.sampling,
        command.stopping,
        command.arrival_time,
        command.cache_salt,
    )
    return ServedRequest(
        seq,
        priority=command.priority,
        tenant=command.tenant,
        arrival_time=command.arrival_time,
        n=command.n,
        submission=command.submission,
        grammar=command.grammar,
    )


def to_delta(delta: StreamDelta) -> Delta:
    """One choice's step as it crosses the boundary; its state only on the choice's first and last
    deltas, the ones whose readers need it (time to first token, usage, timings, stop)."""
    request = delta.request
    seq = request.seq
    state = None
    if delta.is_last or seq.num_output_tokens == len(delta.token_ids):
        state = ChoiceState(
            seq.num_cached_tokens,
            seq.matched_stop,
            request.admitted_time,
            request.prefill_done_time,
            request.first_token_time,
            request.num_preemptions,
            request.forked,
        )
    return Delta(
        request.stream_owner.submission,
        request.index,
        delta.token_ids,
        [(lp.token_id, lp.logprob, lp.top) for lp in delta.logprobs] if delta.logprobs else [],
        delta.finish_reason.value if delta.finish_reason is not None else None,
        failure(delta.error) if delta.error is not None else None,
        state,
    )


class CoreBoundary:
    """One engine core behind the front door's messages: `apply` takes a command, `send` gets each
    step's `StepOut` (from the engine thread) and each heartbeat's `Pong` (from the engine loop).

    Requests with a constraint go through the core's `GrammarGate`, which compiles it on its own thread,
    never on the caller's.
    """

    def __init__(
        self,
        engine: Engine,
        config: CoreConfig,
        send: Send,
        model_fingerprint: str | None = None,
        record_steps: bool = True,
    ) -> None:
        """`record_steps`: keep `EngineCore.events` (only an in-process observer can read them)."""
        self._send = send
        self._fills: list[float] = []
        # Appended by the grammar gate's compile thread, taken by the engine thread.
        self._compiles: list[float] = []
        self._compiles_lock = threading.Lock()
        engine.grammar_fill_observer = self._observe_fill
        self.core = EngineCore(engine, config, self._step_done, model_fingerprint, record_steps)
        self.grammars = GrammarGate.for_engine(self.core.loop, engine, config.grammar, self._observe_compile)

    def stats(self) -> CoreStats:
        return self.core.stats()

    def apply(self, command: Command) -> bool:
        """Hand `command` to the engine loop; False for `Shutdown` (the caller stops the core)."""
        loop = self.core.loop
        if isinstance(command, Submit):
            try:
                self.grammars.submit(served_request(command))
            except Exception as exc:
                self._refuse(command, exc)
        elif isinstance(command, Abort):
            self.grammars.abort(command.request_id)
        elif isinstance(command, StopAt):
            loop.stop_at_string(command.request_id, command.index, command.stop)
        elif isinstance(command, Ping):
            # Answered from the engine loop, not from here: the answer proves the loop steps.
            loop.answer_heartbeat(functools.partial(self._send, Pong(command.number)))
        elif isinstance(command, Shutdown):
            return False
        return True

    def _observe_fill(self, seconds: float) -> None:
        """The engine's observer of a step's mask fill; the step's `StepOut` carries them."""
        self._fills.append(seconds)

    def _observe_compile(self, seconds: float) -> None:
        """The grammar gate's observer of a compile; the next `StepOut` carries them."""
        with self._compiles_lock:
            self._compiles.append(seconds)

    def _taken_compiles(self) -> list[float]:
        with self._compiles_lock:
            compiles, self._compiles = self._compiles, []
        return compiles

    def _step_done(self, deltas: list[StreamDelta]) -> None:
        """The engine loop's `deliver`: converts on the engine thread, since `to_delta` reads request fields
        the next step changes; whoever `send` is encodes later, elsewhere."""
        fills, self._fills = self._fills, []
        compiles = self._taken_compiles() if self._compiles else []  # no lock on a step without one
        self._send(StepOut([to_delta(d) for d in deltas], self.stats(), fills, compiles))

    def _refuse(self, command: Submit, error: Exception) -> None:
        state = ChoiceState(0, None, None, None, None, 0, False)
        delta = Delta(command.submission, 0, [], [], None, failure(error), state)
        self._send(StepOut([delta], self.stats(), []))
