"""The prefill engine loop: one thread owns the engine and runs admit → forward → report, step by step.

Model work never runs on the gRPC event loop. Handlers reach this thread only through `submit` and
`release` (a locked inbox drained before each step), and it reports back through one `deliver` call
per step carrying every job's events, so the event loop wakes once per step, not once per block.
Right after reporting a step it starts the next one: the event loop sends the KV of the step just
done while this thread computes the next chunk.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from engine.engine import Engine
from prefill_service.event_log import EventLog, StepRecord
from prefill_service.job import Admitted, PrefillJob
from prefill_service.kv_sender import mark_step_done
from prefill_service.scheduler import ChunkedPrefillScheduler, JobEvents, StepPlan
from serving.errors import DrainingError

logger = logging.getLogger(__name__)

DeliverFn = Callable[[JobEvents], None]


class PrefillEngineLoop:
    """Drives one engine with one chunked-prefill scheduler; `submit` and `release` are thread-safe.

    `step_once` is public so tests can drive the loop synchronously without starting the thread.
    """

    def __init__(
        self, engine: Engine, scheduler: ChunkedPrefillScheduler, deliver: DeliverFn, event_log: EventLog
    ) -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.events = event_log
        self._deliver = deliver
        self._inbox: deque[tuple[str, PrefillJob]] = deque()
        self._wakeup = threading.Condition()
        self._stopping = False
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self.num_steps = 0

    # -- thread-safe entry points --------------------------------------------------------------------

    def submit(self, job: PrefillJob) -> None:
        """Queue a validated job; it is considered for admission from the next step on."""
        self._post("submit", job)

    def release(self, job: PrefillJob) -> None:
        """The job's stream is over (sent, cancelled or failed): drop it and free its blocks."""
        self._post("release", job)

    def _post(self, command: str, job: PrefillJob) -> None:
        with self._wakeup:
            self._inbox.append((command, job))
            self._wakeup.notify()

    # -- lifecycle -----------------------------------------------------------------------------------

    def start(self, warm_up: bool = True) -> None:
        """Start the thread; with `warm_up` it first runs one tiny forward (see `wait_ready`)."""
        self._thread = threading.Thread(target=self._run, args=(warm_up,), name="prefill-engine", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the warm-up forward is done; True when it is."""
        return self._ready.wait(timeout)

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop after the current step; jobs not yet computed fail with DrainingError (UNAVAILABLE)."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("prefill engine loop did not stop within %s s", timeout)

    def _run(self, warm_up: bool) -> None:
        if warm_up:
            self.warm_up()
        self._ready.set()
        while True:
            with self._wakeup:
                if not self._inbox and not self._stopping and not self.scheduler.can_step():
                    self._wakeup.wait()
                if self._stopping:
                    break
            try:
                self.step_once()
            except Exception:
                # A bug in scheduling must not silently kill the thread every stream waits on.
                logger.exception("prefill engine loop step failed")
        self._fail_remaining()

    def warm_up(self) -> None:
        """One single-token forward and sample, so the first real request does not pay for lazy init."""
        self.engine.warm_up()
        logger.info("prefill warm-up forward done")

    # -- one iteration -------------------------------------------------------------------------------

    def step_once(self) -> bool:
        """Apply queued submissions and releases, admit, run one forward; False when nothing ran."""
        self._drain_inbox()
        plan = self.scheduler.schedule()
        if plan.admitted:
            # Before the forward, so the queue bound counts them as admitted while it runs.
            self._deliver_safely([(job, Admitted()) for job in plan.admitted])
        events: JobEvents = []
        failed = False
        if plan.chunks:
            try:
                outputs = self.engine.step(plan.chunks)
            except Exception as exc:
                logger.exception("prefill step failed; failing the %d requests in it", len(plan.chunks))
                events.extend(self.scheduler.fail_step(plan, exc))
                failed = True
            else:
                ready = mark_step_done(self.engine.device)
                events.extend(self.scheduler.complete_step(plan, outputs, ready))
            self._record(plan, failed)
        if events:
            self._deliver_safely(events)
        return bool(plan.chunks)

    def _drain_inbox(self) -> None:
        with self._wakeup:
            commands = list(self._inbox)
            self._inbox.clear()
        for command, job in commands:
            if command == "submit":
                self.scheduler.add(job)
            else:
                where = self.scheduler.release(job)
                logger.debug("released %r (was %s)", job, where)

    def _record(self, plan: StepPlan, failed: bool) -> None:
        self.events.append(
            StepRecord(
                step=self.num_steps,
                time=time.monotonic(),
                chunks=tuple((c.seq.request_id, c.num_tokens) for c in plan.chunks),
                num_free_blocks=self.engine.block_manager.num_free_blocks,
                num_waiting=len(self.scheduler.waiting),
                failed=failed,
            )
        )
        self.num_steps += 1

    def _fail_remaining(self) -> None:
        self._drain_inbox()
        events = self.scheduler.fail_all(
            DrainingError(
                "the prefill server stopped before this prompt was prefilled; retry on another replica"
            )
        )
        if events:
            self._deliver_safely(events)

    def _deliver_safely(self, events: JobEvents) -> None:
        try:
            self._deliver(events)
        except Exception:
            logger.exception("delivering %d prefill events failed", len(events))
