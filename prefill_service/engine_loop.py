"""The prefill engine loop: the engine thread running admit → forward → report, step by step.

Handlers reach it through `submit` and `release`; each step reports every job's events at once.
Right after reporting a step it starts the next one: the event loop sends the KV of the step just
done while this thread computes the next chunk. The thread itself (inbox, warm-up with error
propagation, stop) is `serving.engine_thread.EngineThread`. After the warm-up forward it measures what
a step costs and sets the scheduler's token budget from it (`engine.step_cost`, the decode tier's rule):
a chunk of a large model never holds the thread, and every stream waiting on it, for long.
"""

from __future__ import annotations

import logging
import time

from engine.engine import Engine
from engine.step_cost import Probe, TokenBudget, probe_step_cost, size_token_budget
from prefill_service.job import Admitted, JobEvent, PrefillJob
from prefill_service.kv_sender import mark_step_done
from prefill_service.scheduler import ChunkedPrefillScheduler, JobEvents, StepPlan
from prefill_service.step_record import StepRecord
from serving.engine_thread import Deliver, EngineThread
from serving.errors import DrainingError
from serving.event_log import EventLog

logger = logging.getLogger(__name__)


class PrefillEngineLoop(EngineThread[tuple[str, PrefillJob], tuple[PrefillJob, JobEvent], StepRecord]):
    """Drives one engine with one chunked-prefill scheduler; `submit` and `release` are thread-safe."""

    thread_name = "prefill-engine"

    def __init__(
        self,
        engine: Engine,
        scheduler: ChunkedPrefillScheduler,
        deliver: Deliver[tuple[PrefillJob, JobEvent]],
        event_log: EventLog[StepRecord],
        probe: Probe = probe_step_cost,
    ) -> None:
        """`probe` measures the step cost after warm-up (injectable: tests give a large model's cost)."""
        super().__init__(engine, deliver, event_log)
        self.scheduler = scheduler
        self._probe = probe
        self.token_budget: TokenBudget | None = None

    def warm_up(self) -> None:
        """The warm-up forward, then the step cost probe and the token budget it gives (logged). The
        prefill tier has no heartbeat: the step target alone bounds its chunks."""
        super().warm_up()
        self.token_budget = size_token_budget(
            self.engine, floor=1, fit=self.engine.config.fit_token_budget, probe=self._probe
        )
        self.scheduler.max_num_batched_tokens = self.token_budget.tokens

    def submit(self, job: PrefillJob) -> None:
        """Queue a validated job; it is considered for admission from the next step on."""
        self._post(("submit", job))

    def release(self, job: PrefillJob) -> None:
        """The job's stream is over (sent, cancelled or failed): drop it and free its blocks."""
        self._post(("release", job))

    def _has_work(self) -> bool:
        return self.scheduler.can_step()

    def step_once(self) -> bool:
        """Apply queued submissions and releases, admit, run one forward; False when nothing ran."""
        self._drain_inbox()
        plan = self.scheduler.schedule()
        if plan.admitted:
            # Before the forward, so the queue bound counts them as admitted while it runs.
            self._deliver_safely([(job, Admitted()) for job in plan.admitted])
        events: JobEvents = plan.failed
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
        for command, job in self._take_inbox():
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
                num_free_blocks=self.engine.num_free_blocks,
                num_waiting=len(self.scheduler.waiting),
                failed=failed,
            )
        )
        self.num_steps += 1

    def _on_stop(self) -> None:
        """Jobs not yet computed fail with DrainingError (UNAVAILABLE)."""
        self._drain_inbox()
        events = self.scheduler.fail_all(
            DrainingError(
                "the prefill server stopped before this prompt was prefilled; retry on another replica"
            )
        )
        if events:
            self._deliver_safely(events)
