"""Calls whose client stopped reading are ended, so they cannot hold server capacity forever.

A server-streaming handler's write waits while the client's HTTP/2 window is full, and a client that
never reads keeps it waiting forever, holding whatever the call holds (a decode slot, prefill KV
blocks). Handlers write through `StallWatchdog.write`; a watchdog task on the event loop cancels the
handler whose write has waited longer than `timeout`, and `write` turns that cancellation into a
`StreamStalledError`, so the handler's cleanup runs at once. The per-write cost is a dict insert and
delete; the watchdog wakes a few times per timeout.
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
    """Times every write of the handlers that use it; `flag` names the setting in error messages."""

    def __init__(self, timeout: float, flag: str) -> None:
        self.timeout = timeout
        self.flag = flag
        self._writing: dict[asyncio.Task[Any], float] = {}
        self._stalled: set[asyncio.Task[Any]] = set()
        self._task: asyncio.Task[None] | None = None
        self.num_stalled = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="stall-watchdog")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def write(self, context: grpc.aio.ServicerContext, message: Any) -> None:
        """`context.write(message)`, or StreamStalledError once it waited longer than the timeout."""
        task = asyncio.current_task()
        assert task is not None
        self._writing[task] = time.monotonic()
        try:
            await context.write(message)
        except asyncio.CancelledError:
            if task not in self._stalled:
                raise
            self._stalled.discard(task)
            raise StreamStalledError(
                f"the client read nothing for {self.timeout:g} s ({self.flag}); the call was ended"
            ) from None
        finally:
            self._writing.pop(task, None)

    async def _watch(self) -> None:
        interval = max(0.05, self.timeout / 4)
        while True:
            await asyncio.sleep(interval)
            cutoff = time.monotonic() - self.timeout
            for task, since in list(self._writing.items()):
                if since < cutoff:
                    del self._writing[task]
                    self._stalled.add(task)
                    self.num_stalled += 1
                    task.cancel()
