"""What one engine step's output costs to cross a process boundary, per local transport.

    python -m bench.engine_transport [--seqs 128] [--steps 20000] [--out FILE]

Issue 23 moves the decode engine core into a process of its own; the front door then receives one
message per step carrying every running sequence's new token. This measures the candidates on that
path as the front door would use them: a child process (the engine) encodes and sends `--steps` step
messages of `--seqs` sequences as fast as it can; the parent receives them on an asyncio event loop
(woken by the transport's file descriptor, as the server's loop would be) and decodes each into
per-sequence tokens. Reported per transport: steps/s, and CPU per step on each side (the sender's
encode and send, the receiver's wake-up, receive and decode), with the one-token payload's size.

The transports: ZeroMQ PUSH/PULL over an `ipc://` socket, and a `multiprocessing.Pipe` (a Unix socket
pair with a length prefix). Shared memory with polling is not measured: on a 2-core machine a poller
costs a core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import msgspec
import zmq

from bench.machine import load_average, machine_info
from bench.report import results_dir


class StepOutput(msgspec.Struct, array_like=True):
    """A step's new tokens, columnar: sequence slot i got token_ids[i] (the shape the core would send)."""

    step: int
    slots: list[int]
    token_ids: list[int]
    finished: list[int]


@dataclass
class TransportResult:
    transport: str
    steps: int
    seqs: int
    message_bytes: int
    steps_per_s: float
    sender_cpu_us_per_step: float
    receiver_cpu_us_per_step: float


def _step_message(encoder: msgspec.msgpack.Encoder, step: int, slots: list[int]) -> bytes:
    """One step's encoded output: every slot gets a token id that varies by step (as real ones do)."""
    return encoder.encode(StepOutput(step, slots, [(step * 31 + i) % 49152 for i in slots], []))


def _send_zmq(address: str, seqs: int, steps: int, report: multiprocessing.connection.Connection) -> None:
    socket = zmq.Context.instance().socket(zmq.PUSH)
    socket.connect(address)
    report.recv()  # the receiver is bound and listening
    cpu = _send_all(lambda payload: socket.send(payload, copy=False), seqs, steps)
    report.send(cpu)
    socket.close(linger=-1)


def _send_pipe(conn: multiprocessing.connection.Connection, seqs: int, steps: int) -> None:
    conn.recv()
    conn.send(_send_all(conn.send_bytes, seqs, steps))


def _send_all(send, seqs: int, steps: int) -> float:
    """Encode and send every step (the encode is part of the sender's cost); returns CPU seconds."""
    encoder = msgspec.msgpack.Encoder()
    slots = list(range(seqs))
    start = time.process_time()
    for step in range(steps):
        send(_step_message(encoder, step, slots))
    return time.process_time() - start


async def _receive(fd: int, next_payload: Callable[[], bytes | memoryview | None], steps: int) -> None:
    """Decode `steps` step messages on this event loop, woken by `fd`; `next_payload` returns the next
    waiting message or None. Each wake-up drains everything waiting (ZeroMQ's descriptor is
    edge-triggered, so it must), and one drain runs first for what arrived before the reader was added."""
    loop = asyncio.get_running_loop()
    decoder = msgspec.msgpack.Decoder(StepOutput)
    done = loop.create_future()
    received = 0

    def on_readable() -> None:
        nonlocal received
        while received < steps and (payload := next_payload()) is not None:
            _deliver(decoder.decode(payload))
            received += 1
        if received >= steps and not done.done():
            done.set_result(None)

    loop.add_reader(fd, on_readable)
    on_readable()
    await done
    loop.remove_reader(fd)


def _zmq_payload(socket: zmq.Socket) -> Callable[[], memoryview | None]:
    return lambda: socket.recv(copy=False).buffer if socket.getsockopt(zmq.EVENTS) & zmq.POLLIN else None


def _pipe_payload(conn: multiprocessing.connection.Connection) -> Callable[[], bytes | None]:
    return lambda: conn.recv_bytes() if conn.poll(0) else None


def _deliver(output: StepOutput) -> None:
    """What the front door does first with a step: pair each slot with its token."""
    for _slot, _token in zip(output.slots, output.token_ids, strict=True):
        pass


def _timed(receive) -> tuple[float, float]:
    """Wall and CPU seconds of running `receive` on a fresh event loop."""
    wall, cpu = time.perf_counter(), time.process_time()
    asyncio.run(receive)
    return time.perf_counter() - wall, time.process_time() - cpu


def measure_zmq(seqs: int, steps: int) -> TransportResult:
    with tempfile.TemporaryDirectory() as tmp:
        address = f"ipc://{tmp}/engine.sock"
        socket = zmq.Context.instance().socket(zmq.PULL)
        socket.bind(address)
        parent, child = multiprocessing.Pipe()
        sender = multiprocessing.get_context("spawn").Process(
            target=_send_zmq, args=(address, seqs, steps, child)
        )
        sender.start()
        parent.send("go")
        wall, cpu = _timed(_receive(socket.getsockopt(zmq.FD), _zmq_payload(socket), steps))
        sender_cpu = parent.recv()
        sender.join()
        socket.close()
    return _result("zmq-ipc", seqs, steps, wall, cpu, sender_cpu)


def measure_pipe(seqs: int, steps: int) -> TransportResult:
    parent, child = multiprocessing.Pipe()
    sender = multiprocessing.get_context("spawn").Process(target=_send_pipe, args=(child, seqs, steps))
    sender.start()
    parent.send("go")
    wall, cpu = _timed(_receive(parent.fileno(), _pipe_payload(parent), steps))
    sender_cpu = parent.recv()
    sender.join()
    return _result("pipe", seqs, steps, wall, cpu, sender_cpu)


def _result(name: str, seqs: int, steps: int, wall: float, cpu: float, sender_cpu: float) -> TransportResult:
    return TransportResult(
        transport=name,
        steps=steps,
        seqs=seqs,
        message_bytes=len(_step_message(msgspec.msgpack.Encoder(), 0, list(range(seqs)))),
        steps_per_s=steps / wall,
        sender_cpu_us_per_step=sender_cpu / steps * 1e6,
        receiver_cpu_us_per_step=cpu / steps * 1e6,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=128, help="sequences per step message")
    parser.add_argument("--steps", type=int, default=20000, help="step messages per transport")
    parser.add_argument("--out", type=Path, default=results_dir() / "engine_transport.json")
    args = parser.parse_args(argv)
    load_before = load_average()
    results = [measure(args.seqs, args.steps) for measure in (measure_zmq, measure_pipe)]
    for r in results:
        print(
            f"{r.transport:8s} {r.steps_per_s:9.0f} steps/s  sender {r.sender_cpu_us_per_step:6.1f} µs/step  "
            f"receiver {r.receiver_cpu_us_per_step:6.1f} µs/step  ({r.message_bytes} B/step)"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": machine_info(),
                "load_before": load_before,
                "load_after": load_average(),
                "results": [asdict(r) for r in results],
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
