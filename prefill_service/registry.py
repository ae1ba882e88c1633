"""The event-loop side of live Prefill calls: who may join the queue, and fan-out of engine events.

Everything except `deliver_threadsafe` runs on the asyncio loop, so no lock is needed: the draining
and queue-bound checks and the insertion happen in one step between awaits.
"""

from __future__ import annotations

import asyncio
import logging

from prefill_service.job import Admitted, PrefillJob
from prefill_service.scheduler import JobEvents
from serving.errors import DrainingError, QueueFullError

logger = logging.getLogger(__name__)


class JobRegistry:
    """Live jobs by key, the bound on those still queued, and the drain flag."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_queue: int) -> None:
        self._loop = loop
        self.max_queue = max_queue
        self._jobs: dict[int, PrefillJob] = {}
        self._draining = False
        self._empty = asyncio.Event()
        self._empty.set()

    def __len__(self) -> int:
        return len(self._jobs)

    @property
    def num_queued(self) -> int:
        """Jobs accepted but not yet admitted to the running batch."""
        return sum(not job.admitted for job in self._jobs.values())

    def check_accepting(self) -> None:
        if self._draining:
            raise DrainingError(
                "the prefill server is draining and accepts no new requests; use another replica"
            )

    def open(self, job: PrefillJob) -> None:
        """Register a validated job, or refuse it when the queue is full or the server draining."""
        self.check_accepting()
        queued = self.num_queued
        if queued >= self.max_queue:
            raise QueueFullError(
                f"the prefill queue already holds {queued} requests, its limit; "
                "retry later or on another replica"
            )
        self._jobs[job.key] = job
        self._empty.clear()

    def close(self, job: PrefillJob) -> None:
        self._jobs.pop(job.key, None)
        if not self._jobs:
            self._empty.set()

    def begin_drain(self) -> None:
        self._draining = True

    async def wait_empty(self, timeout: float) -> bool:
        """Wait until no call is live; False if `timeout` seconds passed first."""
        try:
            await asyncio.wait_for(self._empty.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def deliver_threadsafe(self, events: JobEvents) -> None:
        """Called by the engine thread once per step: hand its events to the event loop in one wake-up."""
        try:
            self._loop.call_soon_threadsafe(self._dispatch, events)
        except RuntimeError:
            logger.debug("event loop closed; dropped %d prefill events", len(events))

    def _dispatch(self, events: JobEvents) -> None:
        for job, event in events:
            if job.key not in self._jobs:
                continue  # its call is already over
            if isinstance(event, Admitted):
                job.admitted = True
            else:
                job.events.put_nowait(event)
