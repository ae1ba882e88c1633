"""The mixture-of-experts layer on the GPU: a grouped GEMM over the step's rows sorted by expert.

A step routes each of its T tokens to `top_k` experts. Running the experts one after the other would be
E small launches, most of them over a handful of rows; one launch that tiles every expert's rows does
the same work at once. So the (token, expert) pairs are sorted by expert and each expert's run is padded
to a multiple of BLOCK_M (`align_by_expert`): every M tile then belongs to one expert, whose id the
tile looks up, and reads only that expert's weight tiles. Padding slots carry an out-of-range pair id
and are masked off. The plan is built with device-side torch ops over an upper bound of the padded
length, so no host sync is needed.

`fused_moe` is two launches of `_fused_moe_kernel` with the SiLU-and-mul kernel between: gate/up for
each pair (A rows are the pair's token), then down for each pair with the routing weight applied to its
fp32 accumulator; the `top_k` rows of each token are summed last. Weights may be int8 with one fp32
scale per output row of each expert (`--quantization int8`): the tile is widened in registers and the
accumulator scaled, so int8 experts stream a quarter of fp32's bytes.

This follows the scheme of vLLM's `fused_moe` (block-aligned expert runs); the code is our own. It is
tested against `kernels.moe.moe_reference` under `TRITON_INTERPRET=1` and compiled by `kernels.aot`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import triton_fused
from kernels.triton_common import KernelLaunch, dot_dtype, dot_precision, launch

BLOCK_N = 64
BLOCK_K = 32
# Routed pairs up to which the M tile is small: decode steps have few rows per expert, and a 64-row
# tile would be mostly padding.
SMALL_M_PAIRS = 256


def block_m_for(num_pairs: int) -> int:
    """The M tile for a step of `num_pairs` (token, expert) pairs."""
    return 16 if num_pairs <= SMALL_M_PAIRS else 64


def capacity(pairs: int, num_experts: int, block_m: int) -> int:
    """The length of `align_by_expert`'s pair list: every pair, plus a partly filled tile per expert."""
    return triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m) * block_m


def align_by_expert(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(pair_ids, block_experts, num_padded)` for the `[T, top_k]` expert `ids` of a step.

    `pair_ids [capacity]` (int32): pair indices `t * top_k + k` grouped by expert, in pair order within
    an expert, each expert's run padded to a multiple of `block_m` with `T * top_k` (no pair);
    `block_experts [capacity // block_m]` (int32): the expert of each M tile; `num_padded [1]` (int32):
    where the padded runs end (tiles from there on have nothing to do). The capacity is the largest
    padded length the step can need, so nothing is read back to the host.
    """
    flat = ids.reshape(-1)
    pairs = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    first_pair = torch.cumsum(counts, 0) - counts
    rank = torch.arange(pairs, device=flat.device) - first_pair[sorted_experts]
    slots = (ends - padded)[sorted_experts] + rank
    length = capacity(pairs, num_experts, block_m)
    pair_ids = torch.full((length,), pairs, dtype=torch.int32, device=flat.device)
    pair_ids[slots] = order.to(torch.int32)
    tile_starts = torch.arange(0, length, block_m, device=flat.device)
    block_experts = torch.searchsorted(ends, tile_starts, right=True).clamp_(max=num_experts - 1)
    return pair_ids, block_experts.to(torch.int32), ends[-1:].to(torch.int32)


@triton.jit
def _fused_moe_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    scale_ptr,
    pair_weights_ptr,
    pair_ids_ptr,
    block_experts_ptr,
    num_padded_ptr,
    N,
    K,
    num_pairs,
    pairs_per_a_row,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    stride_se,
    INT8_WEIGHTS: tl.constexpr,
    MUL_ROUTING_WEIGHT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One `[BLOCK_M, BLOCK_N]` tile of `C[pair] = A[pair // pairs_per_a_row] @ B[expert]^T` (scaled)."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair = tl.load(pair_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pair < num_pairs
    a_rows = (pair // pairs_per_a_row).to(tl.int64)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    b_base = b_ptr + expert * stride_be + cols.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + ks) < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + (k0 + ks)[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        b = tl.load(b_base + (k0 + ks)[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0)
        acc += tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), input_precision=PRECISION)
    if INT8_WEIGHTS:
        scale = tl.load(scale_ptr + expert * stride_se + cols, mask=col_mask, other=0.0)
        acc = acc * scale[None, :]
    if MUL_ROUTING_WEIGHT:
        routing = tl.load(pair_weights_ptr + pair, mask=row_mask, other=0.0)
        acc = acc * routing[:, None]
    c = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor | None,
    out: torch.Tensor,
    plan: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    block_m: int,
    pairs_per_a_row: int,
    pair_weights: torch.Tensor | None,
) -> None:
    """`out[pair] = a[pair // pairs_per_a_row] @ b[expert(pair)]^T`, scaled per row of `b` when int8 and
    by `pair_weights` when given."""
    pair_ids, block_experts, num_padded = plan
    n, k = b.shape[1], b.shape[2]
    grid = (pair_ids.shape[0] // block_m * triton.cdiv(n, BLOCK_N),)
    dtype = dot_dtype(_fused_moe_kernel, a.dtype)
    args = (
        a,
        b,
        out,
        scale if scale is not None else out,
        pair_weights if pair_weights is not None else out,
        pair_ids,
        block_experts,
        num_padded,
        n,
        k,
        out.shape[0],
        pairs_per_a_row,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        scale.stride(0) if scale is not None else 0,
    )
    constexprs = {
        "INT8_WEIGHTS": scale is not None,
        "MUL_ROUTING_WEIGHT": pair_weights is not None,
        "DOT_DTYPE": dtype,
        "PRECISION": dot_precision(dtype),
        "BLOCK_M": block_m,
        "BLOCK_N": BLOCK_N,
        "BLOCK_K": BLOCK_K,
    }
    # fp32 activations in a 64-row tile (with fp32 or widened int8 weight tiles) spill over 4 warps; half
    # ones fit in 4 and spill over 8 on sm_80 (`python -m kernels.aot --model mixtral-8x7b`).
    num_warps = 8 if block_m > 16 and a.dtype == torch.float32 else 4
    launch(KernelLaunch(_fused_moe_kernel, grid, args, constexprs, num_warps=num_warps))


def fused_moe(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts' weighted sum for `hidden [T, H]` (module doc) with `w_gate_up [E, 2I, H]`,
    `w_down [E, H, I]` in `hidden`'s dtype, or int8 with `gate_up_scale [E, 2I]`, `down_scale [E, H]`;
    `weights`/`ids` `[T, top_k]` as `kernels.moe.route` gives them."""
    tokens, top_k = ids.shape
    if tokens * top_k == 0:
        return torch.zeros_like(hidden)
    block_m = block_m_for(tokens * top_k)
    plan = align_by_expert(ids, w_gate_up.shape[0], block_m)
    return fused_moe_planned(hidden, w_gate_up, w_down, weights, plan, block_m, gate_up_scale, down_scale)


def fused_moe_planned(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    weights: torch.Tensor,
    plan: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    block_m: int,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`fused_moe` over a plan `align_by_expert` made with `block_m` (`kernels.aot` hands one of `meta`
    tensors, whose contents the launches never need)."""
    if (gate_up_scale is None) != (down_scale is None):
        raise ValueError("int8 experts need the scales of both their matrices")
    tokens, top_k = weights.shape
    pairs = tokens * top_k
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    gate_up = torch.empty((pairs, w_gate_up.shape[1]), dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(hidden, w_gate_up, gate_up_scale, gate_up, plan, block_m, top_k, None)
    act = triton_fused.silu_and_mul(gate_up)
    pair_weights = weights.reshape(-1).float().contiguous()
    out = torch.empty((pairs, w_down.shape[1]), dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(act, w_down, down_scale, out, plan, block_m, 1, pair_weights)
    return out.view(tokens, top_k, -1).sum(dim=1)
