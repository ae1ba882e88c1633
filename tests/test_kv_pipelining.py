"""Both ends of a KV stream work one message ahead: the sender builds the next frame while the current one
is sent, the receiver receives the next message while the previous one is written."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from decode_service.engine_core.remote_prefill.write_pipeline import WritePipeline
from engine.kv_cache import KVCache
from kv_transfer import KVChecksumError, KVLayout, PagedKV
from prefill_service.job import KVReady
from prefill_service.kv_sender import KVSender

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
WAIT_S = 10.0


class GatedWrites:
    """A write function that records what it wrote and can be held at its start until released."""

    def __init__(self, fail_on: object = None) -> None:
        self.written: list[object] = []
        self.started = threading.Semaphore(0)
        self.release = threading.Event()
        self.release.set()
        self._fail_on = fail_on

    def __call__(self, frame: object) -> int:
        self.started.release()
        assert self.release.wait(WAIT_S)
        if frame == self._fail_on:
            raise KVChecksumError(f"bad frame {frame}")
        self.written.append(frame)
        return len(str(frame))


def _run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, WAIT_S))


def test_writes_run_in_order_and_report_the_bytes_of_the_one_waited_for() -> None:
    writes = GatedWrites()

    async def scenario() -> list[int]:
        with ThreadPoolExecutor(1) as executor:
            pipeline = WritePipeline(executor, writes)
            counts = [await pipeline.put(frame) for frame in ("a", "bb", "ccc")]
            counts.append(await pipeline.flush())
            counts.append(await pipeline.flush())
        return counts

    assert _run(scenario()) == [0, 1, 2, 3, 0]
    assert writes.written == ["a", "bb", "ccc"]


def test_the_next_message_is_taken_while_the_previous_one_is_written_but_no_further() -> None:
    writes = GatedWrites()
    writes.release.clear()

    async def scenario() -> None:
        with ThreadPoolExecutor(1) as executor:
            pipeline = WritePipeline(executor, writes)
            assert await pipeline.put("first") == 0  # returns while "first" is still being written
            assert writes.started.acquire(timeout=WAIT_S)
            second = asyncio.ensure_future(pipeline.put("second"))
            await asyncio.sleep(0.05)
            assert not second.done()  # a third message must wait for "first"
            writes.release.set()
            assert await second == len("first")
            assert await pipeline.flush() == len("second")

    _run(scenario())


def test_a_failed_write_is_raised_by_the_next_put_and_nothing_stays_in_flight() -> None:
    writes = GatedWrites(fail_on="bad")

    async def scenario() -> None:
        with ThreadPoolExecutor(1) as executor:
            pipeline = WritePipeline(executor, writes)
            await pipeline.put("bad")
            with pytest.raises(KVChecksumError, match="bad frame bad"):
                await pipeline.put("after")
            # "after" was written before put returned: nothing of this attempt runs any more.
            assert writes.written == ["after"]
            assert await pipeline.flush() == 0

    _run(scenario())


def test_a_failed_last_write_is_raised_by_flush() -> None:
    writes = GatedWrites(fail_on="bad")

    async def scenario() -> None:
        with ThreadPoolExecutor(1) as executor:
            pipeline = WritePipeline(executor, writes)
            await pipeline.put("ok")
            await pipeline.put("bad")
            with pytest.raises(KVChecksumError):
                await pipeline.flush()

    _run(scenario())


def test_discard_waits_for_the_write_in_flight_and_swallows_its_error() -> None:
    writes = GatedWrites(fail_on="bad")
    writes.release.clear()

    async def scenario() -> None:
        with ThreadPoolExecutor(1) as executor:
            pipeline = WritePipeline(executor, writes)
            await pipeline.put("bad")
            assert writes.started.acquire(timeout=WAIT_S)
            discarded = asyncio.ensure_future(pipeline.discard())
            await asyncio.sleep(0.05)
            assert not discarded.done()  # the write is still running: the caller must not move on
            writes.release.set()
            await discarded
            await pipeline.discard()  # nothing in flight: returns at once

    _run(scenario())


BUDGET = LAYOUT.num_layers * LAYOUT.block_bytes()  # one block of every layer per message


def _sender_and_ready(num_blocks: int) -> tuple[KVSender, KVReady, PagedKV]:
    generator = torch.Generator().manual_seed(0)
    shape = (num_blocks + 2, *LAYOUT.block_shape)
    layers = range(LAYOUT.num_layers)
    cache = KVCache(
        [torch.randn(shape, generator=generator) for _ in layers],
        [torch.randn(shape, generator=generator) for _ in layers],
    )
    table = tuple(reversed(range(num_blocks)))
    num_tokens = num_blocks * LAYOUT.block_size
    sender = KVSender(cache, LAYOUT, torch.device("cpu"), max_payload_bytes=BUDGET)
    return sender, KVReady(0, num_blocks, num_tokens, table), PagedKV(cache.k, cache.v, LAYOUT)


def test_sender_streams_the_same_frames_as_the_wire_in_order() -> None:
    sender, ready, blocks = _sender_and_ready(5)
    frames = blocks.frames(ready.block_tables, 0, 5, num_tokens=ready.num_tokens, max_payload_bytes=BUDGET)
    expected = [frame.data for frame in frames]

    async def scenario() -> list[bytes]:
        return [frame.data async for frame in sender.frames(ready)]

    try:
        assert len(expected) == 5
        assert _run(scenario()) == expected
    finally:
        sender.close()


class CountingFrames:
    """Stands in for PagedKV: counts the frames built so far."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.built = 0
        self.lock = threading.Lock()

    def frames(self, *args, **kwargs) -> Iterator[int]:
        for index in range(self.count):
            with self.lock:
                self.built += 1
            yield index


def test_sender_builds_the_next_frame_while_the_caller_holds_the_current_one() -> None:
    sender, ready, _ = _sender_and_ready(1)
    counting = CountingFrames(3)
    sender._blocks = counting  # type: ignore[assignment]

    async def scenario() -> None:
        stream = sender.frames(ready)
        assert await anext(stream) == 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        while counting.built < 2 and loop.time() < deadline:
            await asyncio.sleep(0.01)
        assert counting.built == 2  # frame 1 is built without being asked for, frame 2 is not
        await asyncio.sleep(0.05)
        assert counting.built == 2
        await stream.aclose()  # a caller that stops early drops the frame built ahead

    try:
        _run(scenario())
    finally:
        sender.close()
