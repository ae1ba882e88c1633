"""Paged decode attention (one query token per sequence) with split-KV and a log-sum-exp merge.

Decode is memory-bound: every step reads each sequence's whole KV context to produce one token.
So the kernel is built around reading each KV byte once:

- one program handles one (sequence, KV head, split) and puts the *whole GQA group* of query
  heads in the M dimension of one `tl.dot` (padded to 16 rows, the smallest dot), so the group
  shares every K/V tile it loads instead of re-reading it per query head;
- K/V tiles are `BLOCK_N` context positions gathered through the block table position by
  position, so the tile size is free of the cache's block size (12, 16, 32... all work);
- when `num_seqs × num_kv_heads` programs cannot fill the GPU, the context is cut into splits
  (flash-decoding) that run in parallel and a second kernel merges their partial outputs by
  their log-sum-exp;
- the grid is a static upper bound (splits of the longest context the block table can hold)
  and programs past a sequence's end exit at once, so the launch depends only on shapes — the
  property a CUDA graph replay needs — never on this step's sequence lengths;
- a quantized cache (int8, fp8 e4m3) is read as stored, 1 byte an element, and converted to the
  dot dtype in registers (exactly: both fit in bf16/fp16); its per-token scales multiply the score
  columns (K) and the probabilities (V), a tile of `[group, BLOCK_N]` instead of `[BLOCK_N, head_dim]`;
- a sliding window (`kernels.window`) is a runtime scalar (0: none), so windowed and global layers
  share one compiled kernel: a sequence's splits start at its first visible key, so the blocks below
  the window (freed, their table entries garbage) are never read, and the plan splits at most
  `window` tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton_common import (
    KernelLaunch,
    block_offsets,
    dot_dtype,
    dot_precision,
    kv_block_ids,
    launch,
    num_sms,
    quantized_launch_args,
)
from kernels.window import kernel_window

# A split shorter than this spends more on its partial write and merge than it saves.
MIN_SPLIT_TOKENS = 256
# Enough splits to fill an H200 from a single (sequence, KV head); more only adds merge work.
MAX_SPLITS = 64
# Programs per SM wanted in flight before splitting stops paying.
WAVES_PER_SM = 2
# The smallest M of a tensor-core dot; the GQA group is padded up to it.
MIN_DOT_ROWS = 16


@triton.jit
def _first_visible(seq_len, window):
    """The first key a decode query (at position seq_len - 1) sees: 0, or under a window of `window`
    (> 0) tokens the first one inside it."""
    return tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)


@dataclass(frozen=True)
class SplitPlan:
    """How the context of every sequence in a decode batch is cut: `num_splits` × `split_size` tokens."""

    num_splits: int
    split_size: int


def kv_tile_size(head_dim: int, dtype: torch.dtype) -> int:
    """Context positions per K/V tile: 64 keeps a K and a V tile of head_dim ≤ 128 in registers.

    fp32 dots run on the FMA units (IEEE, for parity with the reference), which hold operands and
    products in registers: at head_dim 128 a tile of 32 already spills on sm_90 (`kernels.aot`),
    16 compiles in under 80 registers on sm_80 and sm_90.
    """
    if dtype == torch.float32 and head_dim > 64:
        return 16
    return 64 if head_dim <= 128 else 32


def decode_stages(dtype: torch.dtype, quantized: bool) -> int:
    """Software-pipeline depth of the K/V loads: 2, but 1 for an fp32 model over a quantized cache.

    Its tiles are loaded as bytes and converted to fp32 in registers for the FMA dots; a pipelined
    load keeps a third form live, which spilled 350-620 bytes a thread on sm_80 and sm_90
    (`kernels.aot`), where one stage compiles to about 64 registers, like the fp32 cache's two.
    """
    return 1 if quantized and dtype == torch.float32 else 2


def dot_rows(group: int) -> int:
    """Query rows of one program's dots: the GQA group, padded to a power of two and the smallest dot."""
    return max(MIN_DOT_ROWS, triton.next_power_of_2(group))


def plan_splits(num_seqs: int, num_kv_heads: int, max_context: int, sm_count: int, tile: int) -> SplitPlan:
    """Split only when `num_seqs × num_kv_heads` programs leave SMs idle, and never below a few
    hundred tokens a split.

    `max_context` must be a static bound (the block table's capacity), not this step's longest
    sequence, so that the plan — and with it the grid — stays the same from step to step.
    """
    whole = SplitPlan(1, triton.cdiv(max(max_context, 1), tile) * tile)
    work = num_seqs * num_kv_heads
    wanted = WAVES_PER_SM * sm_count
    if work >= wanted:
        return whole
    splits = min(triton.cdiv(wanted, work), max_context // MIN_SPLIT_TOKENS, MAX_SPLITS)
    if splits < 2:
        return whole
    split_size = triton.cdiv(triton.cdiv(max_context, splits), tile) * tile
    return SplitPlan(triton.cdiv(max_context, split_size), split_size)


@triton.jit(do_not_specialize=["window"])
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    lse_ptr,
    scale_log2,
    block_size,
    split_size,
    window,
    stride_q_seq,
    stride_q_head,
    stride_c_block,
    stride_c_token,
    stride_c_head,
    stride_table,
    stride_o_seq,
    stride_o_head,
    stride_o_split,
    stride_l_seq,
    stride_l_head,
    k_scale_ptr,
    v_scale_ptr,
    stride_s_block,
    stride_s_token,
    stride_s_head,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    """Attention of one GQA group over one split of one sequence's visible context (the last `window`
    keys, or all of them when `window` is 0).

    With `WRITE_LSE` the normalised partial output goes to `out_ptr[seq, head, split]` (fp32) and
    its natural-log sum-exp to `lse_ptr`; without it (a single split) the final output is written.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = _first_visible(seq_len, window) + split * split_size
    # Split 0 always runs so an empty sequence (a padding row of a fixed-size batch) still gets zeros.
    if (split > 0) & (start >= seq_len):
        return
    end = tl.minimum(start + split_size, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    head_mask = rows < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q_offsets = seq.to(tl.int64) * stride_q_seq + heads[:, None].to(tl.int64) * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=head_mask[:, None] & dim_mask[None, :], other=0.0).to(DOT_DTYPE)

    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table
    kv_head_offset = kv_head.to(tl.int64) * stride_c_head
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)
        valid = positions < end
        block_ids = kv_block_ids(table_row, positions, valid, block_size)
        token_offsets = block_offsets(block_ids, positions, block_size, stride_c_block, stride_c_token)
        kv_offsets = (token_offsets + kv_head_offset)[:, None] + dims[None, :]
        kv_mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if QUANTIZED:
            scale_offsets = block_offsets(block_ids, positions, block_size, stride_s_block, stride_s_token)
            scale_offsets += kv_head.to(tl.int64) * stride_s_head
            k_scale = tl.load(k_scale_ptr + scale_offsets, mask=valid, other=0.0)
            v_scale = tl.load(v_scale_ptr + scale_offsets, mask=valid, other=0.0)
            scores = scores * k_scale[None, :]
        scores = tl.where(valid[None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if QUANTIZED:
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_mask = head_mask[:, None] & dim_mask[None, :]
    head_offsets = heads[:, None].to(tl.int64) * stride_o_head
    out_offsets = seq.to(tl.int64) * stride_o_seq + head_offsets + dims[None, :]
    if WRITE_LSE:
        out_offsets += split * stride_o_split
        tl.store(out_ptr + out_offsets, out, mask=out_mask)
        # Natural-log sum-exp of the split's scores; -inf (no weight) for an empty sequence.
        lse = (m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))) * 0.6931471805599453
        lse = tl.where(l_i > 0, lse, float("-inf"))
        lse_offsets = seq.to(tl.int64) * stride_l_seq + heads.to(tl.int64) * stride_l_head + split
        tl.store(lse_ptr + lse_offsets, lse, mask=head_mask)
    else:
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["window"])
def _merge_kernel(
    partial_ptr,
    lse_ptr,
    seq_lens_ptr,
    out_ptr,
    split_size,
    window,
    stride_p_seq,
    stride_p_head,
    stride_p_split,
    stride_l_seq,
    stride_l_head,
    stride_o_seq,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """Combine one (sequence, query head)'s split outputs, weighting each by exp(lse - max lse).

    Only the splits the sequence actually reached are read (their count comes from its visible
    length), so the partial buffers of early-exited programs are never looked at. An empty sequence
    — a padding row of a fixed-size batch — gets zeros.
    """
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    used = tl.cdiv(seq_len - _first_visible(seq_len, window), split_size)
    splits = tl.arange(0, SPLITS_PAD)
    split_mask = splits < used
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    lse_row = lse_ptr + seq.to(tl.int64) * stride_l_seq + head.to(tl.int64) * stride_l_head
    lse = tl.load(lse_row + splits, mask=split_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp(lse - lse_max)
    partial_row = partial_ptr + seq.to(tl.int64) * stride_p_seq + head.to(tl.int64) * stride_p_head
    partials = tl.load(
        partial_row + splits[:, None] * stride_p_split + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    total = tl.sum(weights, 0)
    out = tl.sum(weights[:, None] * partials, 0) / tl.where(total > 0, total, 1.0)
    out_offsets = seq.to(tl.int64) * stride_o_seq + head.to(tl.int64) * stride_o_head + dims
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def _check_shapes(query: torch.Tensor, k_cache: torch.Tensor) -> None:
    if query.dim() != 3 or k_cache.dim() != 4 or query.shape[-1] != k_cache.shape[-1]:
        raise ValueError(f"query {tuple(query.shape)} does not fit cache {tuple(k_cache.shape)}")
    if query.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{query.shape[1]} query heads do not split into {k_cache.shape[2]} KV heads")
    if query.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("query and cache need a contiguous head_dim")


def decode_partials(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    plan: SplitPlan,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """First stage of split-KV decode: per split, the normalised output and its log-sum-exp.

    Splits start at each sequence's first visible key (`torch_reference.decode_attention_partials`).
    Returns `partial [B, heads, num_splits, head_dim]` and `lse [B, heads, num_splits]`, both
    fp32. Entries of splits past a sequence's end are left unwritten.
    """
    _check_shapes(query, k_cache)
    batch, num_heads, head_dim = query.shape
    partial = torch.empty(
        (batch, num_heads, plan.num_splits, head_dim), dtype=torch.float32, device=query.device
    )
    lse = torch.empty((batch, num_heads, plan.num_splits), dtype=torch.float32, device=query.device)
    scales = (k_scales, v_scales)
    _launch_decode(query, k_cache, v_cache, block_tables, seq_lens, scale, plan, partial, lse, scales, window)
    return partial, lse


def merge_partials(
    partial: torch.Tensor,
    lse: torch.Tensor,
    seq_lens: torch.Tensor,
    split_size: int,
    dtype: torch.dtype,
    window: int | None = None,
) -> torch.Tensor:
    """Second stage of split-KV decode: `[B, heads, head_dim]` in `dtype` from the split outputs
    (`window` as the first stage had it)."""
    batch, num_heads, num_splits, head_dim = partial.shape
    out = torch.empty((batch, num_heads, head_dim), dtype=dtype, device=partial.device)
    args = (
        partial,
        lse,
        seq_lens,
        out,
        split_size,
        kernel_window(window),
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
    )
    constexprs = {
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": triton.next_power_of_2(head_dim),
        "SPLITS_PAD": triton.next_power_of_2(num_splits),
    }
    launch(KernelLaunch(_merge_kernel, (batch, num_heads), args, constexprs, num_warps=4))
    return out


def _launch_decode(
    query, k_cache, v_cache, block_tables, seq_lens, scale, plan, out, lse, scales, window
) -> None:
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    write_lse = lse is not None
    out_strides = (out.stride(0), out.stride(1), out.stride(2) if write_lse else 0)
    lse_strides = (lse.stride(0), lse.stride(1)) if write_lse else (0, 0)
    scale_args, quantized = quantized_launch_args(*scales, k_cache)
    dot_type = dot_dtype(_decode_kernel, query.dtype)
    args = (
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        lse if write_lse else out,
        scale * math.log2(math.e),
        block_size,
        plan.split_size,
        kernel_window(window),
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        *out_strides,
        *lse_strides,
        *scale_args,
    )
    constexprs = {
        "GROUP": group,
        "GROUP_PAD": dot_rows(group),
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": triton.next_power_of_2(head_dim),
        "BLOCK_N": kv_tile_size(head_dim, query.dtype),
        "DOT_DTYPE": dot_type,
        "DOT_PRECISION": dot_precision(dot_type),
        "WRITE_LSE": write_lse,
        "QUANTIZED": quantized,
    }
    grid = (batch, num_kv_heads, plan.num_splits)
    stages = decode_stages(query.dtype, quantized)
    launch(KernelLaunch(_decode_kernel, grid, args, constexprs, num_warps=4, num_stages=stages))


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    plan: SplitPlan | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Decode attention for `query [B, heads, head_dim]`: one launch, or two when the plan splits.

    Same contract as `torch_reference.paged_decode_attention` (the scale caches given for a
    quantized cache, `window` a sliding window). `plan` defaults to `plan_splits` over the most keys
    a query can see: the block table's capacity, or the window when shorter. Tests pass one to force
    a split count.
    """
    _check_shapes(query, k_cache)
    kernel_window(window)
    batch, _, head_dim = query.shape
    if plan is None:
        visible = block_tables.shape[1] * k_cache.shape[1]
        if window is not None:
            visible = min(visible, window)
        tile = kv_tile_size(head_dim, query.dtype)
        plan = plan_splits(batch, k_cache.shape[2], visible, num_sms(query.device), tile)
    scales = (k_scales, v_scales)
    if plan.num_splits == 1:
        out = torch.empty_like(query)
        tables, lens = block_tables, seq_lens
        _launch_decode(query, k_cache, v_cache, tables, lens, scale, plan, out, None, scales, window)
        return out
    partial, lse = decode_partials(
        query, k_cache, v_cache, block_tables, seq_lens, scale, plan, k_scales, v_scales, window
    )
    return merge_partials(partial, lse, seq_lens, plan.split_size, query.dtype, window)
