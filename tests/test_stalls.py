"""The stall watchdog: a write that waits past the timeout ends its call with StreamStalledError; calls
that keep writing, and calls that left their `with` block, are not touched."""

from __future__ import annotations

import asyncio

import pytest

from serving.errors import StreamStalledError
from serving.live_calls import StallWatchdog


class _Context:
    """A call's context whose writes finish at once, or never once `blocked`."""

    def __init__(self, blocked: bool = False) -> None:
        self.blocked = blocked
        self.written: list[str] = []

    async def write(self, message: str) -> None:
        if self.blocked:
            await asyncio.Event().wait()
        self.written.append(message)


def test_a_write_that_waits_past_the_timeout_ends_only_its_call():
    async def scenario() -> None:
        watchdog = StallWatchdog(0.1, "--stream-stall-timeout")
        watchdog.start()
        reader, stuck = _Context(), _Context(blocked=True)

        async def handler(context: _Context, messages: int) -> None:
            with watchdog.watch(context) as call:  # type: ignore[arg-type]
                for index in range(messages):
                    await call.write(f"m{index}")
                    await asyncio.sleep(0.02)

        try:
            healthy = asyncio.ensure_future(handler(reader, 20))
            with pytest.raises(StreamStalledError, match="--stream-stall-timeout"):
                await handler(stuck, 1)
            await healthy
        finally:
            await watchdog.stop()
        assert watchdog.num_stalled == 1
        assert reader.written == [f"m{index}" for index in range(20)] and stuck.written == []
        assert not watchdog._calls  # both calls left the watch

    asyncio.run(scenario())


def test_a_cancelled_call_is_not_reported_as_stalled():
    async def scenario() -> None:
        watchdog = StallWatchdog(60.0, "--stream-stall-timeout")
        watchdog.start()

        async def handler() -> None:
            with watchdog.watch(_Context(blocked=True)) as call:  # type: ignore[arg-type]
                await call.write("m")

        try:
            task = asyncio.ensure_future(handler())
            await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            await watchdog.stop()
        assert watchdog.num_stalled == 0 and not watchdog._calls

    asyncio.run(scenario())
