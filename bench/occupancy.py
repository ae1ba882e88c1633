"""The batch-occupancy timeline: who sat in which batch slot at every iteration, static vs continuous.

Runs the same requests (all at once, exact output lengths) through a real decode server twice, once per
batching mode, with a small slot count so the picture stays readable. The server runs in this process
(`DecodeServer`, reached over loopback gRPC by the load generator), which lets us read its engine event
log afterwards: every step's chunks (request, tokens, prefill or decode) and who finished. Slots are
assigned the way a batch would fill them: a request takes the lowest free slot when it first runs and
frees it when it finishes (or is preempted). Writes `occupancy.json` and `occupancy_timeline.png`.

    tandem bench occupancy [--num-prompts 24 --max-num-seqs 8 --output-len uniform:16:128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from collections.abc import Sequence
from pathlib import Path

from bench.report import results_dir
from bench.workload import ArrivalProcess, LengthDistribution, SyntheticWorkload, WorkloadRequest

logger = logging.getLogger(__name__)


def assign_slots(steps: Sequence, run_tag: str, num_slots: int) -> dict:
    """Turn event-log `StepRecord`s of one run into drawable slot segments and occupancy numbers.

    Segments are `[slot, first_step, num_steps, request_index, kind]`, consecutive steps of one request
    in one slot with one kind merged. Steps are renumbered from 0 at the run's first step.
    """
    prefix = f"{run_tag}-"

    def index_of(request_id: str) -> int | None:
        suffix = request_id[len(prefix) :]
        return int(suffix) if request_id.startswith(prefix) and suffix.isdigit() else None

    ours = [s for s in steps if any(index_of(c.request_id) is not None for c in s.chunks)]
    slot_of: dict[str, int] = {}
    open_segments: dict[str, list] = {}
    segments: list[list] = []
    busy_slot_steps = 0
    for number, step in enumerate(ours):
        for chunk in step.chunks:
            index = index_of(chunk.request_id)
            if index is None:
                continue
            if chunk.request_id not in slot_of:
                free = sorted(set(range(num_slots)) - set(slot_of.values()))
                slot_of[chunk.request_id] = free[0] if free else num_slots + len(slot_of)
            segment = open_segments.get(chunk.request_id)
            if segment is not None and segment[4] == chunk.kind and segment[1] + segment[2] == number:
                segment[2] += 1
            else:
                segment = [slot_of[chunk.request_id], number, 1, index, chunk.kind]
                segments.append(segment)
                open_segments[chunk.request_id] = segment
        busy_slot_steps += len(slot_of)
        for request_id in (*step.finished, *step.preempted):
            slot_of.pop(request_id, None)
            open_segments.pop(request_id, None)
    return {
        "num_slots": num_slots,
        "num_steps": len(ours),
        "mean_occupancy": busy_slot_steps / (num_slots * len(ours)) if ours else 0.0,
        "segments": segments,
    }


async def record_run(
    model_dir: Path, batching: str, requests: Sequence[WorkloadRequest], max_num_seqs: int, threads: int
) -> dict:
    """Serve `requests` with one batching mode in-process; returns the mode's occupancy and metrics."""
    import torch

    from bench.backends.tandem_grpc import TandemBackend
    from bench.metrics import compute_metrics
    from bench.runner import run_load
    from decode_service.config import DecodeServiceConfig
    from decode_service.server import DecodeServer
    from engine.config import CacheConfig, EngineConfig
    from engine.engine import Engine

    torch.set_num_threads(threads)
    engine_config = EngineConfig(
        dtype=torch.float32,
        cache=CacheConfig(block_size=16, memory_bytes=1 << 30),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=512,
    )
    engine = Engine.from_pretrained(model_dir, engine_config)
    server = DecodeServer(
        engine, DecodeServiceConfig(host="127.0.0.1", port=0, batching=batching, event_log_size=1_000_000)
    )
    port = await server.start()
    backend = TandemBackend(f"127.0.0.1:{port}", name=f"tandem-{batching}")
    try:
        await backend.open()
        load = await run_load(backend, requests, ArrivalProcess(), description=f"{batching} batching")
    finally:
        await backend.close()
        await server.stop()
    metrics = compute_metrics(load.records, load.duration_s)
    return {
        "batching": batching,
        **assign_slots(server.events.snapshot(), load.run_tag, max_num_seqs),
        "output_throughput": metrics["output_throughput"],
        "failed": metrics["failed"],
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model dir (default: the cached default model)")
    parser.add_argument("--num-prompts", type=int, default=24, help="requests (default: 24)")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="batch slots (default: 8)")
    lengths = LengthDistribution.parse
    parser.add_argument("--prompt-len", type=lengths, default=lengths("uniform:60:330"), help="prompt length")
    parser.add_argument("--output-len", type=lengths, default=lengths("uniform:16:128"), help="output length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the server (default: 2)")
    parser.add_argument("--out-dir", type=Path, default=results_dir())


def run(args: argparse.Namespace) -> int:
    from bench.machine import machine_info
    from bench.plots import draw_occupancy
    from bench.report import command_line, write_json
    from engine.model_store import resolve_model

    # The in-process server logs every finished request; the picture is the record here.
    logging.getLogger("decode_service").setLevel(logging.WARNING)
    model_dir = resolve_model(args.model)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    spec = SyntheticWorkload(args.num_prompts, args.prompt_len, args.output_len, vocab, args.seed)
    requests = spec.requests()
    machine = machine_info()
    modes = [
        asyncio.run(record_run(model_dir, batching, requests, args.max_num_seqs, args.threads))
        for batching in ("static", "continuous")
    ]
    document = {
        "benchmark": "occupancy",
        "machine": machine,
        "command": command_line(),
        "model": model_dir.name,
        "threads": args.threads,
        "num_requests": len(requests),
        "output_len": str(args.output_len),
        "workload": spec.describe(),
        "modes": modes,
    }
    write_json(args.out_dir / "occupancy.json", document)
    print(draw_occupancy(document, args.out_dir))
    for mode in modes:
        print(
            f"{mode['batching']}: {mode['num_steps']} iterations, occupancy {mode['mean_occupancy']:.0%}, "
            f"{mode['output_throughput']:.1f} output tok/s"
        )
    return 0
