"""The decode engine loop: the engine thread running schedule → forward → deliver, step after step.

Handlers talk to it through `submit` and `abort`, a remote prefill stage through `wake` (its results
wait in the stage until the step collects them); each step delivers every request's delta at once.
The thread itself (inbox, warm-up, stop) is `serving.engine_thread.EngineThread`.

After the warm-up forward it measures what a step costs and sets the scheduler's token budget from it
(`engine.step_cost`), before any request is admitted: no step then comes near the engine heartbeat,
which the loop answers between steps, so a long prompt proves the core alive between its chunks.

It runs on a thread of the server process (`--engine-in-process`, tests) or of the engine-core process
(`engine_core.core.run_core`); the front door reaches either through `core.EngineCore.apply`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from base.errors import TandemError
from decode_service.engine_core.request import ServedRequest, StreamDelta
from decode_service.engine_core.scheduler import ContinuousScheduler, StepPlan
from decode_service.engine_core.step_record import ChunkRecord, StepRecord
from engine.engine import Engine
from engine.sequence import FinishReason
from engine.step_cost import Probe, TokenBudget, probe_step_cost, size_token_budget
from serving.engine_thread import Deliver, EngineThread
from serving.event_log import EventLog

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StopAtString:
    """The front door matched a stop string in a choice's text: the engine ends that choice."""

    request_id: str
    index: int
    stop: str


@dataclass(frozen=True)
class Heartbeat:
    """A liveness question: the loop calls `answer` when it next drains its inbox, so an answer proves
    the loop itself still iterates (a wedged step or a stopped process never answers)."""

    answer: Callable[[], None]


@dataclass(frozen=True)
class Dropped:
    """A submitted request the scheduler never sees (aborted while its grammar compiled, or its grammar
    did not compile): the loop delivers its final delta, ABORT or `error`, like any other."""

    request: ServedRequest
    error: Exception | None


class EngineLoop(
    EngineThread[ServedRequest | StopAtString | Heartbeat | Dropped | str, StreamDelta, StepRecord]
):
    """Drives one engine with one scheduler; thread-safe entry points are `submit`, `abort`,
    `stop_at_string`, `answer_heartbeat` and `wake`.

    The inbox holds submissions (a `ServedRequest`), stops (`StopAtString`), heartbeats (`Heartbeat`)
    and aborts (the request id).
    """

    thread_name = "engine-loop"

    def __init__(
        self,
        engine: Engine,
        scheduler: ContinuousScheduler,
        deliver: Deliver[StreamDelta],
        event_log: EventLog[StepRecord] | None,
        heartbeat_timeout_s: float | None = None,
        probe: Probe = probe_step_cost,
    ) -> None:
        """`event_log`: where each step's record goes; None records nothing (no one could read it).
        `heartbeat_timeout_s`: the engine heartbeat's timeout, which bounds the step (`engine.step_cost`);
        `probe` measures the step cost after warm-up (injectable: tests give a large model's cost)."""
        super().__init__(engine, deliver, event_log)
        self.scheduler = scheduler
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._probe = probe
        self.token_budget: TokenBudget | None = None
        scheduler.prefill_stage.set_wakeup(self.wake)

    def warm_up(self) -> None:
        """The warm-up forward, then the step cost probe and the token budget it gives (logged)."""
        super().warm_up()
        self.token_budget = size_token_budget(
            self.engine,
            floor=self.scheduler.max_num_seqs,
            fit=self.engine.config.fit_token_budget,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            probe=self._probe,
        )
        self.scheduler.set_token_budget(self.token_budget.tokens)

    def submit(self, request: ServedRequest) -> None:
        """Queue a validated request; it is scheduled from the next step on."""
        self._post(request)

    def abort(self, request_id: str) -> None:
        """Remove a request at the next step and free its blocks; its stream gets a final ABORT delta."""
        self._post(request_id)

    def stop_at_string(self, request_id: str, index: int, stop: str) -> None:
        """End choice `index` at the next step as stopped by `stop`; its stream gets a final STOP delta."""
        self._post(StopAtString(request_id, index, stop))

    def answer_heartbeat(self, answer: Callable[[], None]) -> None:
        """Call `answer` on the engine thread at the loop's next iteration (after the step now running)."""
        self._post(Heartbeat(answer))

    def drop(self, request: ServedRequest, error: Exception | None = None) -> None:
        """End a request that was never submitted (see `Dropped`): its stream gets its final delta from
        this thread, the one every delta comes from."""
        self._post(Dropped(request, error))

    def _idle_timeout(self) -> float | None:
        return self.scheduler.idle_wait_seconds()

    def step_once(self) -> bool:
        """Apply queued submissions and aborts, admit finished remote prefills, then run one step;
        False when there was nothing to run."""
        deltas = self._drain_inbox()
        try:
            deltas.extend(self.scheduler.complete_prefills())
            plan = self.scheduler.schedule()
        except Exception as exc:
            # Without this, the requests it touched would wait for a next event until their deadline.
            logger.exception("scheduling failed; ending every live request")
            deltas.extend(self.scheduler.fail_all(exc))
            self._deliver_safely(deltas)
            return False
        if plan.chunks:
            try:
                outputs = self.engine.step(plan.chunks)
            except Exception as exc:
                logger.exception("engine step failed; failing the %d requests in it", len(plan.chunks))
                deltas.extend(self.scheduler.fail_step(plan, exc))
            else:
                deltas.extend(self.scheduler.complete_step(outputs))
            if self.events is not None:
                self._record(plan, deltas)
        if deltas:
            self._deliver_safely(deltas)
        return bool(plan.chunks or plan.preempted)

    def run_until_idle(self, max_steps: int = 100_000) -> int:
        """Step in the calling thread until no request is live (tests and benchmarks); returns steps run."""
        steps = 0
        while (self._inbox or self.scheduler.has_work) and steps < max_steps:
            if not self.step_once():
                wait = self.scheduler.idle_wait_seconds()
                time.sleep(min(wait, 0.01) if wait is not None else 0.001)
            steps += 1
        return steps

    def _drain_inbox(self) -> list[StreamDelta]:
        deltas = []
        for command in self._take_inbox():
            if isinstance(command, ServedRequest):
                try:
                    self.scheduler.add(command)
                except TandemError as exc:
                    deltas.append(StreamDelta(command, error=exc))
            elif isinstance(command, StopAtString):
                stopped = self.scheduler.stop_at_string(command.request_id, command.index, command.stop)
                if stopped is not None:
                    deltas.append(StreamDelta(stopped, finish_reason=FinishReason.STOP))
            elif isinstance(command, Heartbeat):
                command.answer()
            elif isinstance(command, Dropped):
                finish = None if command.error is not None else FinishReason.ABORT
                deltas.append(StreamDelta(command.request, finish_reason=finish, error=command.error))
            else:
                deltas.extend(self._abort_now(command))
        return deltas

    def _abort_now(self, request_id: str) -> list[StreamDelta]:
        return [
            StreamDelta(aborted, finish_reason=FinishReason.ABORT)
            for aborted in self.scheduler.abort(request_id)
        ]

    def _record(self, plan: StepPlan, deltas: list[StreamDelta]) -> None:
        chunks = tuple(
            ChunkRecord(chunk.seq.request_id, chunk.num_tokens, kind)
            for chunk, kind in zip(plan.chunks, plan.kinds, strict=True)
        )
        self.events.append(
            StepRecord(
                step=self.num_steps,
                time=time.monotonic(),
                chunks=chunks,
                num_free_blocks=self.engine.num_free_blocks,
                num_waiting=len(self.scheduler.waiting),
                preempted=tuple(r.request_id for r in plan.preempted),
                finished=tuple(d.request.request_id for d in deltas if d.is_last),
            )
        )
        self.num_steps += 1

    def _on_stop(self) -> None:
        """Requests still live are aborted and told so."""
        deltas = self._drain_inbox()
        for request_id in self.scheduler.live_request_ids():
            deltas.extend(self._abort_now(request_id))
        if deltas:
            self._deliver_safely(deltas)
