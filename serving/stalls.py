"""Calls whose client stopped reading are ended, so they cannot hold server capacity forever.

A server-streaming handler's write waits while the client's HTTP/2 window is full, and a client that
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
from typing import Any

import grpc

from serving.errors import StreamStalledError

logger = logging.getLogger(__name__)


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
