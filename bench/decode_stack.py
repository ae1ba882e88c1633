"""Single-stream decode speed with the C++ decode stack (`kernels.cpu_decode_stack`) against the per-op
layer loop (what `TANDEM_CPU_DECODE_STACK=0` serves), on one engine in this process, and whether both
give the same greedy tokens.

The two variants alternate in bursts (`--rounds` each), so a burst of load from elsewhere on a shared
machine hits both alike; each burst prefills the same prompt afresh and decodes `--new-tokens` tokens.
Prints the median and best tok/s of each, their ratio, and the host's CPU model and load beside them.

    .venv/bin/python -m bench.decode_stack --model ~/.cache/tandem/models/gemma-3-270m [--quantization int8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from bench.int8_head import host


def decode_burst(engine, prompt: list[int], steps: int) -> tuple[float, list[int]]:
    """Seconds of `steps` single-stream greedy decode steps after prefilling `prompt`, and the tokens."""
    from engine.model_runner import ScheduledChunk
    from engine.params import SamplingParams, StoppingParams

    greedy, stopping = SamplingParams(temperature=0.0), StoppingParams(max_tokens=steps + 1, ignore_eos=True)
    seq = engine.make_sequence(prompt, greedy, stopping)
    engine.allocate(seq, seq.num_tokens + steps + 1)
    engine.step([ScheduledChunk(seq, seq.num_tokens)])
    start = time.perf_counter()
    for _ in range(steps):
        engine.step([ScheduledChunk(seq, 1)])
    seconds = time.perf_counter() - start
    tokens = list(seq.output_token_ids)
    engine.free(seq)
    return seconds, tokens


def stack_ab(engine, prompt: list[int], steps: int, rounds: int) -> dict:
    """tok/s of the stack and of the per-op loop, alternating bursts; whether their tokens agree."""
    model = engine.model
    variants = {"stack": model.decode_stack, "per_op": None}
    if variants["stack"] is None:
        raise SystemExit("this model and platform build no decode stack: nothing to compare")
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    tokens: dict[str, list[list[int]]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, stack in variants.items():
            model.decode_stack = stack
            elapsed, generated = decode_burst(engine, prompt, steps)
            seconds[name].append(elapsed)
            tokens[name].append(generated)
    model.decode_stack = variants["stack"]
    speeds = {
        name: {
            "median_tok_s": round(steps / statistics.median(times), 1),
            "best_tok_s": round(steps / min(times), 1),
            "bursts_tok_s": [round(steps / t, 1) for t in times],
        }
        for name, times in seconds.items()
    }
    return {
        **speeds,
        "speedup_median": round(speeds["stack"]["median_tok_s"] / speeds["per_op"]["median_tok_s"], 2),
        "tokens_equal": all(a == b for a, b in zip(tokens["stack"], tokens["per_op"], strict=True)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--quantization", default="int8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64, help="decode steps per burst")
    parser.add_argument("--rounds", type=int, default=3, help="bursts per variant, alternating")
    args = parser.parse_args()

    import torch

    from engine.config import CacheConfig, EngineConfig
    from engine.engine import Engine

    torch.set_num_threads(args.threads)
    config = EngineConfig(
        quantization=args.quantization, cache=CacheConfig(num_blocks=256), enable_prefix_caching=False
    )
    engine = Engine.from_pretrained(args.model.expanduser(), config)
    prompt = [100 + (7 * i) % 5000 for i in range(args.prompt_tokens)]
    report = {
        "model": args.model.name,
        "quantization": args.quantization,
        "threads": args.threads,
        "host": host(),
        "decode": stack_ab(engine, prompt, args.new_tokens, args.rounds),
    }
    report["host"]["load_after"] = os.getloadavg()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
