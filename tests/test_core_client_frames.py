"""The front door's non-blocking pipe ends (`engine_core.core_client`): frames `multiprocessing`'s
`Connection` reads and writes, an event loop that never waits on a full or half-written pipe, and
the ends of a pipe reported once."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import threading

import pytest

from decode_service.engine_core.core_client import FrameReader, FrameWriter, frame_header

PIPE_CAPACITY = 64 * 1024  # Linux's default; the payloads below are far larger in all


def payloads(count: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(rng.choice([0, 1, 100, 5_000, 70_000, 300_000])) for _ in range(count)]


def test_frames_reach_recv_bytes_intact_while_the_loop_never_waits_for_the_reader():
    receive, send = multiprocessing.Pipe(duplex=False)
    sent = payloads(40, seed=1)
    received: list[bytes] = []
    reading = threading.Event()

    def reader() -> None:
        reading.wait()
        received.extend(receive.recv_bytes() for _ in sent)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()

    async def main() -> int:
        loop = asyncio.get_running_loop()
        writer = FrameWriter(loop, send.fileno(), lambda: pytest.fail("the pipe is not broken"))
        for payload in sent:
            writer.send(payload)
        # Nobody reads yet: the pipe is full, the rest waits here, and this coroutine went on.
        queued = writer.pending_bytes
        reading.set()
        while writer.pending_bytes:
            await asyncio.sleep(0.01)
        return queued

    queued = asyncio.run(main())
    thread.join(30)
    assert queued > 0
    assert received == sent


def test_reader_takes_whole_frames_from_pieces_and_reports_the_end_after_them():
    read_fd, write_fd = os.pipe()
    reader = FrameReader(read_fd)
    try:
        assert reader.read() == []  # nothing yet: no frame, no wait
        message = frame_header(5) + b"hello" + frame_header(0) + frame_header(3) + b"abc"
        for cut in (2, 7, len(message) - 1):
            os.write(write_fd, message[:cut])
            first = reader.read()
            os.write(write_fd, message[cut:])
            assert first + reader.read() == [b"hello", b"", b"abc"], cut
        # The long header multiprocessing writes past 2 GiB, for a short payload.
        os.write(write_fd, (-1).to_bytes(4, "big", signed=True) + (2).to_bytes(8, "big") + b"ok")
        assert reader.read() == [b"ok"]
        os.write(write_fd, frame_header(4) + b"last")
        os.close(write_fd)
        write_fd = -1
        assert reader.read() == [b"last"]
        with pytest.raises(EOFError):
            reader.read()
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)


def test_reader_reads_what_send_bytes_wrote():
    receive, send = multiprocessing.Pipe(duplex=False)
    sent = payloads(12, seed=2)

    def writer() -> None:
        for payload in sent:
            send.send_bytes(payload)
        send.close()

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    reader = FrameReader(receive.fileno())
    received: list[bytes] = []
    while True:
        try:
            received += reader.read()
        except EOFError:
            break
    thread.join(30)
    assert received == sent


def test_a_gone_reader_is_reported_once_and_later_frames_are_dropped():
    read_fd, write_fd = os.pipe()
    broken: list[bool] = []

    async def main() -> None:
        writer = FrameWriter(asyncio.get_running_loop(), write_fd, lambda: broken.append(True))
        writer.send(b"x" * (2 * PIPE_CAPACITY))  # fills the pipe: the rest waits for the reader
        os.close(read_fd)
        while not broken:
            await asyncio.sleep(0.01)
        writer.send(b"more")
        assert writer.pending_bytes == 0

    try:
        asyncio.run(main())
    finally:
        os.close(write_fd)
    assert broken == [True]
