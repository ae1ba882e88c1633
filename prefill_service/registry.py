"""The event-loop side of live Prefill calls: the bound on calls still queued, and fan-out of engine
events to each job's mailbox.

The shared part (drain, wait-until-empty, one wake-up per engine step) is
`serving.live_calls.LiveCallRegistry`.
"""

from __future__ import annotations

from prefill_service.job import Admitted, JobEvent, PrefillJob
from serving.errors import QueueFullError
from serving.live_calls import LiveCallRegistry


class JobRegistry(LiveCallRegistry[int, PrefillJob, tuple[PrefillJob, JobEvent]]):
    """Live jobs by key; at most `capacity` (the server's max_queue) of them not yet admitted to the
    running batch."""

    @property
    def num_queued(self) -> int:
        """Jobs accepted but not yet admitted to the running batch."""
        return sum(not job.admitted for job in self._calls.values())

    def open(self, job: PrefillJob) -> None:
        """Register a validated job, or refuse it when the queue is full or the server draining."""
        self.check_accepting()
        self._add(job.key, job)

    def close(self, job: PrefillJob) -> None:
        self._remove(job.key, job)

    def _check_capacity(self) -> None:
        queued = self.num_queued
        if queued >= self.capacity:
            raise QueueFullError(
                f"the prefill queue already holds {queued} requests, its limit; "
                "retry later or on another replica"
            )

    def _dispatch(self, events: list[tuple[PrefillJob, JobEvent]]) -> None:
        for job, event in events:
            if job.key not in self._calls:
                continue  # its call is already over
            if isinstance(event, Admitted):
                job.admitted = True
            else:
                job.events.put_nowait(event)
