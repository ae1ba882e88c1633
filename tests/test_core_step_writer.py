"""The core's replies leave on a writer thread: in order, encoded off the caller, bounded, and a slow or
gone reader costs the engine thread nothing until the bound. Decisions are asserted, never timings: the
waits below only guard against a hang."""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from collections.abc import Callable

import pytest

from decode_service.engine_core import core
from decode_service.engine_core.core import Reply, StepWriter
from decode_service.engine_core.messages import Pong, command_encoder, core_message_decoder

GUARD_S = 30.0


def wait_until(condition: Callable[[], bool], timeout: float = GUARD_S) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class Producer(threading.Thread):
    """Puts `count` pongs numbered 0.. into `writer`, counting those put (a stand-in engine thread)."""

    def __init__(self, writer: StepWriter, count: int) -> None:
        super().__init__(daemon=True)
        self.writer, self.count, self.put = writer, count, 0

    def run(self) -> None:
        for number in range(self.count):
            self.writer.put(Pong(number))
            self.put += 1


class GatedPipe:
    """A `Connection` stand-in whose `send_bytes` waits for `gate`: a front door that does not read."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.sent: list[bytes] = []

    def send_bytes(self, data: bytes) -> None:
        self.entered.set()
        assert self.gate.wait(GUARD_S)
        self.sent.append(data)


def numbers(frames: list[bytes]) -> list[int]:
    return [core_message_decoder.decode(frame).number for frame in frames]


def events(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.event for record in caplog.records if record.name == core.logger.name]


def test_messages_leave_in_order_encoded_on_the_writer_thread():
    receive, send = multiprocessing.Pipe(duplex=False)
    encoded_on: set[str] = set()

    def encode(message: Reply) -> bytes:
        encoded_on.add(threading.current_thread().name)
        return command_encoder.encode(message)

    writer = StepWriter(send, encode=encode)
    for number in range(50):
        writer.put(Pong(number))
    assert writer.close()
    assert numbers([receive.recv_bytes() for _ in range(50)]) == list(range(50))
    assert encoded_on == {"tandem-core-writer"}
    assert threading.current_thread().name not in encoded_on


def test_a_full_queue_blocks_the_producer_until_the_writer_drains_it():
    pipe = GatedPipe()
    writer = StepWriter(pipe, max_queued=2)  # type: ignore[arg-type]
    producer = Producer(writer, 6)
    producer.start()
    # One message is in the writer's hands (held at the gate), two wait in the queue: the fourth put
    # blocks, whatever the scheduling.
    assert pipe.entered.wait(GUARD_S)
    assert wait_until(lambda: writer.queued == 2 and producer.put == 3)
    assert producer.is_alive()
    pipe.gate.set()
    producer.join(GUARD_S)
    assert not producer.is_alive() and producer.put == 6
    assert writer.close()
    assert numbers(pipe.sent) == list(range(6))


def test_a_broken_pipe_is_logged_once_and_the_rest_drains(caplog):
    receive, send = multiprocessing.Pipe(duplex=False)
    receive.close()
    writer = StepWriter(send, max_queued=2)
    producer = Producer(writer, 20)
    with caplog.at_level(logging.INFO, logger="decode_service.engine_core.core"):
        producer.start()
        producer.join(GUARD_S)
        assert writer.close()
    assert not producer.is_alive() and producer.put == 20
    assert events(caplog) == ["core replies pipe closed"]


def test_close_returns_when_the_reader_never_reads(caplog):
    pipe = GatedPipe()
    writer = StepWriter(pipe, max_queued=1)  # type: ignore[arg-type]
    writer.put(Pong(0))
    writer.put(Pong(1))
    with caplog.at_level(logging.WARNING, logger="decode_service.engine_core.core"):
        assert not writer.close(timeout=0.2)
    assert events(caplog) == ["core replies unflushed"]
    pipe.gate.set()


def test_a_paused_reader_does_not_hold_the_producer_until_the_bound():
    """Against a real pipe (64 KiB): `max_queued` messages of 16 KiB, twice what the pipe holds, are put
    without the reader reading; then the producer blocks; once the reader reads, all arrive in order."""
    receive, send = multiprocessing.Pipe(duplex=False)
    size, max_queued = 16 * 1024, 8

    def encode(message: Reply) -> bytes:
        assert isinstance(message, Pong)
        return message.number.to_bytes(4, "big") * (size // 4)

    writer = StepWriter(send, max_queued=max_queued, encode=encode)
    # Far more than the pipe, the writer's message in hand and the queue can hold together.
    count = max_queued * 6
    assert count * size > 64 * 1024 + (max_queued + 1) * size
    producer = Producer(writer, count)
    producer.start()
    assert wait_until(lambda: producer.put >= max_queued)
    assert max_queued * size > 64 * 1024
    # The queue fills and stays full: the writer is held by the pipe, so the producer is too.
    assert wait_until(lambda: writer.queued == max_queued)
    assert producer.is_alive() and producer.put < count
    frames = [receive.recv_bytes() for _ in range(count)]
    producer.join(GUARD_S)
    assert not producer.is_alive()
    assert writer.close()
    assert [int.from_bytes(frame[:4], "big") for frame in frames] == list(range(count))
    assert all(len(frame) == size for frame in frames)
