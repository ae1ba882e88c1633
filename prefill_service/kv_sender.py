"""Turning KVReady events into KV frames off the event loop, in step with the engine's writes.

Each event's blocks go out group by group; a sliding-window group's blocks that slide out before the
decode tier's first query are left out (`kv_transfer.wire.plan_transfer`).

Encoding (copy the blocks into the message's bytes, CRC32C) runs on a small thread pool so the event
loop keeps serving other streams, one message ahead of the stream so a slow reader holds at most two
built messages. On CUDA the engine thread records an event after each step and the sender reads on its own
stream after waiting for that event: the copy to the host then waits only for the step that wrote the
blocks, not for whatever the engine has queued since, so transfer overlaps the next chunk's compute.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.kv_cache import KVCache
from kv_transfer import MAX_MESSAGE_BYTES, KVFrame, KVLayout, PagedKV
from prefill_service.job import KVReady


def mark_step_done(device: torch.device) -> object | None:
    """After a step, on the engine thread: a marker the sender waits on before reading the step's KV.

    None on the CPU, where a step's writes are complete when it returns.
    """
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class KVSender:
    """Encodes a request's KV blocks from the engine's cache into wire frames."""

    def __init__(
        self,
        kv_cache: KVCache,
        layout: KVLayout,
        device: torch.device,
        num_threads: int = 2,
        max_payload_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        self._blocks = PagedKV.of(kv_cache, layout)
        self._max_payload_bytes = max_payload_bytes
        self._executor = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="kv-encode")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    async def frames(self, ready: KVReady) -> AsyncIterator[KVFrame]:
        """The frames of the ready blocks, built on the pool one ahead of the caller.

        While the caller sends a frame (gRPC copies it and writes it to the socket on the event loop), the
        pool builds the next one; without that the two would take turns. A frame being built when the
        caller stops early is dropped: it only read the blocks.
        """
        loop = asyncio.get_running_loop()
        frames = await loop.run_in_executor(self._executor, self._start, ready)
        upcoming = loop.run_in_executor(self._executor, self._next, frames, ready)
        try:
            while (frame := await upcoming) is not None:
                upcoming = loop.run_in_executor(self._executor, self._next, frames, ready)
                yield frame
        finally:
            upcoming.cancel()

    def _start(self, ready: KVReady) -> Iterator[KVFrame]:
        return self._blocks.frames(
            ready.block_tables,
            ready.block_start,
            ready.num_blocks,
            num_tokens=ready.num_tokens,
            max_payload_bytes=self._max_payload_bytes,
        )

    def _next(self, frames: Iterator[KVFrame], ready: KVReady) -> KVFrame | None:
        with self._on_sender_stream(ready):
            return next(frames, None)

    def _on_sender_stream(self, ready: KVReady) -> contextlib.AbstractContextManager:
        if self._stream is None:
            return contextlib.nullcontext()
        if ready.ready is not None:
            self._stream.wait_event(ready.ready)
        return torch.cuda.stream(self._stream)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
