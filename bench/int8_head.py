"""What `--quantization int8` holds and reads for the LM head and embedding: the process's resident memory
after the engine loads, the bytes the head and the embedding keep, single-stream greedy decode speed, and
what the head costs at a few row counts with and without the argmax (whether a greedy int8 head that never
writes the logits would pay).

A probe for one model at a time, in this process; figures are indicative on a shared machine (the host's
CPU model and load average are printed beside them).

    .venv/bin/python -m bench.int8_head --model ~/.cache/tandem/models/gemma-3-270m [--rounds 5]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import statistics
import time
from pathlib import Path


def resident_mib() -> float:
    """This process's resident set (VmRSS), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def trimmed_resident_mib() -> float:
    """VmRSS once the garbage is collected and glibc has handed its free heap back (`malloc_trim`): what
    the process holds, without what the load freed but the allocator kept."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return resident_mib()


def host() -> dict:
    """The CPU model (lscpu's name, from /proc/cpuinfo) and the load averages when measured."""
    names = [
        line.split(":", 1)[1].strip()
        for line in Path("/proc/cpuinfo").read_text().splitlines()
        if line.startswith("model name")
    ]
    return {
        "cpu": names[0] if names else platform.processor(),
        "cores": os.cpu_count(),
        "load": os.getloadavg(),
    }


def held_bytes(module) -> int:
    """Bytes of the distinct tensors (parameters and buffers) a module holds; shared storage counts once."""
    seen, total = set(), 0
    for tensor in [*module.parameters(), *module.buffers()]:
        key = tensor.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += tensor.untyped_storage().nbytes()
    return total


def head_costs(engine, rows_list: list[int], repeats: int) -> dict:
    """Milliseconds of the logits alone and of logits + argmax, per call, at each row count."""
    import torch

    model = engine.model
    out = {}
    for rows in rows_list:
        hidden = torch.randn(rows, engine.model_config.hidden_size)
        model.compute_logits(hidden)
        start = time.perf_counter()
        for _ in range(repeats):
            model.compute_logits(hidden)
        logits_ms = (time.perf_counter() - start) / repeats * 1e3
        start = time.perf_counter()
        for _ in range(repeats):
            model.greedy_tokens(hidden)
        out[rows] = {
            "logits_ms": round(logits_ms, 2),
            "greedy_ms": round((time.perf_counter() - start) / repeats * 1e3, 2),
        }
    return out


def decode_step_ms(engine, seq, steps: int) -> float:
    """Milliseconds per single-stream decode step (forward, greedy sample, append) over `steps` steps."""
    from engine.model_runner import ScheduledChunk

    engine.allocate(seq, seq.num_tokens + steps)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step([ScheduledChunk(seq, 1)])
    return (time.perf_counter() - start) / steps * 1e3


def fp32_pair(engine):
    """The head and embedding the engine held before they were quantized: an fp32 `CpuLinear` (the GEMV,
    oneDNN beyond) and an `nn.Embedding`, over the dequantized int8 matrix (as fast as the checkpoint's)."""
    import torch
    from torch import nn

    from kernels import cpu_linear
    from kernels.int8_linear import dequantize

    head = engine.model.lm_head
    weight = nn.Parameter(dequantize(head.qweight, head.scale), requires_grad=False)
    linear = nn.Linear(head.in_features, head.out_features, bias=False)
    linear.weight = weight
    fp32_head = cpu_linear.CpuLinear(linear, engine.platform.extension) if cpu_linear.available() else linear
    return fp32_head, nn.Embedding.from_pretrained(weight).to(torch.float32)


def decode_ab(engine, steps: int, rounds: int) -> dict:
    """Single-stream decode tok/s of the int8 head and embedding against the fp32 pair, in this process,
    alternating bursts of `steps` steps (a burst of load from elsewhere hits both alike); median, best."""
    from engine.model_runner import ScheduledChunk
    from engine.params import SamplingParams, StoppingParams

    model = engine.model
    pairs = {"int8": (model.lm_head, model.embed_tokens), "fp32": fp32_pair(engine)}
    greedy, stopping = SamplingParams(temperature=0.0), StoppingParams(max_tokens=steps + 1, ignore_eos=True)
    times: dict[str, list[float]] = {name: [] for name in pairs}
    for _ in range(rounds):
        for name, (head, embedding) in pairs.items():
            model.lm_head, model.embed_tokens = head, embedding
            seq = engine.make_sequence(list(range(100, 116)), greedy, stopping)
            engine.allocate(seq, seq.num_tokens + 1)
            engine.step([ScheduledChunk(seq, seq.num_tokens)])
            times[name].append(decode_step_ms(engine, seq, steps))
            engine.free(seq)
    model.lm_head, model.embed_tokens = pairs["int8"]
    return {
        name: {
            "median_tok_s": round(1e3 / statistics.median(ms), 1),
            "best_tok_s": round(1e3 / min(ms), 1),
        }
        for name, ms in times.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32, help="decode steps per burst")
    parser.add_argument("--rounds", type=int, default=5, help="bursts per head, alternating")
    parser.add_argument("--rows", default="1,8,64", help="row counts for the head costs")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import torch

    from engine.config import CacheConfig, EngineConfig
    from engine.engine import Engine

    torch.set_num_threads(args.threads)
    config = EngineConfig(quantization="int8", cache=CacheConfig(num_blocks=64), enable_prefix_caching=False)
    before = resident_mib()
    engine = Engine.from_pretrained(args.model.expanduser(), config)
    model = engine.model
    report = {
        "model": args.model.name,
        "host": host(),
        "rss_before_load_mib": round(before, 1),
        "rss_after_load_mib": round(resident_mib(), 1),
        "rss_after_load_trimmed_mib": round(trimmed_resident_mib(), 1),
        "embedding_and_head_bytes": held_bytes(torch.nn.ModuleList([model.embed_tokens, model.lm_head])),
        "head_module": type(model.lm_head).__name__,
        "decode_ab": decode_ab(engine, args.new_tokens, args.rounds),
        "head_costs": head_costs(engine, [int(r) for r in args.rows.split(",")], args.repeats),
    }
    report["host"]["load_after"] = os.getloadavg()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
