"""The quantized KV cache (`--kv-cache-dtype`) on the real model, in one process: greedy agreement with a
full-precision cache on held-out prompts (and where the rest diverge), per-token-and-head scales against
per-block ones, KV blocks per memory budget, KV bytes on the wire, and single-stream decode speed.

    python -m bench.kv_quant [--model DIR] [--tokens 64] [--out FILE]

Scale granularity is measured with fake quantization: the cache stays fp32 and attention reads it
quantized and dequantized (per token and head, or per block and head with the block's maximum over the
tokens it holds so far; keys rotated as the real cache stores them, or not). Per-block is thereby at its
best, as if every write requantized its block from fp32; a real per-block cache would also re-round or
clip earlier tokens. Besides greedy agreement (a single flipped near-tie changes everything after it),
each variant gets the teacher-forced next-token KL divergence from full precision over every position of
the full-precision replies. The agreement of the real int8 and fp8 caches is measured through the engine
as it serves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.report import results_dir
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine, GenerateRequest
from engine.model_runner import ScheduledChunk
from engine.params import SamplingParams, StoppingParams
from kernels import torch_reference as ref
from kernels.kv_quant import kv_rotation
from kv_transfer import PagedKV
from serving.kv_layout import engine_kv_layout

# Held out: used by no other test or benchmark, and chosen before any result was seen.
HELD_OUT_PROMPTS = (
    "Give me three tips for staying focused while studying.",
    "What does a compiler do? Keep it short.",
    "Write a limerick about a cat who loves boxes.",
    "Explain photosynthesis to a ten-year-old.",
    "What is the difference between a list and a tuple in Python?",
    "Suggest a name for a bakery that sells only bread.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "How many minutes are there in a week? Show your work.",
    "Describe the color blue to someone who cannot see.",
    "What are the main causes of inflation?",
    "Write a short email asking a colleague to review a document.",
    "Why do leaves change color in autumn?",
    "List four planets of the solar system and one fact about each.",
    "What is a good breakfast for a long hike?",
    "Explain what an API is, with an everyday analogy.",
    "Translate 'the library opens at nine' into French.",
    "Give two arguments for and two against working from home.",
    "What is recursion? Give a tiny example.",
    "Write a haiku about a train at night.",
    "How does a refrigerator keep food cold?",
)
KV_DTYPES = ("auto", "int8", "fp8_e4m3")
GREEDY = SamplingParams(temperature=0.0)
NUM_BLOCKS = 1024


def chat_prompts(engine: Engine, texts: tuple[str, ...] = HELD_OUT_PROMPTS) -> list[list[int]]:
    return [engine.tokenizer.apply_chat_template([{"role": "user", "content": text}]) for text in texts]


def load_engine(model_dir: Path, kv_cache_dtype: str, num_blocks: int = NUM_BLOCKS) -> Engine:
    config = EngineConfig(cache=CacheConfig(num_blocks=num_blocks), kv_cache_dtype=kv_cache_dtype)
    return Engine.from_pretrained(model_dir, config)


def greedy_replies(engine: Engine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Greedy continuations, `tokens` each (EOS ignored, as the parity tests do), all in one batch."""
    stopping = StoppingParams(max_tokens=tokens, ignore_eos=True)
    requests = [GenerateRequest(p, GREEDY, stopping) for p in prompts]
    return [seq.output_token_ids for seq in engine.generate(requests, max_num_batched_tokens=512)]


def compare(engine: Engine, expected: list[list[int]], got: list[list[int]]) -> dict:
    """How many replies agree token for token, and for the others where and how they part."""
    divergences = []
    for index, (want, have) in enumerate(zip(expected, got, strict=True)):
        first = next((i for i, (a, b) in enumerate(zip(want, have, strict=True)) if a != b), None)
        if first is not None:
            divergences.append(
                {
                    "prompt": index,
                    "first_differing_token": first,
                    "common": engine.tokenizer.decode(want[:first]),
                    "full_precision": engine.tokenizer.decode(want[first : first + 8]),
                    "quantized": engine.tokenizer.decode(have[first : first + 8]),
                }
            )
    return {"agree": len(expected) - len(divergences), "of": len(expected), "divergences": divergences}


def fake_quantize(cache: torch.Tensor, per_block: bool, rotation: torch.Tensor | None) -> torch.Tensor:
    """`cache` [blocks, block_size, heads, d] through int8 and back, one scale per (token, head) or per
    (block, head) over the block's slots (unwritten slots are zero and do not raise the maximum); rotated
    by `rotation` before and back after, as a quantized cache stores keys."""
    rows = cache if rotation is None else cache @ rotation
    if per_block:
        scale = rows.abs().amax(dim=(1, 3), keepdim=True) / 127.0
        rows = (rows / torch.where(scale > 0, scale, 1.0)).round().clamp(-127, 127) * scale
    else:
        rows = ref.dequantize_kv(*ref.quantize_kv(rows, torch.int8))
    return rows if rotation is None else rows @ rotation.T


def with_fake_quantized_attention(engine: Engine, per_block: bool, rotate_keys: bool) -> Engine:
    """The engine's attention reading its fp32 cache through `fake_quantize` (decode stack off)."""
    attention: Callable[..., torch.Tensor] = engine.backend.attention
    rotation = kv_rotation(engine.model_config.head_dim) if rotate_keys else None

    def quantized_attention(query, k_cache, v_cache, meta, scale, k_scales=None, v_scales=None):
        keys = fake_quantize(k_cache, per_block, rotation)
        return attention(query, keys, fake_quantize(v_cache, per_block, None), meta, scale)

    engine.backend.attention = quantized_attention
    engine.model.decode_stack = None
    return engine


def teacher_forced(engine: Engine, prompts: list[list[int]], replies: list[list[int]]) -> list[torch.Tensor]:
    """Log-probabilities the engine gives each position of the replies, the replies fed in (one forward
    per prompt): a measure of the cache's error that one early flipped token does not dominate."""
    out = []
    for prompt, reply in zip(prompts, replies, strict=True):
        seq = engine.make_sequence(prompt + reply, GREEDY, StoppingParams(max_tokens=1))
        engine.allocate(seq, seq.num_tokens)
        start = seq.num_computed_tokens
        ids, positions, meta = engine.runner.prepare([ScheduledChunk(seq, seq.num_tokens - start)])
        hidden = engine.model(ids, positions, engine.kv_cache, meta)
        rows = hidden[len(prompt) - 1 - start : seq.num_tokens - 1 - start]
        out.append(engine.model.compute_logits(rows).log_softmax(-1))
        engine.free(seq)
    return out


def divergence(expected: list[torch.Tensor], got: list[torch.Tensor]) -> dict:
    """Mean next-token KL(full precision || quantized) and top-1 agreement over every reply position."""
    positions = sum(len(e) for e in expected)
    kl = sum(
        torch.nn.functional.kl_div(g, e, log_target=True, reduction="sum").item()
        for e, g in zip(expected, got, strict=True)
    )
    same = sum((e.argmax(-1) == g.argmax(-1)).sum().item() for e, g in zip(expected, got, strict=True))
    return {
        "kl": float(f"{kl / positions:.3g}"),
        "top1_agreement": round(same / positions, 4),
        "positions": positions,
    }


def scale_granularity(
    model_dir: Path, prompts: list[list[int]], replies: list[list[int]], tokens: int
) -> dict:
    """Fake-quantized int8 caches: per token or per block, keys rotated or not; teacher-forced
    divergence and greedy agreement, each against the full-precision cache."""
    expected = teacher_forced(load_engine(model_dir, "auto"), prompts, replies)
    results = {}
    for name, per_block, rotate in (
        ("per_token_rotated_keys", False, True),
        ("per_block_rotated_keys", True, True),
        ("per_token_plain_keys", False, False),
    ):
        engine = with_fake_quantized_attention(load_engine(model_dir, "auto"), per_block, rotate)
        results[name] = {
            **divergence(expected, teacher_forced(engine, prompts, replies)),
            "greedy": compare(engine, replies, greedy_replies(engine, prompts, tokens)),
        }
    return results


def reconstruction_error(model_dir: Path, prompts: list[list[int]]) -> dict:
    """Relative RMS error of the prompts' K and V (every layer) through int8: per token or per block,
    keys rotated or not."""
    engine = load_engine(model_dir, "auto")
    rotation = kv_rotation(engine.model_config.head_dim)
    variants = {
        "per_token": (False, None),
        "per_block": (True, None),
        "per_token_rotated": (False, rotation),
        "per_block_rotated": (True, rotation),
    }
    errors: dict[str, list[float]] = {f"{name}_{kv}": [] for name in variants for kv in "kv"}
    for prompt in prompts:
        seq = engine.make_sequence(prompt, GREEDY, StoppingParams(max_tokens=1))
        engine.allocate(seq, seq.num_tokens)
        engine.runner.execute([ScheduledChunk(seq, seq.num_tokens - seq.num_computed_tokens)])
        blocks = torch.tensor(seq.block_table, dtype=torch.long)
        for kv, caches in (("k", engine.kv_cache.k), ("v", engine.kv_cache.v)):
            for cache in caches:
                rows = cache.index_select(0, blocks)
                for name, (per_block, rotate) in variants.items():
                    error = (fake_quantize(rows, per_block, rotate) - rows).norm() / rows.norm()
                    errors[f"{name}_{kv}"].append(error.item())
        engine.free(seq)
    return {name: round(statistics.fmean(values), 5) for name, values in errors.items()}


def blocks_in_budget(model_dir: Path, memory: int = 2 << 30) -> dict:
    """KV blocks `--kv-cache-memory` holds for each KV dtype, and their ratio to float32's."""
    engine = load_engine(model_dir, "auto", num_blocks=1)
    budget = CacheConfig(memory_bytes=memory)
    counts = {
        kv: budget.resolve_num_blocks(engine.model_config, EngineConfig(kv_cache_dtype=kv).kv_dtype)
        for kv in KV_DTYPES
    }
    return {
        "memory_bytes": memory,
        "blocks": counts,
        "ratio_to_float32": {k: round(v / counts["auto"], 3) for k, v in counts.items()},
    }


def wire_bytes(model_dir: Path, prompt: list[int]) -> dict:
    """Bytes of the KV messages (framing included) a prefill replica sends for one prompt, per KV dtype."""
    sent = {}
    for kv in KV_DTYPES:
        engine = load_engine(model_dir, kv, num_blocks=64)
        seq = engine.make_sequence(prompt, GREEDY, StoppingParams(max_tokens=1))
        engine.allocate(seq, seq.num_tokens)
        engine.runner.execute([ScheduledChunk(seq, seq.num_tokens - seq.num_computed_tokens)])
        paged = PagedKV.of(engine.kv_cache, engine_kv_layout(engine))
        frames = paged.frames(seq.block_table, 0, len(seq.block_table), num_tokens=seq.num_tokens)
        sent[kv] = sum(len(frame.data) for frame in frames)
    return {
        "prompt_tokens": len(prompt),
        "bytes": sent,
        "ratio_to_float32": {k: round(v / sent["auto"], 4) for k, v in sent.items()},
    }


def decode_speed(
    model_dir: Path, tokens: list[int], contexts: tuple[int, ...], new_tokens: int, repeats: int
) -> dict:
    """Single-stream decode tokens/s after a prompt of each context length (its prefill not timed): the
    median of `repeats` runs of `new_tokens` tokens per KV dtype. The dtypes take turns run by run, so a
    change in the machine's load (it is shared) weighs on each alike."""
    engines = {kv: load_engine(model_dir, kv, num_blocks=max(contexts) // 16 + 64) for kv in KV_DTYPES}
    speeds: dict[str, dict[int, float]] = {kv: {} for kv in KV_DTYPES}
    for context in contexts:
        prompt = (tokens * (context // len(tokens) + 1))[:context]
        stopping = StoppingParams(max_tokens=(repeats + 1) * new_tokens + 1, ignore_eos=True)
        seqs = {}
        for kv, engine in engines.items():
            seqs[kv] = seq = engine.make_sequence(prompt, GREEDY, stopping)
            engine.allocate(seq, seq.num_tokens)
            engine.step([ScheduledChunk(seq, seq.num_tokens - seq.num_computed_tokens)])
        runs: dict[str, list[float]] = {kv: [] for kv in KV_DTYPES}
        for _ in range(repeats + 1):  # the first run of each warms up
            for kv, engine in engines.items():
                seq = seqs[kv]
                started = time.perf_counter()
                for _ in range(new_tokens):
                    engine.allocate(seq, seq.num_tokens)
                    engine.step([ScheduledChunk(seq, 1)])
                runs[kv].append(new_tokens / (time.perf_counter() - started))
        for kv, engine in engines.items():
            engine.free(seqs[kv])
            speeds[kv][context] = round(statistics.median(runs[kv][1:]), 1)
    return {"new_tokens": new_tokens, "threads": torch.get_num_threads(), "tok_s_by_context": speeds}


def run_all(model_dir: Path, tokens: int, repeats: int) -> dict:
    reference = load_engine(model_dir, "auto")
    prompts = chat_prompts(reference)
    expected = greedy_replies(reference, prompts, tokens)
    agreement = {}
    for kv in KV_DTYPES[1:]:
        engine = load_engine(model_dir, kv)
        agreement[kv] = compare(engine, expected, greedy_replies(engine, prompts, tokens))
    long_prompt = [token for prompt in prompts for token in prompt][:1000]
    return {
        "load_average": os.getloadavg(),
        "new_tokens": tokens,
        "agreement_with_full_precision": agreement,
        "scale_granularity_int8": scale_granularity(model_dir, prompts, expected, tokens),
        "kv_reconstruction_error": reconstruction_error(model_dir, prompts),
        "blocks_in_2GiB": blocks_in_budget(model_dir),
        "wire": wire_bytes(model_dir, long_prompt),
        "single_stream_decode": decode_speed(
            model_dir, [t for p in prompts for t in p], (100, 1000, 4000), 32, repeats
        ),
    }


def main(argv: list[str] | None = None) -> int:
    from engine.model_store import resolve_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per reply (default: 64)")
    parser.add_argument("--repeats", type=int, default=5, help="timed decode runs per KV dtype (default: 5)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=results_dir() / "kv_quant.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = run_all(resolve_model(args.model), args.tokens, args.repeats)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
