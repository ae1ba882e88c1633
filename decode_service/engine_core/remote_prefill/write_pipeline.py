"""Writing received KV frames into the cache while the next message is being received.

The receiver has two halves: gRPC turning the next message into bytes (on the event loop, holding the
GIL) and `KVTransfer.write` checking and copying the previous one into the cache (on the writer thread,
mostly without the GIL: CRC32C and numpy copies release it). Awaiting each write before asking gRPC for
the next message runs them one after the other; keeping one write in flight lets them overlap. More
than one would only hold more received messages in memory, since the single writer thread runs them in
order anyway.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor

from kv_transfer import KVFrame


class WritePipeline:
    """One transfer attempt's writes, at most one in flight; event loop only.

    Errors of a write (a rejected chunk, a cancelled transfer) are raised by the `put` or `flush` that
    waits for it, so at most one more message is received after a bad one. Leave through `flush` (all
    arrived) or `discard` (the attempt failed): either returns only once no write is running, so no
    write of this attempt can land after the caller moved on (to a retry, or to freeing the blocks).
    """

    def __init__(self, executor: Executor, write: Callable[[KVFrame], int]) -> None:
        self._executor = executor
        self._write = write
        self._in_flight: asyncio.Future[int] | None = None

    async def put(self, frame: KVFrame) -> int:
        """Start writing `frame`; returns the payload bytes of the previous write, which it waited for."""
        previous = self._in_flight
        self._in_flight = asyncio.get_running_loop().run_in_executor(self._executor, self._write, frame)
        if previous is None:
            return 0
        try:
            return await previous
        except BaseException:
            await self.discard()
            raise

    async def flush(self) -> int:
        """Wait for the write in flight; returns its payload bytes (0 when none was)."""
        in_flight, self._in_flight = self._in_flight, None
        return 0 if in_flight is None else await in_flight

    async def discard(self) -> None:
        """Wait for the write in flight, whatever its outcome: the attempt failed anyway."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            await asyncio.gather(in_flight, return_exceptions=True)
