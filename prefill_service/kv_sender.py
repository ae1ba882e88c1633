"""Turning KVReady events into KVChunk messages off the event loop, in step with the engine's writes.

Encoding (gather the blocks, copy to host bytes, CRC32C) runs on a small thread pool so the event loop
keeps serving other streams, one message at a time so a slow reader holds at most one staged message.
On CUDA the engine thread records an event after each step and the sender reads on its own stream
after waiting for that event: the copy to the host then waits only for the step that wrote the blocks,
not for whatever the engine has queued since, so transfer overlaps the next chunk's compute.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.kv_cache import KVCache
from kv_transfer import KVLayout, encode_blocks
from prefill_service.job import KVReady
from protos.tandem.internal.v1 import prefill_pb2


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
    """Encodes a request's KV blocks from the engine's cache into wire messages."""

    def __init__(
        self, kv_cache: KVCache, layout: KVLayout, device: torch.device, num_threads: int = 2
    ) -> None:
        self._kv_cache = kv_cache
        self._layout = layout
        self._device = device
        self._executor = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="kv-encode")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    async def messages(self, ready: KVReady) -> AsyncIterator[prefill_pb2.KVChunk]:
        """The KVChunk messages of the ready blocks, each encoded on the pool when the caller asks for it."""
        loop = asyncio.get_running_loop()
        chunks = await loop.run_in_executor(self._executor, self._start, ready)
        while True:
            chunk = await loop.run_in_executor(self._executor, self._next, chunks, ready)
            if chunk is None:
                return
            yield chunk

    def _start(self, ready: KVReady) -> Iterator[prefill_pb2.KVChunk]:
        with self._on_sender_stream(ready):
            return encode_blocks(
                self._kv_cache.k,
                self._kv_cache.v,
                ready.block_table,
                ready.block_start,
                ready.num_blocks,
                self._layout,
            )

    def _next(self, chunks: Iterator[prefill_pb2.KVChunk], ready: KVReady) -> prefill_pb2.KVChunk | None:
        with self._on_sender_stream(ready):
            return next(chunks, None)

    def _on_sender_stream(self, ready: KVReady) -> contextlib.AbstractContextManager:
        if self._stream is None:
            return contextlib.nullcontext()
        if ready.ready is not None:
            self._stream.wait_event(ready.ready)
        return torch.cuda.stream(self._stream)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
