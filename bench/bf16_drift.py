"""bf16 against fp32 on a real model: how far `--dtype bfloat16` drifts from the parity mode, what it costs
in decode speed, and what it saves in memory.

For each of `--prompts` held-out prompts (`bench.heldout_text`, 32 to 512 tokens) both engines decode
`--new-tokens` greedy tokens; the figures are how many tokens agree before the first divergence, and the
max / mean |logit difference| at the first step. Decode tok/s is single-stream, fp32, bf16 and int8 runs
interleaved `--rounds` times (the best of each kept), so a machine shared with other work slows all three
alike. Model memory is the bytes of the loaded model's parameters, buffers and kernel copies.

    python -m bench.bf16_drift [--model DIR] [--prompts 12] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.heldout_text import heldout_prompts, spread_lengths
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine, GenerateRequest
from engine.model_store import default_model_dir
from engine.params import SamplingParams, StoppingParams

GREEDY = SamplingParams(temperature=0.0)


def load(model_dir: Path, dtype: torch.dtype, quantization: str = "none") -> Engine:
    config = EngineConfig(
        dtype=dtype, quantization=quantization, cache=CacheConfig(block_size=16, num_blocks=256)
    )
    return Engine.from_pretrained(model_dir, config)


def model_bytes(engine: Engine) -> int:
    """Bytes of distinct storages the model holds: tied weights once, oneDNN's opaque blocked copies (fp32)
    by their elements."""
    storages: dict[int, int] = {}
    for module in engine.model.modules():
        tensors = [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                continue
            if tensor.is_mkldnn:
                storages[id(tensor)] = tensor.numel() * tensor.element_size()
            else:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def greedy_run(engine: Engine, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """The greedy continuation and the first step's fp32 logits."""
    captured: list[torch.Tensor] = []
    compute = engine.model.compute_logits
    engine.model.compute_logits = lambda hidden: captured.append(compute(hidden).float()) or captured[-1]
    try:
        stopping = StoppingParams(max_tokens=new_tokens, ignore_eos=True)
        (seq,) = engine.generate([GenerateRequest(prompt, GREEDY, stopping)])
    finally:
        del engine.model.compute_logits
    return seq.output_token_ids, captured[0][-1]


def agreement(a: list[int], b: list[int]) -> int:
    """Tokens equal before the first divergence."""
    for index, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            return index
    return len(a)


def decode_tok_s(engine: Engine, prompt: list[int], new_tokens: int) -> float:
    stopping = StoppingParams(max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.generate([GenerateRequest(prompt, GREEDY, stopping)])
    return new_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model_dir = args.model or default_model_dir()
    engines = {
        "fp32": load(model_dir, torch.float32),
        "bf16": load(model_dir, torch.bfloat16),
        "int8": load(model_dir, torch.float32, "int8"),
    }
    tokenizer = engines["fp32"].tokenizer
    texts = heldout_prompts(spread_lengths(args.prompts, 32, 512), lambda text: len(tokenizer.encode(text)))
    prompts = [tokenizer.encode(text) for text in texts]
    agreed, max_diff, mean_diff = [], [], []
    for prompt in prompts:
        exact, exact_logits = greedy_run(engines["fp32"], prompt, args.new_tokens)
        ours, logits = greedy_run(engines["bf16"], prompt, args.new_tokens)
        agreed.append(agreement(exact, ours))
        diff = (logits - exact_logits).abs()
        max_diff.append(float(diff.max()))
        mean_diff.append(float(diff.mean()))
    speeds: dict[str, float] = {name: 0.0 for name in engines}
    for name in engines:
        decode_tok_s(engines[name], prompts[0], 8)  # warm-up
    for _ in range(args.rounds):
        for name, engine in engines.items():
            speeds[name] = max(speeds[name], decode_tok_s(engine, prompts[0], args.new_tokens))
    report = {
        "model": model_dir.name,
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "greedy_agreement_tokens": agreed,
        "fully_equal": sum(a == args.new_tokens for a in agreed),
        "first_step_max_abs_logit_diff": max(max_diff),
        "first_step_mean_abs_logit_diff": sum(mean_diff) / len(mean_diff),
        "first_step_max_abs_logit_diff_per_prompt": [round(d, 4) for d in max_diff],
        "decode_tok_s": {name: round(speed, 2) for name, speed in speeds.items()},
        "model_mib": {name: round(model_bytes(engine) / 2**20, 1) for name, engine in engines.items()},
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
