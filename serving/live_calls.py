"""The event-loop side of live calls: who may join (capacity, drain), fan-out of the engine thread's
events, waiting until every call is over, and ending calls whose client stopped reading.

Everything except `deliver_threadsafe` runs on the asyncio loop, so no lock is needed: the draining and
capacity checks and the insertion are one step between awaits.

Calls whose client stopped reading are ended (`StallWatchdog`), so they cannot hold server capacity
forever. A server-streaming handler's write waits while the client's HTTP/2 window is full, and a client that
never reads keeps it waiting forever, holding whatever the call holds (a decode slot, prefill KV
blocks). Handlers write through a `WatchedCall` (`with watchdog.watch(context) as call: await
call.write(message)`); a watchdog task on the event loop cancels the handler whose write has waited
longer than `timeout`, and `write` turns that cancellation into a `StreamStalledError`, so the
handler's cleanup runs at once. A write costs a clock read and two attribute stores (one record per
call, made once); the watchdog wakes a few times per timeout and looks at every watched call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from typing import Any, Generic, TypeVar

import grpc

from serving.errors import DrainingError, StreamStalledError

logger = logging.getLogger(__name__)

KeyT = TypeVar("KeyT")
CallT = TypeVar("CallT")
EventT = TypeVar("EventT")


class LiveCallRegistry(ABC, Generic[KeyT, CallT, EventT]):
    """Live calls by key, at most `capacity` of them by the tier's count (`_check_capacity`).

    A tier adds how a call is opened (its checks, its mailbox) and `_dispatch`: handing one step's
    events to the calls they belong to.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, capacity: int) -> None:
        self._loop = loop
        self.capacity = capacity
        self._calls: dict[KeyT, CallT] = {}
        self._draining = False
        self._empty = asyncio.Event()
        self._empty.set()

    def __len__(self) -> int:
        return len(self._calls)

    def __contains__(self, key: object) -> bool:
        return key in self._calls

    def check_accepting(self) -> None:
        """Raise DrainingError once the server drains: new calls go to another replica."""
        if self._draining:
            raise DrainingError(
                "the server is draining and accepts no new requests; retry on another replica"
            )

    def begin_drain(self) -> None:
        self._draining = True

    async def wait_empty(self, timeout: float) -> bool:
        """Wait until no call is live; False if `timeout` seconds passed first."""
        try:
            await asyncio.wait_for(self._empty.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def deliver_threadsafe(self, events: list[EventT]) -> None:
        """Called by the engine thread once per step: hand its events to the event loop in one wake-up."""
        try:
            self._loop.call_soon_threadsafe(self._dispatch, events)
        except RuntimeError:
            logger.debug("event loop closed; dropped %d events", len(events))

    def _add(self, key: KeyT, call: CallT) -> None:
        """Register a call after the capacity check (the tier's `open` checks `check_accepting` first)."""
        self._check_capacity()
        self._calls[key] = call
        self._empty.clear()

    def _remove(self, key: KeyT, call: CallT) -> None:
        """Forget `call` (not a newer call that reuses its key)."""
        if self._calls.get(key) is call:
            del self._calls[key]
        if not self._calls:
            self._empty.set()

    @abstractmethod
    def _check_capacity(self) -> None:
        """Raise QueueFullError when one more call would exceed what the tier holds."""

    @abstractmethod
    def _dispatch(self, events: list[EventT]) -> None:
        """On the event loop: route one step's events to their live calls; drop those of calls gone."""


class StallWatchdog:
    """Times every write of the calls it watches; `flag` names the setting in error messages."""

    def __init__(self, timeout: float, flag: str) -> None:
        self.timeout = timeout
        self.flag = flag
        self._calls: set[WatchedCall] = set()
        self._task: asyncio.Task[None] | None = None
        self.num_stalled = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="stall-watchdog")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def watch(self, context: grpc.aio.ServicerContext) -> WatchedCall:
        """The writer of the calling handler's `context`, watched while its `with` block runs."""
        task = asyncio.current_task()
        assert task is not None
        return WatchedCall(self, context, task)

    async def _watch(self) -> None:
        interval = max(0.05, self.timeout / 4)
        while True:
            await asyncio.sleep(interval)
            cutoff = time.monotonic() - self.timeout
            for call in list(self._calls):
                if call.writing_since is not None and call.writing_since < cutoff:
                    call.writing_since = None
                    call.stalled = True
                    self.num_stalled += 1
                    call.task.cancel()


class WatchedCall:
    """One handler's writes to its call, each timed by the watchdog."""

    __slots__ = ("_watchdog", "_context", "task", "writing_since", "stalled")

    def __init__(self, watchdog: StallWatchdog, context: grpc.aio.ServicerContext, task: asyncio.Task[Any]):
        self._watchdog = watchdog
        self._context = context
        self.task = task
        # Monotonic start of the write in progress; None between writes.
        self.writing_since: float | None = None
        # Set by the watchdog when it cancels the handler for this call.
        self.stalled = False

    def __enter__(self) -> WatchedCall:
        self._watchdog._calls.add(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._watchdog._calls.discard(self)

    async def write(self, message: Any) -> None:
        """`context.write(message)`, or StreamStalledError once it waited longer than the timeout."""
        self.writing_since = time.monotonic()
        try:
            await self._context.write(message)
        except asyncio.CancelledError:
            if not self.stalled:
                raise
            self.stalled = False
            raise StreamStalledError(
                f"the client read nothing for {self._watchdog.timeout:g} s ({self._watchdog.flag}); "
                "the call was ended"
            ) from None
        finally:
            self.writing_since = None
