"""What a served token costs without the server: the engine loop alone, and the parts of one decode step.

Measured in this process on the same model and batch size as the served run, as CPU seconds
(`time.process_time`), so the served figure splits into layers:

- forward: `ModelRunner.execute` on a full decode batch, the decoder stack up to the final hidden
  states (input preparation included, shown apart);
- LM head and sampler: `Engine.sample` on those hidden states (for a greedy batch, the LM head's
  slice-wise argmax: no logits are written);
- engine step: `Engine.step` on that batch (forward + LM head and sampler + appending, detokenizing and
  stop checks per sequence);
- engine loop alone: the decode tier's scheduler and engine loop running the whole workload with the
  stream deltas dropped (scheduling, bookkeeping, event log on top of engine steps).

Served CPU minus the engine loop alone is what gRPC, asyncio and message building cost; the engine loop
minus forward, LM head and sampler is the engine thread's per-sequence Python.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

from bench.profile_decode import build_engine_loop, submit_requests
from bench.workload import WorkloadRequest


def _cpu_us_per_token(action: Callable[[], object], repeats: int, tokens_per_call: int) -> float:
    started = time.process_time()
    for _ in range(repeats):
        action()
    return 1e6 * (time.process_time() - started) / (repeats * tokens_per_call)


def _decode_batch(loop, requests: list[WorkloadRequest], steps: int) -> list:
    """Admit `requests` (long enough to outlive `steps` more steps) and step until every one decodes."""
    long = [dataclasses.replace(r, output_len=r.output_len + 2 * steps + 8) for r in requests]
    submit_requests(loop, long, "floor")
    loop.step_once()  # takes the submissions in
    while loop.scheduler.waiting or loop.scheduler.prefilling:
        loop.step_once()
    return [request.seq for request in loop.scheduler.running]


def measure_engine_floor(
    model_dir: Path,
    requests: list[WorkloadRequest],
    max_num_seqs: int,
    budget: int,
    kv_memory_bytes: int,
    steps: int = 30,
) -> dict:
    """CPU µs per generated token of the engine loop alone and of the decode step's parts (see module doc)."""
    from engine.model_runner import ScheduledChunk

    loop = build_engine_loop(model_dir, max_num_seqs, budget, kv_memory_bytes)
    engine = loop.engine
    tokens = sum(r.output_len for r in requests)
    submit_requests(loop, requests[:4], "warmup")
    loop.run_until_idle()

    submit_requests(loop, requests, "alone")
    cpu_started, wall_started = time.process_time(), time.perf_counter()
    num_steps = loop.run_until_idle()
    loop_cpu_s, loop_wall_s = time.process_time() - cpu_started, time.perf_counter() - wall_started

    seqs = _decode_batch(loop, requests, steps)
    for seq in seqs:
        engine.allocate(seq, seq.num_tokens)
    chunks = [ScheduledChunk(seq, 1) for seq in seqs]
    batch = len(chunks)
    hidden = engine.runner.execute(chunks)
    rows = [(seq, ()) for seq in seqs]

    def engine_step() -> None:
        for seq in seqs:
            engine.allocate(seq, seq.num_tokens)
        engine.step([ScheduledChunk(seq, 1) for seq in seqs])

    parts = {
        "prepare_inputs": _cpu_us_per_token(lambda: engine.runner.prepare(chunks), steps, batch),
        "forward_with_prepare": _cpu_us_per_token(lambda: engine.runner.execute(chunks), steps, batch),
        "lm_head_and_sampler": _cpu_us_per_token(lambda: engine.sample(hidden, rows), steps, batch),
        "engine_step": _cpu_us_per_token(engine_step, steps, batch),
    }
    for seq in seqs:
        loop.abort(seq.request_id)
    loop.run_until_idle()
    return {
        "engine_loop_alone": {
            "tokens": tokens,
            "steps": num_steps,
            "cpu_s": round(loop_cpu_s, 3),
            "wall_s": round(loop_wall_s, 3),
            "tok_s": round(tokens / loop_wall_s, 1),
            "cpu_us_per_token": round(1e6 * loop_cpu_s / tokens, 1),
        },
        "decode_step_cpu_us_per_token": {"batch": batch, **{k: round(v, 1) for k, v in parts.items()}},
    }
