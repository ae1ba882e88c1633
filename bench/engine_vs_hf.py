"""Decode throughput of tandem's engine vs Hugging Face `generate`, same model, prompt and run.

Measures greedy generation of a fixed number of new tokens (EOS ignored) at batch 1 and batch
16, for both, back to back in one process, and prints the ratio. Results go to a JSON file.

    python -m bench.engine_vs_hf [--model DIR] [--new-tokens 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from bench.report import results_dir
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine, GenerateRequest
from engine.model_store import resolve_model
from engine.params import SamplingParams, StoppingParams

PROMPT = "Explain, step by step, how a paged KV cache lets a server batch many requests."


def time_hf(model, prompt_ids: list[int], batch: int, new_tokens: int) -> float:
    ids = torch.tensor([prompt_ids] * batch)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
        return time.perf_counter() - start


def time_engine(engine: Engine, prompt_ids: list[int], batch: int, new_tokens: int) -> float:
    stopping = StoppingParams(max_tokens=new_tokens, ignore_eos=True)
    requests = [GenerateRequest(prompt_ids, SamplingParams(temperature=0.0), stopping) for _ in range(batch)]
    start = time.perf_counter()
    engine.generate(requests, max_num_batched_tokens=2048, max_num_seqs=batch)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model dir (default: the cached SmolLM2-135M-Instruct)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--out", type=Path, default=results_dir() / "engine_vs_hf.json")
    args = parser.parse_args()
    model_dir = resolve_model(args.model)
    engine = Engine.from_pretrained(
        model_dir, EngineConfig(dtype=torch.float32, cache=CacheConfig(block_size=16, num_blocks=512))
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt_ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    time_engine(engine, prompt_ids, 1, 8)
    time_hf(hf, prompt_ids, 1, 8)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        tokens = batch * args.new_tokens
        ours = tokens / time_engine(engine, prompt_ids, batch, args.new_tokens)
        theirs = tokens / time_hf(hf, prompt_ids, batch, args.new_tokens)
        rows.append(
            {
                "batch": batch,
                "tandem_tok_s": round(ours, 1),
                "hf_tok_s": round(theirs, 1),
                "ratio": round(ours / theirs, 2),
            }
        )
        print(
            f"batch {batch:>3}: tandem {ours:7.1f} tok/s   HF generate {theirs:7.1f} tok/s   "
            f"ratio {ours / theirs:.2f}x"
        )
    result = {
        "benchmark": "engine_vs_hf",
        "model": model_dir.name,
        "dtype": "float32",
        "prompt_tokens": len(prompt_ids),
        "new_tokens": args.new_tokens,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
