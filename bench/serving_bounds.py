"""The floors under the serving path's figure, measured on this machine in the same run.

`tandem bench serving-path` reports what the server spends per token; these say how low that can go
with this stack and this model, so a target below them is known to be out of reach rather than
merely missed:

- the gRPC write floor: a bare grpc.aio server (`python -m bench.serving_bounds --port N`) whose
  `tandem.v1.Generation/Generate` writes `--output-len` prebuilt one-token messages with
  `context.write`, one per stream per simulated step, and does nothing else (no engine, no mailbox,
  no watchdog, no message building), driven by the same number of concurrent streams; its CPU per
  message is what grpc.aio itself costs per stream message here, which the real edge can approach
  but not undercut while it sends one message per token;
- the LM head floor: the near-zero model's LM head FLOPs per token at the best fp32 GEMM rate this
  core reaches at that shape (cache-resident, on the server's thread count). The argmax and the rest
  of the forward come on top.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time

from bench.process_cpu import process_cpu_seconds

logger = logging.getLogger(__name__)

TOKEN_ID = 1234
TOKEN_TEXT = " word"
# One message per stream per step, as the engine delivers. The cost per message grows with the gap
# (measured at 128 streams: 20 µs back to back, 30 at 5 ms, 40 at 20 ms): serving-path passes the
# served run's inter-token latency.
STEP_MS = 5.0


def _spin(seconds: float) -> None:
    """Hold the CPU for `seconds`: the work a real server does per message, without its side effects."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class StepTicker:
    """Releases every waiting stream once per `period_s`, as the engine thread delivers one token to
    every stream once per decode step: writes then come in bursts of one message per stream, as they
    do in the real server, rather than back to back on each stream (which gRPC batches better)."""

    def __init__(self, period_s: float, work_s: float = 0.0) -> None:
        self._period_s = period_s
        # CPU spent once per step before the streams are released (`--work-us` x streams, `--work-first`).
        self.work_s = work_s
        self._step = asyncio.Event()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._period_s)
            _spin(self.work_s)
            step, self._step = self._step, asyncio.Event()
            step.set()

    async def next_step(self) -> None:
        await self._step.wait()


async def _serve(
    port: int, step_ms: float, work_us: float = 0.0, work_first: bool = False, streams: int = 128
) -> None:
    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    from protos.tandem.v1 import generation_pb2 as pb
    from protos.tandem.v1 import generation_pb2_grpc

    # 0: no steps, every stream writes back to back (the fastest this stack streams).
    ticker = StepTicker(step_ms / 1000) if step_ms > 0 else None
    # `work_us` per message, spent by each stream before its write or, with `work_first`, by the ticker
    # for every stream at once before the step's writes.
    work_s = work_us / 1e6
    if ticker is not None and work_first:
        ticker.work_s, work_s = work_s * streams, 0.0

    class BareGeneration(generation_pb2_grpc.GenerationServicer):
        async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
            message = pb.GenerateResponse(
                request_id=request.request_id, token_ids=[TOKEN_ID], text=TOKEN_TEXT
            )
            for _ in range(request.stopping.max_tokens):
                if ticker is not None:
                    await ticker.next_step()
                _spin(work_s)
                await context.write(message)

        async def GetModelInfo(
            self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
        ) -> pb.ModelInfo:
            # What a benchmark client asks before it streams; the bare server serves no model.
            return pb.ModelInfo(model_name="bare-grpc")

    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServicer_to_server(BareGeneration(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    ticking = asyncio.get_running_loop().create_task(ticker.run()) if ticker is not None else None
    try:
        await server.wait_for_termination()
    finally:
        if ticking is not None:
            ticking.cancel()


async def _drive(target: str, streams: int, messages: int) -> int:
    """Open `streams` calls at once and read every message; returns how many arrived."""
    import grpc

    from protos.tandem.v1 import generation_pb2 as pb
    from protos.tandem.v1 import generation_pb2_grpc

    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        async def one(index: int) -> int:
            request = pb.GenerateRequest(request_id=f"bare-{index}")
            request.stopping.max_tokens = messages
            return sum([1 async for _ in stub.Generate(request)])

        counts = await asyncio.gather(*(one(i) for i in range(streams)))
    return sum(counts)


def grpc_write_floor(streams: int, messages: int, rounds: int = 3, step_ms: float = STEP_MS) -> dict:
    """Server CPU µs per stream message of the bare grpc.aio server (median of `rounds`, after a warm-up)."""
    from bench.servers import ServerProcess, free_port, grpc_healthy, running, thread_env

    port = free_port()
    target = f"127.0.0.1:{port}"
    server = ServerProcess(
        "bare-grpc",
        [sys.executable, "-m", "bench.serving_bounds", "--port", str(port), "--step-ms", str(step_ms)],
        lambda: grpc_healthy(target),
        thread_env(1),
    )
    per_message = []
    with running(server):
        asyncio.run(_drive(target, streams, 8))
        for _ in range(rounds):
            before = process_cpu_seconds(server.pid)
            received = asyncio.run(_drive(target, streams, messages))
            per_message.append(1e6 * (process_cpu_seconds(server.pid) - before) / received)
    per_message.sort()
    return {
        "streams": streams,
        "messages_per_stream": messages,
        "step_ms": step_ms,
        "server_cpu_us_per_message": round(per_message[len(per_message) // 2], 1),
    }


def lm_head_floor(rows: int, hidden: int, vocab: int, threads: int, repeats: int = 20) -> dict:
    """The LM head's FLOPs at the best fp32 GEMM rate this core reaches at its shape, per token.

    The rate is measured on one cache-resident vocabulary slice ([rows, hidden] x [hidden, 2048]),
    so memory traffic is out of it: no LM head kernel on this CPU, fused or not, does the same
    multiply-adds faster.
    """
    import torch

    slice_width = min(2048, vocab)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(rows, hidden, generator=generator)
        weight_t = torch.randn(hidden, slice_width, generator=generator)
        out = torch.empty(rows, slice_width)
        slices = 16
        torch.mm(x, weight_t, out=out)
        best = float("inf")
        for _ in range(repeats):
            started = time.process_time()
            for _ in range(slices):
                torch.mm(x, weight_t, out=out)
            best = min(best, (time.process_time() - started) / slices)
    finally:
        torch.set_num_threads(previous)
    rate = 2 * rows * hidden * slice_width / best
    return {
        "rows": rows,
        "hidden": hidden,
        "vocab": vocab,
        "threads": threads,
        "gemm_gflop_per_s": round(rate / 1e9, 1),
        "cpu_us_per_token": round(1e6 * 2 * hidden * vocab / rate, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="the bare grpc.aio server of the gRPC write floor")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--step-ms",
        type=float,
        default=STEP_MS,
        help="time between two messages of a stream (0: back to back)",
    )
    parser.add_argument("--work-us", type=float, default=0.0, help="CPU µs spent per message")
    parser.add_argument(
        "--work-first",
        action="store_true",
        help="spend every stream's --work-us before the step's writes, not before each (needs --step-ms)",
    )
    parser.add_argument("--streams", type=int, default=128, help="streams a step releases (for --work-first)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(_serve(args.port, args.step_ms, args.work_us, args.work_first, args.streams))


if __name__ == "__main__":
    main()
