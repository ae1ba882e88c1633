"""Where a decode step's time goes, on the headline workload, without and with gRPC in the way.

Three measurements of the same requests, all in this process with the server's thread count:

1. engine loop only: the decode tier's real scheduler and engine loop (`EngineLoop.step_once`, which
   schedules, runs the forward, samples, checks stop tokens and records the event log), driven
   synchronously with no gRPC and no streaming — its throughput is what the server could give if the
   network edge cost nothing;
2. the same under cProfile: wall time per part of a step (schedule, forward, attention, sampler,
   bookkeeping) and the functions with the most own time;
3. a torch profiler window over steady-state decode steps: which torch ops the time goes to (matmuls
   vs the many small elementwise ops), how much is outside them (Python, and extensions the profiler
   cannot see), and how much memory each step allocates.

The gRPC cost is then the gap between (1) and the served throughput of the same workload in
`compare.json` (when present). Writes `profile_decode.json` and prints a summary.

    tandem bench profile [--threads 2 --num-prompts 64]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import pstats
import time
from pathlib import Path

from bench.report import results_dir
from bench.workload import WorkloadRequest

logger = logging.getLogger(__name__)

# Step parts, by (file suffix, function name) of the function whose cumulative time is the part.
STEP_PARTS = {
    "schedule": ("decode_service/engine_core/scheduler.py", "schedule"),
    "forward (model_runner.execute)": ("engine/model_runner.py", "execute"),
    "  input prep (model_runner.prepare)": ("engine/model_runner.py", "prepare"),
    "  attention (backend.attention)": ("kernels/backend.py", "attention"),
    "  kv cache write": ("kernels/backend.py", "write_kv_cache"),
    "LM head and sampler (engine.sample)": ("engine/engine.py", "sample"),
    "append token + stop rules": ("engine/sequence.py", "append_token"),
    "complete_step (outputs to deltas)": ("decode_service/engine_core/scheduler.py", "complete_step"),
    "event log record": ("decode_service/engine_core/engine_loop.py", "_record"),
}


def build_engine_loop(model_dir: Path, max_num_seqs: int, budget: int, kv_memory_bytes: int = 2 << 30):
    """The decode tier's engine loop (FIFO scheduler, no streaming: deltas are dropped) over `model_dir`."""
    import torch

    from decode_service.config import DecodeServiceConfig
    from decode_service.engine_core.engine_loop import EngineLoop
    from decode_service.engine_core.policies import make_policy
    from decode_service.engine_core.scheduler import ContinuousScheduler
    from engine.config import CacheConfig, EngineConfig
    from engine.engine import Engine
    from serving.event_log import EventLog

    engine = Engine.from_pretrained(
        model_dir,
        EngineConfig(
            dtype=torch.float32,
            cache=CacheConfig(block_size=16, memory_bytes=kv_memory_bytes),
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
        ),
    )
    config = DecodeServiceConfig()
    scheduler = ContinuousScheduler(engine, make_policy("fifo", {}, 100.0), config)
    return EngineLoop(engine, scheduler, lambda deltas: None, EventLog(100_000))


def submit_requests(loop, requests: list[WorkloadRequest], tag: str) -> None:
    """Queue `requests` as greedy, EOS-ignoring requests of exactly their output length."""
    from decode_service.engine_core.request import ServedRequest
    from engine.params import SamplingParams, StoppingParams

    for request in requests:
        seq = loop.engine.make_sequence(
            list(request.prompt_token_ids),
            SamplingParams(temperature=0.0),
            StoppingParams(max_tokens=request.output_len, ignore_eos=True),
            f"{tag}-{request.index}",
        )
        loop.submit(ServedRequest(seq))


def timed_run(loop, requests: list[WorkloadRequest], tag: str) -> tuple[float, int]:
    """Run `requests` to completion in this thread; returns (wall seconds, steps)."""
    submit_requests(loop, requests, tag)
    start = time.perf_counter()
    steps = loop.run_until_idle()
    return time.perf_counter() - start, steps


def _parts(stats: pstats.Stats) -> dict[str, float]:
    found: dict[str, float] = {}
    for (filename, _, function), (_, _, _, cumulative, _) in stats.stats.items():
        for part, (suffix, name) in STEP_PARTS.items():
            if function == name and filename.endswith(suffix):
                found[part] = found.get(part, 0.0) + cumulative
    return found


def _top_functions(stats: pstats.Stats, count: int) -> list[dict]:
    rows = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)[:count]
    return [
        {
            "function": f"{Path(filename).name}:{line}({function})",
            "calls": calls,
            "own_s": round(own, 3),
            "cumulative_s": round(cumulative, 3),
        }
        for (filename, line, function), (_, calls, own, cumulative, _) in rows
    ]


def _step_times(loop, first_step: int, started: float) -> dict:
    """Mean wall time of decode-only steps and of steps carrying prefill chunks, from the event log
    (each record is stamped when its step ends; `started` is the monotonic time the run began)."""
    records = [r for r in loop.events.snapshot() if r.step >= first_step]
    by_kind: dict[str, list[float]] = {"decode_only": [], "with_prefill": []}
    previous = started
    for record in records:
        kind = "with_prefill" if record.prefill_ids else "decode_only"
        by_kind[kind].append(record.time - previous)
        previous = record.time
    return {
        f"{kind}_steps": {
            "count": len(times),
            "mean_ms": round(1000 * sum(times) / len(times), 2) if times else None,
        }
        for kind, times in by_kind.items()
    }


def _torch_window(loop, requests: list[WorkloadRequest], warm_steps: int, steps: int, count: int) -> dict:
    """Profile `steps` engine steps after `warm_steps` (prefill done: the batch is decoding), by op, with
    allocations. Wall time minus the ops' own time is Python plus whatever the torch profiler cannot
    see (a CPU extension called as a plain function, such as the paged-decode attention)."""
    from torch.profiler import ProfilerActivity, profile

    submit_requests(loop, requests, "torchprof")
    while loop.scheduler.prefilling or loop.scheduler.waiting or warm_steps > 0:
        loop.step_once()
        warm_steps -= 1
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            loop.step_once()
        wall_s = time.perf_counter() - start
    batch = len(loop.scheduler.running)
    loop.run_until_idle()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0 and not e.key.startswith("[")]
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    ops_ms = sum(e.self_cpu_time_total for e in events) / 1000
    allocated = sum(max(0, e.self_cpu_memory_usage) for e in events)
    return {
        "steps": steps,
        "batch_at_end": batch,
        "wall_ms_per_step": round(1000 * wall_s / steps, 2),
        "ops_self_ms_per_step": round(ops_ms / steps, 2),
        "not_in_torch_ops_ms_per_step": round((1000 * wall_s - ops_ms) / steps, 2),
        "allocated_mb_per_step": round(allocated / steps / 2**20, 1),
        "allocation_calls_per_step": round(sum(e.count for e in events if e.key == "aten::empty") / steps, 1),
        "top_ops": [
            {
                "op": e.key,
                "calls_per_step": round(e.count / steps, 1),
                "self_ms_per_step": round(e.self_cpu_time_total / 1000 / steps, 3),
                "self_share": round(e.self_cpu_time_total / 1000 / ops_ms, 3),
            }
            for e in events[:count]
        ],
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bench.serve import add_workload_arguments

    parser.add_argument("--model", default=None, help="model dir (default: the cached default model)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="batch size cap (default: 64)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per step")
    parser.add_argument("--torch-profile-steps", type=int, default=20, help="steps under torch.profiler")
    add_workload_arguments(parser)
    parser.add_argument("--compare-json", type=Path, default=results_dir() / "compare.json")
    parser.add_argument("--result-file", type=Path, default=results_dir() / "profile_decode.json")


def run(args: argparse.Namespace) -> int:
    import torch

    from bench.machine import load_average, machine_info
    from bench.report import command_line, write_json
    from bench.serve import build_workload
    from engine.model_store import resolve_model

    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    workload = build_workload(args, vocab)
    requests = workload.requests
    output_tokens = sum(r.output_len for r in requests)
    machine = machine_info()
    loop = build_engine_loop(model_dir, args.max_num_seqs, args.max_num_batched_tokens)
    timed_run(loop, workload.warmups, "warmup")

    first_step, started = loop.num_steps, time.monotonic()
    plain_s, steps = timed_run(loop, requests, "plain")
    step_times = _step_times(loop, first_step, started)
    logger.info("engine loop only: %d steps, %.1f s, %.1f tok/s", steps, plain_s, output_tokens / plain_s)

    profiler = cProfile.Profile()
    profiler.enable()
    profiled_s, profiled_steps = timed_run(loop, requests, "cprofile")
    profiler.disable()
    stats = pstats.Stats(profiler)
    parts = {name: round(seconds, 3) for name, seconds in _parts(stats).items()}

    torch_window = _torch_window(loop, requests, warm_steps=4, steps=args.torch_profile_steps, count=20)

    served = None
    if args.compare_json.is_file():
        compare = json.loads(args.compare_json.read_text())
        if compare.get("workload") == workload.description:
            served = next(
                (
                    r["metrics"]["output_throughput"]
                    for r in compare.get("runs", [])
                    if r["system"]["name"] == "tandem-aggregated"
                ),
                None,
            )
        else:
            logger.warning("%s measured another workload; no gRPC overhead estimate", args.compare_json)
    engine_tok_s = output_tokens / plain_s
    result = {
        "benchmark": "profile_decode",
        "machine": machine,
        "command": command_line(),
        "model": model_dir.name,
        "threads": args.threads,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "workload": workload.description,
        "engine_loop_only": {
            "seconds": round(plain_s, 2),
            "steps": steps,
            "ms_per_step": round(1000 * plain_s / steps, 2),
            "output_tok_s": round(engine_tok_s, 1),
            **step_times,
        },
        "served_over_grpc_output_tok_s": served,
        "grpc_and_streaming_overhead_share": round(1 - served / engine_tok_s, 3) if served else None,
        "cprofile": {
            "seconds": round(profiled_s, 2),
            "steps": profiled_steps,
            "parts_s": parts,
            "parts_ms_per_step": {k: round(1000 * v / profiled_steps, 2) for k, v in parts.items()},
            "top_own_time": _top_functions(stats, 25),
        },
        "torch_decode_window": torch_window,
        "load_average_at_end": load_average(),
    }
    write_json(args.result_file, result)
    print(
        json.dumps(
            {
                k: result[k]
                for k in (
                    "engine_loop_only",
                    "served_over_grpc_output_tok_s",
                    "grpc_and_streaming_overhead_share",
                )
            },
            indent=2,
        )
    )
    print(json.dumps(result["cprofile"]["parts_ms_per_step"], indent=2))
    print(json.dumps({k: v for k, v in torch_window.items() if k != "top_ops"}, indent=2))
    for row in torch_window["top_ops"][:12]:
        print(f"{row['op']:<40} {row['self_ms_per_step']:>9.2f} ms/step  {row['self_share']:.1%}")
    return 0
