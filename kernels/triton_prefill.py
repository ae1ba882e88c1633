"""Chunked-prefill attention over the paged cache, for a mixed batch of prompt chunks and decodes.

Sequence i owns query rows `query_start_loc[i]:query_start_loc[i+1]`, its last q_len positions;
their K/V have already been written into the cache, so the cached prefix and the chunk itself
are one range of context positions `0..seq_len`, all read through the block table. One program
computes a tile of `BLOCK_M` query rows of one query head with an fp32 online softmax and a
causal mask (query at position p sees keys 0..p, or with a sliding window of w tokens keys
p - w < j <= p); KV positions past the tile's last query position, or below the first one its first
row's window reaches, are never visited (under a window those blocks may be freed and reused). The
window's size is a runtime scalar, so every window shares one compiled kernel; whether there is one
at all is a constexpr (`WINDOWED`), which keeps the causal kernel exactly as it was (the extra bound
cost its largest tiles a spill). A single-token decode is simply a sequence with q_len 1, so prefill
chunks and decodes share the launch.

The grid is `(query tiles of the longest chunk, sequences, query heads)`; tiles past a shorter
chunk's end exit at once. A quantized cache (int8, fp8 e4m3) is dequantized as in
`triton_decode`: elements converted in registers, per-token scales applied to the score columns (K)
and to the probabilities (V).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.metadata import AttentionMetadata
from kernels.triton_common import (
    KernelLaunch,
    block_offsets,
    dot_dtype,
    dot_precision,
    kv_block_ids,
    launch,
    quantized_launch_args,
)
from kernels.window import kernel_window


@dataclass(frozen=True)
class PrefillTile:
    """Launch shape: query rows and context positions per tile, and the warps/stages to run them."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def prefill_tile(head_dim: int, dtype: torch.dtype, quantized: bool = False) -> PrefillTile:
    """Tiles sized so Q, K, V and the accumulator of one program fit in registers/shared memory.

    The Q tile and accumulator grow with head_dim, so larger heads get fewer rows or more warps.
    fp32 dots run on the FMA units (IEEE, for parity with the reference) with operands and products
    in registers, so fp32 gets 64-row tiles of 32 (head_dim 64) or 16 positions over 8 warps, which
    compile to at most 128 registers without spills on sm_80 and sm_90; the half-precision tiles
    spilled 40-90 KB a thread there (`kernels.aot`).

    A quantized cache's K/V tiles are loaded as bytes and converted in registers, so a tile is live in
    both forms and a pipelined load adds a third: the tiles above spilled 16-2000 bytes a thread with
    it. Its tiles are therefore pipelined less (fp32: not at all) and, from head_dim 128 (and for fp32
    from 80), narrower; each choice below is the first that compiled without spills on sm_80 and sm_90.
    """
    if quantized:
        return _quantized_prefill_tile(head_dim, dtype)
    if dtype == torch.float32:
        return PrefillTile(block_m=64, block_n=32 if head_dim <= 64 else 16, num_warps=8, num_stages=2)
    if head_dim <= 64:
        return PrefillTile(block_m=128, block_n=64, num_warps=4, num_stages=3)
    if head_dim <= 128:
        return PrefillTile(block_m=128, block_n=64, num_warps=8, num_stages=2)
    return PrefillTile(block_m=64, block_n=32, num_warps=4, num_stages=2)


def _quantized_prefill_tile(head_dim: int, dtype: torch.dtype) -> PrefillTile:
    if dtype == torch.float32:
        if head_dim <= 64:
            return PrefillTile(block_m=64, block_n=32, num_warps=8, num_stages=1)
        return PrefillTile(block_m=32, block_n=16, num_warps=8, num_stages=1)
    if head_dim <= 128:
        return PrefillTile(block_m=128, block_n=64 if head_dim <= 64 else 32, num_warps=8, num_stages=2)
    return PrefillTile(block_m=64, block_n=32, num_warps=4, num_stages=1)


@triton.jit(do_not_specialize=["window"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    out_ptr,
    scale_log2,
    block_size,
    window,
    stride_q_token,
    stride_q_head,
    stride_c_block,
    stride_c_token,
    stride_c_head,
    stride_table,
    stride_o_token,
    stride_o_head,
    k_scale_ptr,
    v_scale_ptr,
    stride_s_block,
    stride_s_token,
    stride_s_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    query_pos = prefix + rows
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    tokens = (q_begin + rows).to(tl.int64)
    q_offsets = tokens[:, None] * stride_q_token + head.to(tl.int64) * stride_q_head + dims[None, :]
    io_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + q_offsets, mask=io_mask, other=0.0).to(DOT_DTYPE)

    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table
    kv_head_offset = (head // GROUP).to(tl.int64) * stride_c_head
    kv_end = tl.minimum(seq_len, prefix + (tile + 1) * BLOCK_M)
    if WINDOWED:
        # Each row sees keys in (query_pos - window, query_pos]; the tile's first row's window starts first.
        kv_begin = tl.maximum(prefix + tile * BLOCK_M - window + 1, 0)
        # A finite floor, not -inf: a row may see no key of a tile (one below its window), and its max
        # must stay a number for alpha and p to come out 0, not NaN. Scores never get near it.
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    else:
        kv_begin = 0
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for tile_start in range(kv_begin, kv_end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)
        valid = positions < kv_end
        block_ids = kv_block_ids(table_row, positions, valid, block_size)
        token_offsets = block_offsets(block_ids, positions, block_size, stride_c_block, stride_c_token)
        kv_offsets = (token_offsets + kv_head_offset)[:, None] + dims[None, :]
        kv_mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if QUANTIZED:
            scale_offsets = block_offsets(block_ids, positions, block_size, stride_s_block, stride_s_token)
            scale_offsets += (head // GROUP).to(tl.int64) * stride_s_head
            k_scale = tl.load(k_scale_ptr + scale_offsets, mask=valid, other=0.0)
            v_scale = tl.load(v_scale_ptr + scale_offsets, mask=valid, other=0.0)
            scores = scores * k_scale[None, :]
        if WINDOWED:
            # Both bounds in one unsigned compare, 0 <= p - j < window (a key past the row wraps to a
            # huge distance), and no kv_end mask, which only padding rows past the chunk need and their
            # output is never stored: two compares and the mask spilled 72 bytes on sm_80 (`kernels.aot`).
            distance = (query_pos[:, None] - positions[None, :]).to(tl.uint32)
            visible = distance < window.to(tl.uint32)
        else:
            visible = valid[None, :] & (positions[None, :] <= query_pos[:, None])
        scores = tl.where(visible, scores * scale_log2, float("-inf"))
        # Without a window every row sees key 0, so m_new is finite from the first tile on.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if QUANTIZED:
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    o_offsets = tokens[:, None] * stride_o_token + head.to(tl.int64) * stride_o_head + dims[None, :]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    tile: PrefillTile | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention for the flat token batch `query [T, heads, head_dim]` described by `meta`.

    Same contract as `torch_reference.paged_attention` (the scale caches given for a quantized
    cache, `window` a sliding window). `tile` defaults to `prefill_tile(head_dim, query dtype)`;
    tests pass smaller ones to cover many tiles with few tokens.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"query {tuple(query.shape)} does not fit cache {tuple(k_cache.shape)}")
    if query.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("query and cache need a contiguous head_dim")
    scale_args, quantized = quantized_launch_args(k_scales, v_scales, k_cache)
    tile = tile or prefill_tile(head_dim, query.dtype, quantized)
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    grid = (triton.cdiv(meta.max_query_len, tile.block_m), meta.num_seqs, num_heads)
    dot_type = dot_dtype(_prefill_kernel, query.dtype)
    args = (
        query,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        out,
        scale * math.log2(math.e),
        block_size,
        kernel_window(window),
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        meta.block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        *scale_args,
    )
    constexprs = {
        "GROUP": num_heads // num_kv_heads,
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": triton.next_power_of_2(head_dim),
        "BLOCK_M": tile.block_m,
        "BLOCK_N": tile.block_n,
        "DOT_DTYPE": dot_type,
        "DOT_PRECISION": dot_precision(dot_type),
        "QUANTIZED": quantized,
        "WINDOWED": window is not None,
    }
    launch(KernelLaunch(_prefill_kernel, grid, args, constexprs, tile.num_warps, tile.num_stages))
    return out
