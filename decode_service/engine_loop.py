"""The engine loop: one thread that owns the engine and runs schedule → forward → deliver, step after step.

Model work never runs on the gRPC event loop. Handlers talk to this thread only through `submit` and
`abort` (a locked inbox the thread drains before each step), a remote prefill stage through `wake`
(its results wait in the stage until the step collects them), and the thread talks back through one `deliver`
call per step carrying every request's delta, so the per-token cost on the event loop side is one
wake-up per step, not one per token.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from decode_service.event_log import ChunkRecord, EventLog, StepRecord
from decode_service.request import ServedRequest, StreamDelta
from decode_service.scheduler import ContinuousScheduler, StepPlan
from engine.engine import Engine
from engine.errors import TandemError
from engine.sequence import FinishReason

logger = logging.getLogger(__name__)

DeliverFn = Callable[[list[StreamDelta]], None]


class EngineLoop:
    """Drives one engine with one scheduler; thread-safe entry points are `submit` and `abort`.

    `step_once` is public so tests can drive the loop synchronously without starting the thread.
    """

    def __init__(
        self, engine: Engine, scheduler: ContinuousScheduler, deliver: DeliverFn, event_log: EventLog
    ) -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.events = event_log
        self._deliver = deliver
        # A ServedRequest is a submission, a str the request_id of an abort.
        self._inbox: deque[ServedRequest | str] = deque()
        self._wakeup = threading.Condition()
        # Set by `wake`: the prefill stage has news (a remote prefill finished) for the next step.
        self._woken = False
        self._stopping = False
        self._ready = threading.Event()
        self._warm_up_error: Exception | None = None
        self._thread: threading.Thread | None = None
        self.num_steps = 0
        scheduler.prefill_stage.set_wakeup(self.wake)

    # -- thread-safe entry points --------------------------------------------------------------------

    def submit(self, request: ServedRequest) -> None:
        """Queue a validated request; it is scheduled from the next step on."""
        self._post(request)

    def abort(self, request_id: str) -> None:
        """Remove a request at the next step and free its blocks; its stream gets a final ABORT delta."""
        self._post(request_id)

    def wake(self) -> None:
        """Run a step soon even if no request arrives (thread-safe): the prefill stage has results."""
        with self._wakeup:
            self._woken = True
            self._wakeup.notify()

    def _post(self, command: ServedRequest | str) -> None:
        with self._wakeup:
            self._inbox.append(command)
            self._wakeup.notify()

    # -- lifecycle -----------------------------------------------------------------------------------

    def start(self, warm_up: bool = True) -> None:
        """Start the thread; with `warm_up` it first runs one tiny forward (see `wait_ready`)."""
        self._thread = threading.Thread(target=self._run, args=(warm_up,), name="engine-loop", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the warm-up forward is done; True when it is. Re-raises a failed warm-up's error."""
        ready = self._ready.wait(timeout)
        if self._warm_up_error is not None:
            raise self._warm_up_error
        return ready

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the thread after its current step; requests still live are aborted and told so."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("engine loop did not stop within %s s", timeout)

    def _run(self, warm_up: bool) -> None:
        try:
            if warm_up:
                self.warm_up()
        except Exception as exc:
            # The server must not report SERVING on an engine that cannot run a forward.
            logger.exception("warm-up forward failed")
            self._warm_up_error = exc
            return
        finally:
            self._ready.set()
        ran = False
        while True:
            if not ran:
                self._wait_for_input(self.scheduler.idle_wait_seconds())
            if self._stopping:
                break
            try:
                ran = self.step_once()
            except Exception:
                # A bug in scheduling must not silently kill the thread every stream waits on.
                logger.exception("engine loop step failed")
                ran = False
        self._abort_all()

    def _wait_for_input(self, timeout: float | None) -> None:
        with self._wakeup:
            if not self._inbox and not self._woken and not self._stopping:
                self._wakeup.wait(timeout)

    def warm_up(self) -> None:
        """One single-token forward and sample, so the first real request does not pay for lazy init."""
        self.engine.warm_up()
        logger.info("warm-up forward done")

    # -- one iteration -------------------------------------------------------------------------------

    def step_once(self) -> bool:
        """Apply queued submissions and aborts, admit finished remote prefills, then run one step;
        False when there was nothing to run."""
        deltas = self._drain_inbox()
        deltas.extend(self.scheduler.complete_prefills())
        plan = self.scheduler.schedule()
        if plan.chunks:
            try:
                outputs = self.engine.step(plan.chunks)
            except Exception as exc:
                logger.exception("engine step failed; failing the %d requests in it", len(plan.chunks))
                deltas.extend(self.scheduler.fail_step(plan, exc))
            else:
                deltas.extend(self.scheduler.complete_step(outputs))
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
        with self._wakeup:
            commands = list(self._inbox)
            self._inbox.clear()
            self._woken = False
        for command in commands:
            if isinstance(command, ServedRequest):
                try:
                    self.scheduler.add(command)
                except TandemError as exc:
                    deltas.append(StreamDelta(command, error=exc))
            else:
                deltas.extend(self._abort_now(command))
        return deltas

    def _abort_now(self, request_id: str) -> list[StreamDelta]:
        aborted = self.scheduler.abort(request_id)
        return [] if aborted is None else [StreamDelta(aborted, finish_reason=FinishReason.ABORT)]

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
                num_free_blocks=self.engine.block_manager.num_free_blocks,
                num_waiting=len(self.scheduler.waiting),
                preempted=tuple(r.request_id for r in plan.preempted),
                finished=tuple(d.request.request_id for d in deltas if d.is_last),
            )
        )
        self.num_steps += 1

    def _abort_all(self) -> None:
        deltas = self._drain_inbox()
        for request_id in self.scheduler.live_request_ids():
            deltas.extend(self._abort_now(request_id))
        if deltas:
            self._deliver_safely(deltas)

    def _deliver_safely(self, deltas: list[StreamDelta]) -> None:
        try:
            self._deliver(deltas)
        except Exception:
            logger.exception("delivering %d stream deltas failed", len(deltas))
