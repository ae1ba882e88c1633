"""How long a front door that stops reading holds the engine core's steps: the core's reply path with
its replies written on the engine thread (before issue 36) and on a writer thread (after).

    python -m bench.slow_front_door [--pause-s 2] [--step-ms 10] [--streams 2 64] [--top-logprobs 5]

Measured in one process, on the core's real reply path, not a whole server: the front door's reader is
its event loop, and pausing that from outside would take a hook in product code. A stand-in engine
thread runs steps of `--step-ms` (a sleep for the forward) and hands each step's `StepOut` (one token
per stream of `--streams`, with `--top-logprobs` alternatives, as the core sends them) to the reply
path, over a real `multiprocessing.Pipe` (64 KiB on Linux) whose reader, the front door, reads nothing
for `--pause-s` and then everything. The paths:

- inline: the engine thread encodes and `send_bytes` itself (the reply path before issue 36);
- writer: the engine thread puts the message into `StepWriter`'s bounded queue.

Per path and batch: the steps the engine thread completed during the pause (of about pause / step it
would without a reader), its longest hand-off (how long one step was held), the most bytes waiting for
the reader (queued and in the pipe), the most messages queued, and whether every message arrived, in
order.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

from bench.report import results_dir

# The length prefix `send_bytes` writes before each payload.
_HEADER = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pause-s", type=float, default=2.0, help="how long the front door reads nothing")
    parser.add_argument("--step-ms", type=float, default=10.0, help="one engine step (a sleep)")
    parser.add_argument("--streams", type=int, nargs="+", default=[2, 64], help="streams per step, per run")
    parser.add_argument("--top-logprobs", type=int, default=5, help="alternatives per token (0: none)")
    parser.add_argument("--out", type=Path, default=results_dir() / "slow_front_door.json")


def run(args: argparse.Namespace) -> int:
    from decode_service.engine_core.core import MAX_QUEUED

    results = []
    for streams in args.streams:
        for path in ("inline", "writer"):
            result = measure(path, streams, args.top_logprobs, args.step_ms / 1000, args.pause_s)
            results.append(result)
            print(
                f"{path:6s} streams={streams:3d} message={result['message_bytes']} B: "
                f"{result['steps_during_pause']}/{result['steps_without_reader']} steps during the "
                f"{args.pause_s:g} s pause, longest hand-off {result['longest_handoff_s']:.3f} s, "
                f"at most {result['max_waiting_bytes']} B waiting ({result['max_queued']} queued), "
                f"in order: {result['in_order']}"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"pause_s": args.pause_s, "step_ms": args.step_ms, "max_queued": MAX_QUEUED, "runs": results}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def measure(path: str, streams: int, top_logprobs: int, step_s: float, pause_s: float) -> dict:
    """One run: steps for the pause and one second more, the reader paused for the first `pause_s`."""
    from decode_service.engine_core.core import StepWriter
    from decode_service.engine_core.messages import StepOut, command_encoder

    receive, send = multiprocessing.Pipe(duplex=False)
    steps = round((pause_s + 1.0) / step_s)
    read = Reader(receive, steps, pause_s)
    if path == "writer":
        writer = StepWriter(send)
        hand_off, queued = writer.put, lambda: writer.queued
    else:
        lock = threading.Lock()

        def hand_off(message: StepOut) -> None:
            data = command_encoder.encode(message)
            with lock:
                send.send_bytes(data)

        queued = int
    start = time.monotonic()
    read.start()
    put_bytes = longest = max_waiting = max_queued = during = 0
    for step in range(steps):
        time.sleep(step_s)
        message = step_message(step, streams, top_logprobs)
        # Sized here for the report, outside the timed hand-off.
        put_bytes += len(command_encoder.encode(message)) + _HEADER
        began = time.monotonic()
        hand_off(message)
        ended = time.monotonic()
        longest = max(longest, ended - began)
        during += ended - start < pause_s
        max_waiting = max(max_waiting, put_bytes - read.bytes)
        max_queued = max(max_queued, queued())
    read.join()
    if path == "writer":
        writer.close()
    send.close()
    receive.close()
    return {
        "path": path,
        "streams": streams,
        "message_bytes": put_bytes // steps,
        "steps_during_pause": during,
        "steps_without_reader": round(pause_s / step_s),
        "longest_handoff_s": round(longest, 4),
        "max_waiting_bytes": max_waiting,
        "max_queued": max_queued,
        "in_order": read.steps == list(range(steps)),
    }


def step_message(step: int, streams: int, top_logprobs: int):
    """A decode step as the core sends it: one token per stream (its id: the step, for the order check)."""
    from decode_service.engine_core.messages import CoreStats, Delta, StepOut

    top = [(step + k, -1.5 - k) for k in range(top_logprobs)]
    logprobs = [(step, -0.25, top)] if top_logprobs else []
    deltas = [Delta(submission, 0, [step], logprobs, None, None, None) for submission in range(streams)]
    return StepOut(deltas, CoreStats(num_running=streams, kv_usage=0.25), [])


class Reader(threading.Thread):
    """The front door's end: reads nothing for `pause_s`, then `count` messages; notes each one's step."""

    def __init__(self, receive: Connection, count: int, pause_s: float) -> None:
        super().__init__(name="front-door", daemon=True)
        self.receive, self.count, self.pause_s = receive, count, pause_s
        self.bytes = 0
        self.steps: list[int] = []

    def run(self) -> None:
        from decode_service.engine_core.messages import core_message_decoder

        time.sleep(self.pause_s)
        for _ in range(self.count):
            data = self.receive.recv_bytes()
            self.bytes += len(data) + _HEADER
            self.steps.append(core_message_decoder.decode(data).deltas[0].token_ids[0])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
