"""The physical limit: how many output tokens/s this machine could possibly give for a model and workload.

A small probe measures the machine (read bandwidth by summing a buffer much larger than the caches;
fp32 matmul FLOP/s at the model's own layer shapes and a large square, best of several runs) with the
thread count the servers use. The workload then gives two lower bounds on its run time:

- compute: every matmul FLOP the model must do (linear layers for every prompt and output token, the
  LM head once per output token, attention over each token's context) at the measured FLOP/s;
- memory: every decode step reads all weights once, and there are at least max(longest output,
  output tokens / max batch) steps; plus each decode token's reads of its KV context.

The bound on throughput is output tokens / max(compute, memory). A system's fraction of it says how
much of the machine it uses. Under a request rate the bound is also at most rate x mean output length.

    tandem bench probe [--threads 2] [--num-prompts 64 ...]

The GPU counterpart, for one kernel rather than a workload: `decode_kernel_roofline` counts the bytes
the paged decode kernels must move and the FLOPs they do for one decode step, from the launch plan
(`bench/kernels_gpu.py` prints it beside the device's peak bandwidth, also in `--dry-run`).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.report import results_dir

BYTES_FP32 = 4
BYTES_INT32 = 4


@dataclass(frozen=True)
class MachineProbe:
    threads: int
    read_bandwidth_gbs: float
    matmul_gflops: float
    matmul_gflops_by_shape: dict[str, float]


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP and byte counts need from a Llama-style config."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool

    @classmethod
    def from_config_file(cls, path: Path) -> ModelShape:
        config = json.loads(path.read_text())
        heads = config["num_attention_heads"]
        return cls(
            hidden=config["hidden_size"],
            intermediate=config["intermediate_size"],
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab=config["vocab_size"],
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    @property
    def layer_linear_macs(self) -> int:
        """Multiply-accumulates of one token through one layer's q, k, v, o and gated-MLP matmuls."""
        q_and_o = 2 * self.hidden * self.heads * self.head_dim
        k_and_v = 2 * self.hidden * self.kv_heads * self.head_dim
        return q_and_o + k_and_v + 3 * self.hidden * self.intermediate

    @property
    def lm_head_macs(self) -> int:
        return self.hidden * self.vocab

    @property
    def weight_bytes(self) -> int:
        """Bytes read per forward step: all layer weights plus the LM head (the embedding is a lookup)."""
        return BYTES_FP32 * (self.layers * self.layer_linear_macs + self.lm_head_macs)

    def attention_macs(self, context: int) -> int:
        """QK^T and PV of one query token over `context` keys, all layers."""
        return 2 * self.layers * self.heads * self.head_dim * context

    def kv_bytes(self, context: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * context * BYTES_FP32


def _best_seconds(fn, repeats: int) -> float:
    fn()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def probe_machine(threads: int, shape: ModelShape | None = None, repeats: int = 5) -> MachineProbe:
    """Measure read bandwidth and fp32 matmul FLOP/s with `threads` torch threads (restored after)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB, far beyond any cache
        read_s = _best_seconds(buffer.sum, repeats)
        bandwidth = buffer.numel() * BYTES_FP32 / read_s / 1e9
        shapes = {"square 2048": (2048, 2048, 2048)}
        if shape is not None:
            shapes.update(
                {
                    "256 tok x mlp up": (256, shape.hidden, shape.intermediate),
                    "256 tok x mlp down": (256, shape.intermediate, shape.hidden),
                    "64 tok x lm head": (64, shape.hidden, shape.vocab),
                }
            )
        gflops = {}
        for name, (m, k, n) in shapes.items():
            a, b = torch.randn(m, k), torch.randn(k, n)
            seconds = _best_seconds(lambda a=a, b=b: torch.mm(a, b), repeats)
            gflops[name] = round(2 * m * k * n / seconds / 1e9, 1)
    finally:
        torch.set_num_threads(previous)
    return MachineProbe(threads, round(bandwidth, 2), max(gflops.values()), gflops)


@dataclass(frozen=True)
class WorkloadCost:
    prompt_lens: Sequence[int]
    output_lens: Sequence[int]

    def flops(self, shape: ModelShape) -> float:
        macs = 0
        for prompt, output in zip(self.prompt_lens, self.output_lens, strict=True):
            forwarded = prompt + output - 1  # the last generated token is never fed back
            macs += forwarded * shape.layers * shape.layer_linear_macs + output * shape.lm_head_macs
            # Token at position p attends to p + 1 keys: sum over p of (p + 1).
            macs += shape.attention_macs(forwarded * (forwarded + 1) // 2)
        return 2.0 * macs

    def min_decode_steps(self, max_batch: int) -> int:
        return max(max(self.output_lens), math.ceil(sum(self.output_lens) / max_batch))

    def kv_read_bytes(self, shape: ModelShape) -> float:
        total = 0
        for prompt, output in zip(self.prompt_lens, self.output_lens, strict=True):
            # Decode token j (1..output-1) reads prompt + j cached positions.
            contexts = (output - 1) * prompt + (output - 1) * output // 2
            total += shape.kv_bytes(contexts)
        return float(total)


def throughput_bound(shape: ModelShape, probe: MachineProbe, cost: WorkloadCost, max_batch: int) -> dict:
    """The output tokens/s no system can beat on this machine, and how it was derived."""
    flops = cost.flops(shape)
    compute_s = flops / (probe.matmul_gflops * 1e9)
    steps = cost.min_decode_steps(max_batch)
    memory_bytes = steps * shape.weight_bytes + cost.kv_read_bytes(shape)
    memory_s = memory_bytes / (probe.read_bandwidth_gbs * 1e9)
    output_tokens = sum(cost.output_lens)
    bound_s = max(compute_s, memory_s)
    return {
        "probe": asdict(probe),
        "matmul_tflop": round(flops / 1e12, 3),
        "compute_bound_s": round(compute_s, 2),
        "min_decode_steps": steps,
        "memory_read_gb": round(memory_bytes / 1e9, 2),
        "memory_bound_s": round(memory_s, 2),
        "limited_by": "compute" if compute_s >= memory_s else "memory",
        "output_tokens": output_tokens,
        "mean_output_len": output_tokens / len(cost.output_lens),
        "output_tok_s_bound": round(output_tokens / bound_s, 1),
    }


def rate_bound(limit: dict, request_rate: float) -> float:
    """The throughput bound under an offered load of `request_rate` requests/s."""
    return min(limit["output_tok_s_bound"], request_rate * limit["mean_output_len"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bench.serve import add_workload_arguments

    parser.add_argument("--model", default=None, help="model dir (default: the cached default model)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for the probe (default: 2)")
    parser.add_argument("--max-batch", type=int, default=64, help="largest decode batch (default: 64)")
    add_workload_arguments(parser)
    parser.add_argument("--result-file", type=Path, default=results_dir() / "physical_limit.json")


def run(args: argparse.Namespace) -> int:
    from bench.machine import machine_info
    from bench.report import command_line, write_json
    from bench.serve import build_workload
    from engine.model_store import resolve_model

    model_dir = resolve_model(args.model)
    shape = ModelShape.from_config_file(model_dir / "config.json")
    workload = build_workload(args, shape.vocab)
    cost = WorkloadCost([r.prompt_len for r in workload.requests], [r.output_len for r in workload.requests])
    limit = throughput_bound(shape, probe_machine(args.threads, shape), cost, args.max_batch)
    print(json.dumps(limit, indent=2))
    write_json(
        args.result_file,
        {
            "benchmark": "physical_limit",
            "machine": machine_info(),
            "command": command_line(),
            "model": model_dir.name,
            "workload": workload.description,
            "max_batch": args.max_batch,
            "physical_limit": limit,
        },
    )
    return 0


@dataclass(frozen=True)
class DecodeAttentionStep:
    """One decode step of paged attention as launched: the shapes and the split plan chosen for them."""

    batch: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype_bytes: int
    num_splits: int
    kv_tile: int  # context positions per K/V tile (BLOCK_N)
    dot_rows: int  # query rows of one program's dot: the GQA group padded to the smallest dot


def decode_kernel_roofline(step: DecodeAttentionStep, peak_bytes_per_s: float) -> dict:
    """Memory traffic and FLOPs of one decode step, and the time bandwidth alone allows.

    Every sequence has `context` cached tokens. Compulsory traffic, what any kernel must move: each
    K and V row of every sequence's context once, the block-table entries covering the context,
    the query, the sequence lengths, and the output. The plan adds, with splits, an fp32 partial
    output and a log-sum-exp per (sequence, head, split) that the decode kernel writes and the
    merge kernel reads back. Useful FLOPs are QK^T and PV, 2 x head_dim each per (head, position);
    issued FLOPs are what the tensor cores execute, with the GQA group padded to `dot_rows` and
    the context to whole K/V tiles.
    """
    b, heads, d, e = step.batch, step.num_heads, step.head_dim, step.dtype_bytes
    kv = 2 * b * step.context * step.num_kv_heads * d * e
    tables = b * math.ceil(step.context / step.block_size) * BYTES_INT32
    queries = b * heads * d * e
    seq_lens = b * BYTES_INT32
    output = b * heads * d * e
    compulsory = kv + tables + queries + seq_lens + output
    split_traffic = 0
    if step.num_splits > 1:
        partials = b * heads * step.num_splits * (d + 1) * BYTES_FP32  # outputs and log-sum-exps
        split_traffic = 2 * partials + seq_lens  # written by the decode kernel, read by the merge
    flops = 4 * b * heads * step.context * d
    padded_context = math.ceil(step.context / step.kv_tile) * step.kv_tile
    issued_flops = 4 * b * step.num_kv_heads * step.dot_rows * padded_context * d
    return {
        "kv_bytes": kv,
        "block_table_bytes": tables,
        "query_bytes": queries,
        "output_bytes": output,
        "compulsory_bytes": compulsory,
        "split_bytes": split_traffic,
        "planned_bytes": compulsory + split_traffic,
        "flops": flops,
        "issued_flops": issued_flops,
        "flops_per_byte": flops / compulsory,
        "min_seconds": compulsory / peak_bytes_per_s,
        "planned_min_seconds": (compulsory + split_traffic) / peak_bytes_per_s,
    }
