"""Q8_0 linear layers on the GPU: `y = x W^T (+ b)` reading W's GGUF blocks as stored (W8A16).

The torch path dequantizes the whole weight to the activations' dtype before every matmul: a
full-precision copy of each weight per step, written and read again, where the blocks themselves are
a bit over a quarter of fp32's bytes. Here the kernels load the 34-byte blocks (`kernels.block_linear`),
turn each into 32 weights `d * q` in registers and accumulate in fp32, so a step streams the blocks
once and allocates nothing the size of a weight.

A block's fp16 scale sits at byte 0 of the block and blocks are 34 bytes apart, so the scale is only
2-byte aligned: it is read as two bytes, joined little-endian and bitcast to fp16, which needs no
alignment at all.

Two kernels, chosen by the rows M of x as `kernels.triton_moe` chooses its M tile:

- up to `GEMV_MAX_ROWS` rows (decode): a GEMV. A program dequantizes a `[GEMV_BLOCK_N, 128]` weight
  tile once and multiplies it with each row of x on the FMA units (no tile of padding rows, which a
  tensor-core tile would need); the reduction over K is split across programs when N alone would leave
  SMs idle, and the fp32 partial sums are added in a fixed order by `_q8_0_reduce_kernel`, so a
  result never depends on the scheduling.
- beyond (prefill): a GEMM over `[BLOCK_M, 64]` tiles with `tl.dot`, the dequantized weight tile
  rounded to the activations' dtype as the torch reference rounds the whole weight. Programs walk M
  fastest, so the programs that share a weight tile run together and read it once from L2.

Outputs are written through a row stride, so the segments of a fused layer (`q8_0_layer`) write their
columns of one output; a segment with an output order (rows that llama.cpp interleaved) is gathered
after its launch, as the torch path does.

Tested against `kernels.block_linear.block_linear_reference` under `TRITON_INTERPRET=1`
(tests/test_triton_q8_0.py) and compiled for sm_80/sm_90 by `kernels.aot`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.gguf_blocks import BLOCK_LAYOUTS, BlockWeight
from kernels.triton_common import KernelLaunch, dot_dtype, dot_precision, launch, num_sms

# Most rows of x the GEMV takes. It multiplies on the FMA units, 2 FLOPs per weight per row against
# ~1.06 bytes per weight read: at 8 rows that is ~15 FLOP/byte, under the ~20 of an H100's fp32 FMA
# rate over its bandwidth. From 9 rows on, the GEMM's 16-row tile (on the tensor cores for half x)
# takes over; it does not split K, so a few N tiles can leave SMs idle there (untuned without a GPU).
GEMV_MAX_ROWS = 8
GEMV_BLOCK_N = 32
GEMV_BLOCK_BLOCKS = 4  # Q8_0 blocks per K step: 128 weights, 4,352 bytes of a 32-row tile in flight
GEMM_BLOCK_N = 64
GEMM_BLOCK_BLOCKS = 2  # a K step of 64 weights
REDUCE_BLOCK_N = 256
# GEMV programs wanted per SM before K is split: several per SM keep enough loads in flight to near
# the bandwidth, where one per SM leaves most of it unused.
PROGRAMS_PER_SM = 4
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# A Q8_0 block: 32 weights in 34 bytes (an fp16 scale, 32 int8 quants).
BLOCK_WEIGHTS = BLOCK_LAYOUTS["Q8_0"].weights
BLOCK_BYTES = BLOCK_LAYOUTS["Q8_0"].nbytes
_WEIGHTS = tl.constexpr(BLOCK_WEIGHTS)
_BYTES = tl.constexpr(BLOCK_BYTES)


@triton.jit
def _dequantize_tile(w_ptr, rows, row_mask, stride_w, first_block, num_blocks, BLOCKS: tl.constexpr):
    """`[len(rows), BLOCKS, 32]` fp32 weights `d * q` of Q8_0 blocks `first_block..` of `rows`; zeros
    for rows outside the weight and blocks past the row's end."""
    blocks = first_block + tl.arange(0, BLOCKS)
    mask = row_mask[:, None] & (blocks < num_blocks)[None, :]
    starts = rows.to(tl.int64)[:, None] * stride_w + blocks[None, :] * _BYTES
    low = tl.load(w_ptr + starts, mask=mask, other=0).to(tl.uint16)
    high = tl.load(w_ptr + starts + 1, mask=mask, other=0).to(tl.uint16)
    scale = (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)
    quants_at = starts[:, :, None] + 2 + tl.arange(0, _WEIGHTS)[None, None, :]
    quants = tl.load(w_ptr + quants_at, mask=mask[:, :, None], other=0)
    return quants.to(tl.int8, bitcast=True).to(tl.float32) * scale[:, :, None]


@triton.jit
def _q8_0_gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    M,
    N,
    num_blocks,
    steps_per_split,
    stride_x,
    stride_w,
    stride_out,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """Output columns `BLOCK_N` of up to `BLOCK_M` rows over one split of K: the finished rows (bias
    added, rounded) when K is not split, else fp32 partial sums at `partial[split]`."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    ms = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCKS)[:, None] * _WEIGHTS + tl.arange(0, _WEIGHTS)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(steps_per_split):
        first = (split * steps_per_split + step) * BLOCKS
        w = _dequantize_tile(w_ptr, rows, row_mask, stride_w, first, num_blocks, BLOCKS)
        k_mask = (first + tl.arange(0, BLOCKS) < num_blocks)[:, None]
        for m in tl.static_range(BLOCK_M):
            x_mask = k_mask & (tl.full((1, 1), m, tl.int32) < M)
            x = tl.load(x_ptr + m * stride_x + first * _WEIGHTS + ks, mask=x_mask, other=0.0)
            dot = tl.sum(tl.sum(w * x.to(tl.float32)[None, :, :], axis=2), axis=1)
            acc = tl.where(ms[:, None] == m, acc + dot[None, :], acc)
    mask = (ms < M)[:, None] & row_mask[None, :]
    if SPLIT:
        partial = partial_ptr + (split * M + ms[:, None]) * N + rows[None, :]
        tl.store(partial, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + ms[:, None] * stride_out + rows[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _q8_0_reduce_kernel(
    partial_ptr, bias_ptr, out_ptr, M, N, splits, stride_out, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Row `m` of the output: the GEMV's partial sums added split by split, then the bias, rounded."""
    m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for split in range(splits):
        acc += tl.load(partial_ptr + (split * M + m) * N + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _q8_0_gemm_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    num_blocks,
    stride_x,
    stride_w,
    stride_out,
    HAS_BIAS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """One `[BLOCK_M, BLOCK_N]` output tile over all of K, `BLOCKS` Q8_0 blocks a step."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % tiles_m
    pid_n = pid // tiles_m
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = ms < M
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    ks = tl.arange(0, BLOCKS * _WEIGHTS)
    x_rows = x_ptr + ms.to(tl.int64)[:, None] * stride_x
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for first in range(0, num_blocks, BLOCKS):
        w = _dequantize_tile(w_ptr, rows, row_mask, stride_w, first, num_blocks, BLOCKS)
        w = tl.trans(tl.reshape(w, (BLOCK_N, BLOCKS * _WEIGHTS)))
        k = first * _WEIGHTS + ks
        x = tl.load(
            x_rows + k[None, :], mask=m_mask[:, None] & (k < num_blocks * _WEIGHTS)[None, :], other=0.0
        )
        acc += tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + ms.to(tl.int64)[:, None] * stride_out + rows[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & row_mask[None, :])


def gemm_block_m(rows: int, dtype: torch.dtype) -> int:
    """The GEMM's M tile for `rows` rows of x: the smallest of 16, 32 and 64 that holds them, at most 32
    for fp32 x, whose 64-row tile spills on sm_80 even over 8 warps (`python -m kernels.aot`)."""
    return min(32 if dtype == torch.float32 else 64, max(16, triton.next_power_of_2(rows)))


def gemv_splits(n: int, num_blocks: int, sm_count: int) -> tuple[int, int]:
    """`(splits, K steps per split)` of a GEMV over `n` output columns and `num_blocks` blocks a row:
    K is split until there are `PROGRAMS_PER_SM` programs per SM, never into empty splits."""
    steps = triton.cdiv(num_blocks, GEMV_BLOCK_BLOCKS)
    wanted = triton.cdiv(PROGRAMS_PER_SM * sm_count, triton.cdiv(n, GEMV_BLOCK_N))
    per_split = triton.cdiv(steps, max(1, min(wanted, steps)))
    return triton.cdiv(steps, per_split), per_split


def _check(x: torch.Tensor, blocks: torch.Tensor, cols: int, out: torch.Tensor) -> None:
    if cols % BLOCK_WEIGHTS:
        raise ValueError(f"Q8_0 rows hold blocks of {BLOCK_WEIGHTS} weights: K={cols} is not a multiple")
    if (
        blocks.dtype != torch.uint8
        or blocks.dim() != 2
        or blocks.shape[1] != cols // BLOCK_WEIGHTS * BLOCK_BYTES
    ):
        raise ValueError(
            f"Q8_0 blocks of K={cols} must be uint8 [rows, {cols // BLOCK_WEIGHTS * BLOCK_BYTES}], "
            f"not {blocks.dtype} {list(blocks.shape)}"
        )
    if x.dim() != 2 or x.shape[1] != cols or x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x must be fp16, bf16 or fp32 [M, {cols}], not {x.dtype} {list(x.shape)}")
    if out.shape != (x.shape[0], blocks.shape[0]) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be {x.dtype} [{x.shape[0]}, {blocks.shape[0]}] with unit column stride")


def q8_0_linear(
    x: torch.Tensor,
    blocks: torch.Tensor,
    cols: int,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x W^T + bias` for x `[M, cols]` and W the Q8_0 `blocks` `[N, cols / 32 * 34]` (stored row
    order), in x's dtype; written into `out` `[M, N]` (any row stride) when given, else a new tensor."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty((x.shape[0], blocks.shape[0]), dtype=x.dtype, device=x.device)
    _check(x, blocks, cols, out)
    if blocks.stride(1) != 1:
        blocks = blocks.contiguous()
    if x.shape[0] == 0 or blocks.shape[0] == 0:
        return out
    if x.shape[0] <= GEMV_MAX_ROWS:
        _gemv(x, blocks, cols // BLOCK_WEIGHTS, bias, out)
    else:
        _gemm(x, blocks, cols // BLOCK_WEIGHTS, bias, out)
    return out


def _gemv(
    x: torch.Tensor, blocks: torch.Tensor, num_blocks: int, bias: torch.Tensor | None, out: torch.Tensor
) -> None:
    m, n = out.shape
    splits, per_split = gemv_splits(n, num_blocks, num_sms(x.device))
    partial = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    bias_arg = bias if bias is not None else out
    args = (
        x,
        blocks,
        bias_arg,
        out,
        partial,
        m,
        n,
        num_blocks,
        per_split,
        x.stride(0),
        blocks.stride(0),
        out.stride(0),
    )
    constexprs = {
        "HAS_BIAS": bias is not None,
        "SPLIT": splits > 1,
        "BLOCK_M": triton.next_power_of_2(m),
        "BLOCK_N": GEMV_BLOCK_N,
        "BLOCKS": GEMV_BLOCK_BLOCKS,
    }
    grid = (triton.cdiv(n, GEMV_BLOCK_N), splits)
    launch(KernelLaunch(_q8_0_gemv_kernel, grid, args, constexprs, num_warps=4))
    if splits > 1:
        args = (partial, bias_arg, out, m, n, splits, out.stride(0))
        constexprs = {"HAS_BIAS": bias is not None, "BLOCK_N": REDUCE_BLOCK_N}
        grid = (m, triton.cdiv(n, REDUCE_BLOCK_N))
        launch(KernelLaunch(_q8_0_reduce_kernel, grid, args, constexprs, num_warps=4))


def _gemm(
    x: torch.Tensor, blocks: torch.Tensor, num_blocks: int, bias: torch.Tensor | None, out: torch.Tensor
) -> None:
    m, n = out.shape
    block_m = gemm_block_m(m, x.dtype)
    dtype = dot_dtype(_q8_0_gemm_kernel, x.dtype)
    args = (
        x,
        blocks,
        bias if bias is not None else out,
        out,
        m,
        n,
        num_blocks,
        x.stride(0),
        blocks.stride(0),
        out.stride(0),
    )
    constexprs = {
        "HAS_BIAS": bias is not None,
        "DOT_DTYPE": dtype,
        "PRECISION": dot_precision(dtype),
        "BLOCK_M": block_m,
        "BLOCK_N": GEMM_BLOCK_N,
        "BLOCKS": GEMM_BLOCK_BLOCKS,
    }
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, GEMM_BLOCK_N),)
    num_warps = 8 if block_m > 16 and x.dtype == torch.float32 else 4
    launch(KernelLaunch(_q8_0_gemm_kernel, grid, args, constexprs, num_warps=num_warps))


def q8_0_layer(
    x: torch.Tensor, segments: Sequence[tuple[int, BlockWeight]], out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """`BlockLinear.forward` on the GPU over Q8_0 segments: one launch per segment (`(first output row,
    weight)`, covering every output row), each writing its columns of one output in Hugging Face order."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.empty((flat.shape[0], out_features), dtype=x.dtype, device=x.device)
    for offset, weight in segments:
        rows = weight.shape[0]
        columns = out[:, offset : offset + rows]
        segment_bias = None if bias is None else bias[offset : offset + rows]
        if weight.out_order is None:
            q8_0_linear(flat, weight.blocks, weight.cols, segment_bias, columns)
            continue
        columns.copy_(q8_0_linear(flat, weight.blocks, weight.cols)[:, weight.out_order])
        if segment_bias is not None:
            columns += segment_bias.to(out.dtype)
    return out.view(*x.shape[:-1], out_features)
