"""What quantizing activations costs in quality: held-out perplexity and greedy agreement of
`--quantization none`, `int8` (weight-only) and `w8a8_int8` on one model, in this process.

    .venv/bin/python -m bench.w8a8_quality --model ~/.cache/tandem/models/gemma-3-270m [--texts 8]

Perplexity: each held-out text (about 512 tokens) is prefilled in one chunk and scored token by token
(teacher forcing). Agreement: 64 greedy tokens after the first 128 tokens of each text, compared with
full precision's: the share of continuations identical to it and the mean length of the common prefix.
Prints JSON with the machine (CPU model, cores, load average) beside the figures.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

METHODS = ("none", "int8", "w8a8_int8")
ROWS_PER_LOGITS = 64


def text_nll(engine, tokens: list[int]) -> tuple[float, int]:
    """Summed negative log-likelihood of tokens[1:] given their prefixes, and how many were scored."""
    import torch

    from engine.model_runner import ScheduledChunk
    from engine.params import SamplingParams, StoppingParams

    seq = engine.make_sequence(tokens, SamplingParams(temperature=0.0), StoppingParams(max_tokens=1))
    engine.allocate(seq, seq.num_tokens)
    input_ids, positions, meta = engine.runner.prepare([ScheduledChunk(seq, seq.num_tokens)])
    total = 0.0
    with torch.inference_mode():
        hidden = engine.model(input_ids, positions, engine.kv_cache, meta)
        targets = torch.tensor(tokens[1:])
        for start in range(0, len(tokens) - 1, ROWS_PER_LOGITS):
            end = min(start + ROWS_PER_LOGITS, len(tokens) - 1)
            logits = engine.model.compute_logits(hidden[start:end]).float()
            total += torch.nn.functional.cross_entropy(logits, targets[start:end], reduction="sum").item()
    engine.free(seq)
    return total, len(tokens) - 1


def greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from engine.engine import GenerateRequest
    from engine.params import SamplingParams, StoppingParams

    stopping = StoppingParams(max_tokens=max_tokens, ignore_eos=True)
    requests = [GenerateRequest(p, SamplingParams(temperature=0.0), stopping) for p in prompts]
    return [seq.output_token_ids for seq in engine.generate(requests, max_num_seqs=8)]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--texts", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from bench.heldout_text import heldout_prompts, spread_lengths
    from bench.machine import machine_info
    from engine.config import CacheConfig, EngineConfig
    from engine.engine import Engine
    from engine.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    model_dir = args.model.expanduser()
    tokenizer = Tokenizer.from_pretrained(model_dir)
    texts = heldout_prompts(spread_lengths(args.texts, 500, 520), lambda text: len(tokenizer.encode(text)))
    token_lists = [tokenizer.encode(text)[:512] for text in texts]
    prompts = [tokens[:128] for tokens in token_lists]
    report: dict = {"model": model_dir.name, "machine": machine_info(), "texts": len(token_lists)}
    report["methods"] = {}
    outputs = {}
    for method in METHODS:
        config = EngineConfig(
            quantization=method, cache=CacheConfig(num_blocks=1024), enable_prefix_caching=False
        )
        engine = Engine.from_pretrained(model_dir, config)
        nll, count = map(sum, zip(*(text_nll(engine, tokens) for tokens in token_lists), strict=True))
        outputs[method] = greedy(engine, prompts, 64)
        report["methods"][method] = {"perplexity": round(math.exp(nll / count), 4), "scored_tokens": count}
        del engine
    for method in METHODS[1:]:
        pairs = list(zip(outputs[method], outputs["none"], strict=True))
        figures = report["methods"][method]
        figures["greedy_identical_to_none"] = sum(a == b for a, b in pairs) / len(pairs)
        figures["mean_common_prefix_of_64"] = sum(common_prefix(a, b) for a, b in pairs) / len(pairs)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
