"""The CPU linear kernels side by side on a model's decoder projections: time per layer and GB/s.

For each row count (tokens in a step) it runs every decoder projection of the model (qkv, o, gate_up,
down, at the default model's shapes unless `--model` names another) through the fp32 GEMV, oneDNN's
fp32 linear, the int8-weight GEMV and the int8-weight GEMM, over `--layers` distinct copies of the
weights so they come from memory as in a real step rather than from cache. Reports µs for one layer's
four projections and, for the GEMVs, the weight bytes streamed per second. This is what picks
`int8_linear.GEMV_MAX_ROWS` (where the GEMV stops beating the GEMM) and what the int8 GEMV's
bandwidth is on this machine.

    tandem bench linear-kernels [--threads 1 --rows 1,4,16,32,64,128]
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

from bench.report import results_dir

logger = logging.getLogger(__name__)

KERNELS = ("fp32_gemv", "fp32_onednn", "int8_gemv", "int8_gemm")


def projection_shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """`name -> (out_features, in_features)` of one decoder layer's fused projections."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads") or heads
    inter = config["intermediate_size"]
    return {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }


def _best_us(call: Callable[[int], object], copies: int, repeats: int) -> float:
    """Best over `repeats` of the mean µs per call, cycling through the weight copies."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for i in range(copies):
            call(i)
        best = min(best, (time.perf_counter() - started) / copies)
    return 1e6 * best


def _kernel_calls(extension, x, weights: list, blocked: list, quantized: list) -> dict[str, Callable]:
    """Each kernel as a call on weight copy i."""
    import torch

    def onednn(i: int) -> object:
        return torch.ops.mkldnn._linear_pointwise(x, blocked[i], None, "none", [], "")

    return {
        "fp32_gemv": lambda i: extension.linear_gemv(x, weights[i], None),
        "fp32_onednn": onednn,
        "int8_gemv": lambda i: extension.linear_int8_gemv(x, *quantized[i], None),
        "int8_gemm": lambda i: extension.linear_int8_gemm(x, *quantized[i], None),
    }


def measure(shapes: dict[str, tuple[int, int]], rows: list[int], copies: int, repeats: int) -> list[dict]:
    """One result per row count: µs per layer (all projections) for each kernel, GB/s for the GEMVs."""
    import torch

    from kernels import cpu_extension
    from kernels.int8_linear import quantize_per_channel

    extension = cpu_extension.load()
    if extension is None:
        raise RuntimeError("the C++ CPU kernels are unavailable here; nothing to measure")
    weights = {name: [torch.randn(n, k) * 0.05 for _ in range(copies)] for name, (n, k) in shapes.items()}
    reorder = torch.ops.mkldnn._reorder_linear_weight
    blocked = {name: [reorder(w, None) for w in ws] for name, ws in weights.items()}
    quantized = {name: [quantize_per_channel(w) for w in ws] for name, ws in weights.items()}
    params = sum(n * k for n, k in shapes.values())
    results = []
    for m in rows:
        totals = dict.fromkeys(KERNELS, 0.0)
        for name, (_, k) in shapes.items():
            x = torch.randn(m, k)
            calls = _kernel_calls(extension, x, weights[name], blocked[name], quantized[name])
            for kernel, call in calls.items():
                call(0)
                totals[kernel] += _best_us(call, copies, repeats)
        result = {"rows": m, "us_per_layer": {kernel: round(us, 1) for kernel, us in totals.items()}}
        result["gemv_weight_gbs"] = {
            "fp32_gemv": round(4 * params / totals["fp32_gemv"] / 1e3, 2),
            "int8_gemv": round(params / totals["int8_gemv"] / 1e3, 2),
        }
        results.append(result)
        logger.info("%s", result)
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="model dir whose shapes to use (default: the default model)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--rows", default="1,4,8,16,32,48,64,128", help="row counts, comma-separated")
    parser.add_argument("--layers", type=int, default=30, help="distinct weight copies (default: 30)")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many passes (default: 3)")
    parser.add_argument("--result-file", type=Path, default=results_dir() / "linear_kernels.json")


def run(args: argparse.Namespace) -> int:
    import torch

    from bench.machine import machine_info
    from bench.report import command_line, write_json
    from engine.model_store import resolve_model

    torch.set_num_threads(args.threads)
    shapes = projection_shapes(resolve_model(args.model))
    rows = [int(r) for r in args.rows.split(",") if r]
    results = measure(shapes, rows, args.layers, args.repeats)
    print(
        f"{'rows':>5} " + " ".join(f"{k:>12}" for k in KERNELS) + "   (µs per layer)  GEMV GB/s fp32 / int8"
    )
    for r in results:
        times = " ".join(f"{r['us_per_layer'][k]:>12.1f}" for k in KERNELS)
        gbs = r["gemv_weight_gbs"]
        print(f"{r['rows']:>5} {times}   {gbs['fp32_gemv']:>6.1f} / {gbs['int8_gemv']:.1f}")
    write_json(
        args.result_file,
        {
            "benchmark": "linear_kernels",
            "machine": machine_info(),
            "command": command_line(),
            "threads": args.threads,
            "shapes": shapes,
            "results": results,
        },
    )
    return 0
