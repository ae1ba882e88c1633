"""GPU benchmark of tandem's Triton kernels: attention decode bandwidth and prefill TFLOP/s, Q8_0 linears.

Decode is memory-bound, so its figure of merit is achieved bandwidth — the bytes the step must
move (K/V, block tables, queries, outputs; `bench.roofline.decode_kernel_roofline`) divided by
kernel time — as a fraction of the device's peak (H200 ≈ 4.8 TB/s). It is measured over
batch {1, 8, 64, 256} × context {1k, 4k, 16k, 32k} × GQA group {1, 4, 8} (8 KV heads,
head_dim 128, bf16, block size 16, randomly placed blocks) against gather + SDPA in torch and,
when importable, `flash_attn` and `flashinfer`. Prefill is compute-bound: causal TFLOP/s of the
paged chunked-prefill kernel against `scaled_dot_product_attention` on contiguous tensors.

The Q8_0 linears (`kernels.triton_q8_0`, a GGUF's weights read as stored) stream their weight blocks
once, so their figure is achieved bandwidth too: block, activation and output bytes over kernel time,
for Llama 3.1 8B's projections (one checkpoint tensor each) at decode rows (1, 8: the GEMV) and
prefill rows (64, 512: the GEMM; TFLOP/s as well), against the torch path that dequantizes the whole
weight first (`block_linear_reference`). The error is against that reference in fp32.

Every launch is timed alone with CUDA events after a 512 MiB memset that flushes L2 (and keeps
the GPU busy while the host enqueues the launch, so host overhead is not counted); the median
over the iterations is reported. Each output is checked against the torch reference.

    python -m bench.kernels_gpu [--out FILE]     # one H200: < 5 minutes
    python -m bench.kernels_gpu --dry-run        # CPU, Triton interpreter

`--dry-run` runs the same code path on the CPU under `TRITON_INTERPRET=1` with tiny shapes and
fp32, to validate shapes, correctness checks and the JSON format without a GPU; its timings mean
nothing. Both modes first print the static roofline of the GPU sweep: per configuration, the bytes
and FLOPs of the launch plan and the time the peak bandwidth allows, so that a GPU run can be
judged at once against what it should reach.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from bench.roofline import DecodeAttentionStep, decode_kernel_roofline

# Peak HBM bandwidth by device name fragment, bytes/s (vendor figures).
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}
DEFAULT_PEAK = 4.8e12
FLUSH_BYTES = 512 << 20
# Above this many KV bytes the torch reference's gathered copy (plus SDPA's) would crowd the GPU.
TORCH_REFERENCE_MAX_KV_BYTES = 20 << 30
CHECK_ROWS = 4


@dataclass(frozen=True)
class Shapes:
    """One benchmark configuration: the sweep, the model shapes and how many timed launches."""

    device: str
    dtype_name: str
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    gqa_groups: tuple[int, ...]
    prefill_cases: tuple[tuple[int, int], ...]  # (batch, seq_len)
    q8_0_rows: tuple[int, ...]  # rows of x for each Q8_0 linear
    q8_0_layers: tuple[tuple[int, int], ...]  # (out features, in features) of a checkpoint tensor
    num_kv_heads: int
    head_dim: int
    block_size: int
    iterations: int


GPU_SHAPES = Shapes(
    device="cuda",
    dtype_name="bfloat16",
    batches=(1, 8, 64, 256),
    contexts=(1024, 4096, 16384, 32768),
    gqa_groups=(1, 4, 8),
    prefill_cases=((16, 1024), (4, 4096), (1, 16384)),
    q8_0_rows=(1, 8, 64, 512),
    q8_0_layers=((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)),  # q/o, k/v, gate/up, down
    num_kv_heads=8,
    head_dim=128,
    block_size=16,
    iterations=20,
)
DRY_RUN_SHAPES = Shapes(
    device="cpu",
    dtype_name="float32",
    batches=(1, 3),
    contexts=(40, 600),  # 600: long enough for the split-KV path
    gqa_groups=(1, 4),
    prefill_cases=((2, 40), (1, 70)),
    q8_0_rows=(1, 3, 17),  # the GEMV's, then the GEMM's
    q8_0_layers=((72, 416), (200, 96)),  # the GEMV splits K four ways, then not at all
    num_kv_heads=2,
    head_dim=64,
    block_size=16,
    iterations=2,
)


class Timer:
    """Median seconds per launch: CUDA events with an L2 flush before each, or wall time on a CPU."""

    def __init__(self, torch, device, iterations: int) -> None:
        self.torch = torch
        self.device = device
        self.iterations = iterations
        self.flush_buffer = None
        if device.type == "cuda":
            self.flush_buffer = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=device)

    def __call__(self, launch: Callable[[], object]) -> float:
        launch()  # compile / warm up
        if self.flush_buffer is None:
            times = []
            for _ in range(self.iterations):
                start = time.perf_counter()
                launch()
                times.append(time.perf_counter() - start)
            return statistics.median(times)
        cuda = self.torch.cuda
        events = [
            (cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)) for _ in range(self.iterations)
        ]
        cuda.synchronize()
        for start, end in events:
            self.flush_buffer.zero_()
            start.record()
            launch()
            end.record()
        cuda.synchronize()
        return statistics.median(start.elapsed_time(end) / 1e3 for start, end in events)


def paged_cache(torch, batch: int, context: int, shapes: Shapes, dtype, device, page_size: int | None = None):
    """K/V caches holding `batch` contexts of `context` tokens in randomly placed blocks, and the table."""
    page = page_size or shapes.block_size
    blocks_per_seq = math.ceil(context / page)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, page, shapes.num_kv_heads, shapes.head_dim)
    k_cache = torch.empty(shape, dtype=dtype, device=device).normal_()
    v_cache = torch.empty(shape, dtype=dtype, device=device).normal_()
    order = torch.randperm(num_blocks, device=device).to(torch.int32)
    return k_cache, v_cache, order.view(batch, blocks_per_seq)


def gather_sdpa_decode(torch, query, k_cache, v_cache, table, context: int, scale: float, dtype=None):
    """The torch reference: gather each sequence's blocks into a contiguous context, then SDPA.

    The GQA group rides in SDPA's query-length dimension (a decode token sees its whole context,
    so no mask is needed), which keeps SDPA from expanding K/V to every query head.
    """
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    dtype = dtype or query.dtype

    def gather(cache):
        rows = cache[table].view(batch, -1, num_kv_heads, head_dim)[:, :context]
        return rows.transpose(1, 2).to(dtype)

    q = query.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim).to(dtype)
    out = torch.nn.functional.scaled_dot_product_attention(q, gather(k_cache), gather(v_cache), scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def result(seconds: float, **extra) -> dict:
    return {"seconds": seconds, **extra}


def max_error(torch, out, expected) -> float:
    return float((out.float() - expected.float()).abs().max())


def bench_decode_case(
    env, shapes: Shapes, timer: Timer, batch: int, context: int, gqa: int, peak: float
) -> dict:
    torch, triton_decode = env["torch"], env["triton_decode"]
    device, dtype = torch.device(shapes.device), getattr(torch, shapes.dtype_name)
    num_heads = shapes.num_kv_heads * gqa
    scale = shapes.head_dim**-0.5
    k_cache, v_cache, table = paged_cache(torch, batch, context, shapes, dtype, device)
    query = torch.randn(batch, num_heads, shapes.head_dim, dtype=dtype, device=device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    plan = decode_plan(env, shapes, batch, context, device)
    roofline = decode_kernel_roofline(decode_step(env, shapes, batch, context, gqa, plan), peak)
    rows = slice(0, min(batch, CHECK_ROWS))
    expected = gather_sdpa_decode(
        torch, query[rows], k_cache, v_cache, table[rows], context, scale, torch.float32
    )

    def bandwidth(seconds: float, out, reference=expected) -> dict:
        """Achieved bandwidth of a launch (compulsory bytes / time), and its first rows' error."""
        achieved = roofline["compulsory_bytes"] / seconds
        return result(
            seconds,
            bandwidth_bytes_per_s=achieved,
            fraction_of_peak=achieved / peak,
            max_abs_error=max_error(torch, out[rows], reference),
        )

    def run_triton():
        return triton_decode.paged_decode_attention(query, k_cache, v_cache, table, seq_lens, scale)

    results = {"triton": bandwidth(timer(run_triton), run_triton())}

    if roofline["kv_bytes"] > TORCH_REFERENCE_MAX_KV_BYTES:
        results["torch_gather_sdpa"] = {
            "skipped": "its gathered copy of the KV would not fit beside the cache"
        }
    else:

        def run_torch():
            return gather_sdpa_decode(torch, query, k_cache, v_cache, table, context, scale)

        results["torch_gather_sdpa"] = bandwidth(timer(run_torch), run_torch())
    results["flash_attn"] = guarded(
        lambda: bench_flash_attn(env, shapes, timer, query, batch, context, bandwidth)
    )
    results["flashinfer"] = guarded(
        lambda: bench_flashinfer(env, shapes, timer, query, k_cache, v_cache, table, context, bandwidth)
    )
    return {
        "batch": batch,
        "context": context,
        "gqa": gqa,
        "num_heads": num_heads,
        "num_kv_heads": shapes.num_kv_heads,
        "kv_bytes": roofline["kv_bytes"],
        "split_plan": asdict(plan),
        "roofline": roofline,
        "results": results,
    }


def decode_plan(env, shapes: Shapes, batch: int, context: int, device):
    """The split plan the decode wrapper picks for this case (its block table holds exactly `context`)."""
    triton_decode, triton_common = env["triton_decode"], env["triton_common"]
    capacity = math.ceil(context / shapes.block_size) * shapes.block_size
    tile = triton_decode.kv_tile_size(shapes.head_dim, getattr(env["torch"], shapes.dtype_name))
    return triton_decode.plan_splits(
        batch, shapes.num_kv_heads, capacity, triton_common.num_sms(device), tile
    )


def decode_step(env, shapes: Shapes, batch: int, context: int, gqa: int, plan) -> DecodeAttentionStep:
    torch, triton_decode = env["torch"], env["triton_decode"]
    return DecodeAttentionStep(
        batch=batch,
        context=context,
        num_heads=shapes.num_kv_heads * gqa,
        num_kv_heads=shapes.num_kv_heads,
        head_dim=shapes.head_dim,
        block_size=shapes.block_size,
        dtype_bytes=getattr(torch, shapes.dtype_name).itemsize,
        num_splits=plan.num_splits,
        kv_tile=triton_decode.kv_tile_size(shapes.head_dim, getattr(torch, shapes.dtype_name)),
        dot_rows=triton_decode.dot_rows(gqa),
    )


def static_roofline(env, shapes: Shapes, peak: float, device) -> list[dict]:
    """The GPU sweep's bytes, FLOPs and bandwidth-bound time per configuration, from the launch plan."""
    rows = []
    for batch in shapes.batches:
        for context in shapes.contexts:
            plan = decode_plan(env, shapes, batch, context, device)
            for gqa in shapes.gqa_groups:
                step = decode_step(env, shapes, batch, context, gqa, plan)
                rows.append({**asdict(step), **decode_kernel_roofline(step, peak)})
    return rows


def print_static_roofline(rows: list[dict], peak: float, shapes: Shapes) -> None:
    print(
        f"static roofline of decode attention ({shapes.dtype_name}, {shapes.num_kv_heads} KV heads, "
        f"head_dim {shapes.head_dim}, block {shapes.block_size}) at {peak / 1e12:.2f} TB/s"
    )
    print(
        f"{'batch':>6} {'context':>8} {'gqa':>4} {'splits':>6} {'MB must move':>13} {'+split MB':>10} "
        f"{'GFLOP':>9} {'FLOP/B':>7} {'min us':>9}"
    )
    for row in rows:
        print(
            f"{row['batch']:>6} {row['context']:>8} {row['num_heads'] // row['num_kv_heads']:>4} "
            f"{row['num_splits']:>6} {row['compulsory_bytes'] / 1e6:>13.2f} "
            f"{row['split_bytes'] / 1e6:>10.2f} "
            f"{row['flops'] / 1e9:>9.3f} {row['flops_per_byte']:>7.2f} {row['min_seconds'] * 1e6:>9.1f}"
        )


def guarded(run: Callable[[], dict]) -> dict:
    """A peer library's result, or why there is none; a peer's failure must not sink the run."""
    try:
        return run()
    except ImportError as exc:
        return {"skipped": f"not importable: {exc}"}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def bench_flash_attn(env, shapes, timer, query, batch, context, bandwidth) -> dict:
    """flash-attn's paged decode; its paged path wants pages of 256 tokens, so it gets its own cache."""
    if shapes.device != "cuda":
        return {"skipped": "needs CUDA"}
    from flash_attn import flash_attn_with_kvcache

    torch = env["torch"]
    k_cache, v_cache, table = paged_cache(
        torch, batch, context, shapes, query.dtype, query.device, page_size=256
    )
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=query.device)
    q = query.unsqueeze(1)

    def run():
        return flash_attn_with_kvcache(
            q,
            k_cache,
            v_cache,
            cache_seqlens=seq_lens,
            block_table=table,
            softmax_scale=shapes.head_dim**-0.5,
            causal=True,
        ).squeeze(1)

    rows = slice(0, CHECK_ROWS)
    scale = shapes.head_dim**-0.5
    reference = gather_sdpa_decode(
        torch, query[rows], k_cache, v_cache, table[rows], context, scale, torch.float32
    )
    return {**bandwidth(timer(run), run(), reference), "page_size": 256}


def bench_flashinfer(env, shapes, timer, query, k_cache, v_cache, table, context, bandwidth) -> dict:
    """flashinfer's batch paged decode on the very same cache (NHD layout) and block table."""
    if shapes.device != "cuda":
        return {"skipped": "needs CUDA"}
    import flashinfer

    torch = env["torch"]
    device, batch = query.device, query.shape[0]
    blocks_per_seq = table.shape[1]
    indptr = torch.arange(0, batch + 1, dtype=torch.int32, device=device) * blocks_per_seq
    last_page_len = torch.full(
        (batch,), context - (blocks_per_seq - 1) * shapes.block_size, dtype=torch.int32, device=device
    )
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
    plan_args = (
        indptr,
        table.flatten(),
        last_page_len,
        query.shape[1],
        shapes.num_kv_heads,
        shapes.head_dim,
        shapes.block_size,
    )
    try:
        wrapper.plan(*plan_args, q_data_type=query.dtype, kv_data_type=k_cache.dtype)
    except TypeError:
        wrapper.plan(*plan_args, data_type=query.dtype)

    def run():
        return wrapper.run(query, (k_cache, v_cache))

    return bandwidth(timer(run), run())


def bench_prefill_case(env, shapes: Shapes, timer: Timer, batch: int, seq_len: int) -> dict:
    torch, triton_prefill, metadata_cls = env["torch"], env["triton_prefill"], env["AttentionMetadata"]
    device, dtype = torch.device(shapes.device), getattr(torch, shapes.dtype_name)
    num_heads = shapes.num_kv_heads * 4
    scale = shapes.head_dim**-0.5
    k_cache, v_cache, table = paged_cache(torch, batch, seq_len, shapes, dtype, device)
    query = torch.randn(batch * seq_len, num_heads, shapes.head_dim, dtype=dtype, device=device)
    meta = metadata_cls(
        query_start_loc=torch.arange(0, batch + 1, dtype=torch.int32, device=device) * seq_len,
        seq_lens=torch.full((batch,), seq_len, dtype=torch.int32, device=device),
        block_tables=table,
        slot_mapping=torch.full((batch * seq_len,), -1, dtype=torch.int64, device=device),
        query_lens_host=[seq_len] * batch,
        seq_lens_host=[seq_len] * batch,
    )

    # Contiguous [B, heads, L, d] inputs for SDPA: the same K/V, gathered and with heads expanded.
    def contiguous(cache):
        rows = cache[table].view(batch, -1, shapes.num_kv_heads, shapes.head_dim)[:, :seq_len]
        return rows.repeat_interleave(num_heads // shapes.num_kv_heads, dim=2).transpose(1, 2).contiguous()

    k, v = contiguous(k_cache), contiguous(v_cache)
    q = query.view(batch, seq_len, num_heads, shapes.head_dim).transpose(1, 2).contiguous()
    flops = 4 * batch * num_heads * shapes.head_dim * seq_len * (seq_len + 1) // 2

    def run_sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    def run_triton():
        return triton_prefill.paged_prefill_attention(query, k_cache, v_cache, meta, scale)

    expected = run_sdpa()
    triton_out = run_triton().view(batch, seq_len, num_heads, shapes.head_dim).transpose(1, 2)
    results = {}
    for name, launch, out in (("triton", run_triton, triton_out), ("torch_sdpa", run_sdpa, expected)):
        seconds = timer(launch)
        results[name] = result(
            seconds, tflops=flops / seconds / 1e12, max_abs_error=max_error(torch, out, expected)
        )
    return {
        "batch": batch,
        "seq_len": seq_len,
        "num_heads": num_heads,
        "num_kv_heads": shapes.num_kv_heads,
        "flops": flops,
        "results": results,
    }


def q8_0_blocks(torch, rows: int, cols: int, device):
    """Random Q8_0 blocks `[rows, cols / 32 * 34]`: fp16 scales of ~1/(127 sqrt(cols)), so that outputs of
    unit-variance rows are of order one, then 32 int8 quants per block."""
    count = cols // 32
    scales = (torch.randn(rows, count, device=device) / (127 * cols**0.5)).half()
    quants = torch.randint(-127, 128, (rows, count, 32), dtype=torch.int8, device=device)
    blocks = torch.cat([scales.view(torch.uint8).view(rows, count, 2), quants.view(torch.uint8)], dim=-1)
    return blocks.view(rows, count * 34)


def bench_q8_0_case(env, shapes: Shapes, timer: Timer, rows: int, n: int, k: int, peak: float) -> dict:
    torch, triton_q8_0, block_linear = env["torch"], env["triton_q8_0"], env["block_linear"]
    device, dtype = torch.device(shapes.device), getattr(torch, shapes.dtype_name)
    blocks = q8_0_blocks(torch, n, k, device)
    x = torch.randn(rows, k, dtype=dtype, device=device)
    weight = env["gguf_blocks"].BlockWeight(blocks, k, "Q8_0")
    expected = block_linear.block_linear_reference(x.float(), weight)
    moved = blocks.nbytes + x.nbytes + rows * n * x.itemsize
    flops = 2 * rows * n * k

    def run_triton():
        return triton_q8_0.q8_0_linear(x, blocks, k)

    def run_torch():
        return block_linear.block_linear_reference(x, weight)

    results = {}
    for name, launch in (("triton", run_triton), ("torch_dequantize", run_torch)):
        seconds = timer(launch)
        results[name] = result(
            seconds,
            bandwidth_bytes_per_s=moved / seconds,
            fraction_of_peak=moved / seconds / peak,
            tflops=flops / seconds / 1e12,
            max_abs_error=max_error(torch, launch(), expected),
        )
    return {
        "rows": rows,
        "out_features": n,
        "in_features": k,
        "kernel": "gemv" if rows <= triton_q8_0.GEMV_MAX_ROWS else "gemm",
        "bytes": moved,
        "flops": flops,
        "max_abs_reference": float(expected.abs().max()),
        "results": results,
    }


def load_env(dry_run: bool) -> dict:
    """Import torch and the kernels only now: under --dry-run the interpreter must be on before triton is."""
    if dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import triton

    from kernels import block_linear, gguf_blocks, triton_common, triton_decode, triton_prefill, triton_q8_0
    from kernels.metadata import AttentionMetadata

    return {
        "torch": torch,
        "triton": triton,
        "triton_common": triton_common,
        "triton_decode": triton_decode,
        "triton_prefill": triton_prefill,
        "AttentionMetadata": AttentionMetadata,
        "block_linear": block_linear,
        "gguf_blocks": gguf_blocks,
        "triton_q8_0": triton_q8_0,
    }


def peak_bandwidth(device_name: str, override: float | None) -> float:
    if override:
        return override
    for fragment, peak in PEAK_BANDWIDTH.items():
        if fragment in device_name:
            return peak
    return DEFAULT_PEAK


DECODE_PEERS = ("triton", "torch_gather_sdpa", "flash_attn", "flashinfer")
PREFILL_PEERS = ("triton", "torch_sdpa")
Q8_0_PEERS = ("triton", "torch_dequantize")
CELL = 18


def format_cell(entry: dict, key: str) -> str:
    """A table cell: the figure of merit, or the first words of why there is none."""
    if "seconds" not in entry:
        return next(iter(entry.values()))[: CELL - 1].ljust(CELL)
    text = f"{entry[key]:.3g}" if key == "tflops" else f"{entry[key]:.1%}"
    return text.ljust(CELL)


def run(shapes: Shapes, env: dict, peak_override: float | None) -> dict:
    torch = env["torch"]
    device = torch.device(shapes.device)
    torch.manual_seed(0)
    device_name = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    )
    peak = peak_bandwidth(device_name, peak_override)
    # The static roofline is always of the GPU sweep; without a GPU, of an H200 (and its SM count).
    gpu_peak = peak if device.type == "cuda" else peak_bandwidth("H200", peak_override)
    timer = Timer(torch, device, shapes.iterations)
    report = {
        "mode": "gpu" if device.type == "cuda" else "dry-run",
        "created": datetime.now(timezone.utc).isoformat(),
        "device": device_name,
        "peak_bandwidth_bytes_per_s": peak,
        "torch": torch.__version__,
        "triton": env["triton"].__version__,
        "dtype": shapes.dtype_name,
        "head_dim": shapes.head_dim,
        "block_size": shapes.block_size,
        "timing": "median over launches; CUDA events, L2 flushed by a memset before each launch"
        if device.type == "cuda"
        else "median wall time (interpreter; not a performance figure)",
        "static_roofline": static_roofline(env, GPU_SHAPES, gpu_peak, device),
        "decode": [],
        "prefill": [],
        "q8_0": [],
    }
    print_static_roofline(report["static_roofline"], gpu_peak, GPU_SHAPES)
    print(f"decode on {device_name}: achieved KV bandwidth / peak {peak / 1e12:.2f} TB/s")
    header = "".join(peer.ljust(CELL) for peer in DECODE_PEERS)
    print(f"{'batch':>6} {'context':>8} {'gqa':>4} {'splits':>6}  {header}")
    for batch in shapes.batches:
        for context in shapes.contexts:
            for gqa in shapes.gqa_groups:
                row = bench_decode_case(env, shapes, timer, batch, context, gqa, peak)
                report["decode"].append(row)
                cells = "".join(format_cell(row["results"][k], "fraction_of_peak") for k in DECODE_PEERS)
                print(f"{batch:>6} {context:>8} {gqa:>4} {row['split_plan']['num_splits']:>6}  {cells}")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    print("prefill (causal, whole prompts): TFLOP/s")
    header = "".join(peer.ljust(CELL) for peer in PREFILL_PEERS)
    print(f"{'batch':>6} {'seq_len':>8}  {header}")
    for batch, seq_len in shapes.prefill_cases:
        row = bench_prefill_case(env, shapes, timer, batch, seq_len)
        report["prefill"].append(row)
        cells = "".join(format_cell(row["results"][k], "tflops") for k in PREFILL_PEERS)
        print(f"{batch:>6} {seq_len:>8}  {cells}")
    print(f"Q8_0 linears ({shapes.dtype_name} x): achieved bandwidth / peak {peak / 1e12:.2f} TB/s")
    header = "".join(peer.ljust(CELL) for peer in Q8_0_PEERS)
    print(f"{'rows':>6} {'out':>6} {'in':>6}  {header}")
    for n, k in shapes.q8_0_layers:
        for rows in shapes.q8_0_rows:
            row = bench_q8_0_case(env, shapes, timer, rows, n, k, peak)
            report["q8_0"].append(row)
            cells = "".join(format_cell(row["results"][p], "fraction_of_peak") for p in Q8_0_PEERS)
            print(f"{rows:>6} {n:>6} {k:>6}  {cells}")
    return report


def main(argv: list[str] | None = None) -> None:
    from bench.report import results_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    parser.add_argument(
        "--out",
        default=None,
        help="JSON path (default: kernels_gpu[_dry_run].json in bench.report.results_dir())",
    )
    parser.add_argument("--peak-bandwidth", type=float, default=None, help="bytes/s; default by device name")
    args = parser.parse_args(argv)
    env = load_env(args.dry_run)
    if not args.dry_run and not env["torch"].cuda.is_available():
        parser.error("no CUDA device; use --dry-run on a CPU")
    shapes = DRY_RUN_SHAPES if args.dry_run else GPU_SHAPES
    report = run(shapes, env, args.peak_bandwidth)
    out = Path(args.out or results_dir() / f"kernels_gpu{'_dry_run' if args.dry_run else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
