"""Writing a step's new K/V rows into their paged-cache slots, both caches in one launch.

One program per token copies that token's `[kv_heads, head_dim]` K and V rows to slot
`slot_mapping[t]` (block slot // block_size, row slot % block_size). A slot of -1 marks a padding
token of a fixed-size batch and writes nothing. Into a quantized cache (int8, fp8 e4m3) each head's
row is quantized on the way, with its scale written to the scale caches at the same slot, as
`torch_reference.quantize_kv` defines it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from base.kv_dtypes import is_quantized, quant_max
from kernels.triton_common import KernelLaunch, launch, quantized_launch_args, round_half_even, slot_offsets


@triton.jit
def _round_to_fp8_e4m3(x):
    """fp32 `x` (|x| <= 448) rounded to the nearest fp8 e4m3 value, ties to even, still in fp32.

    The cast to fp8 would round by itself on a GPU, but Triton's interpreter drops the carry when a
    value rounds up into the next power of two (1.97 becomes 1.0, not 2.0); rounding here leaves the
    cast exact everywhere. The grid's step is 2**(exponent - 3) for normal values and 2**-9 below
    2**-6 (subnormals); scaling by a power of two is exact, so only the integer rounding rounds. It
    multiplies by the step's reciprocal (also a power of two) rather than dividing: CUDA's `/` is
    approximate.
    """
    biased_exponent = (x.to(tl.int32, bitcast=True) >> 23) & 0xFF
    step_exponent = tl.maximum(biased_exponent, 127 - 6) - 3
    step = (step_exponent << 23).to(tl.float32, bitcast=True)
    inverse_step = ((254 - step_exponent) << 23).to(tl.float32, bitcast=True)
    return round_half_even(x * inverse_step) * step


@triton.jit
def _quantize_rows(rows, QMAX: tl.constexpr, TO_INT8: tl.constexpr):
    """(stored values, scale) per row of `[heads, dims]` fp32: scale = max|row| / QMAX, stored =
    row / scale clamped to ±QMAX and rounded half to even onto the int8 (TO_INT8) or fp8 e4m3 grid.

    Both divisions are IEEE-rounded (`div_rn`): a plain `/` compiles to CUDA's approximate division,
    whose last-bit errors move values across a rounding boundary and off the torch reference's."""
    scale = tl.math.div_rn(tl.max(tl.abs(rows), 1), QMAX)
    scaled = tl.math.div_rn(rows, tl.where(scale > 0, scale, 1.0)[:, None])
    scaled = tl.minimum(tl.maximum(scaled, -QMAX), QMAX)
    if TO_INT8:
        scaled = round_half_even(scaled)
    else:
        scaled = _round_to_fp8_e4m3(scaled)
    return scaled, scale


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    block_size,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_c_block,
    stride_c_token,
    stride_c_head,
    k_scale_ptr,
    v_scale_ptr,
    stride_s_block,
    stride_s_token,
    stride_s_head,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    QUANTIZED: tl.constexpr,
    QMAX: tl.constexpr,
    TO_INT8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    head_mask = heads < NUM_KV_HEADS
    mask = head_mask[:, None] & (dims < HEAD_DIM)[None, :]
    row_offset = slot_offsets(slot, block_size, stride_c_block, stride_c_token)
    cache_offsets = row_offset + heads[:, None].to(tl.int64) * stride_c_head + dims[None, :]
    key_offsets = token * stride_k_token + heads[:, None] * stride_k_head + dims[None, :]
    value_offsets = token * stride_v_token + heads[:, None] * stride_v_head + dims[None, :]
    key = tl.load(key_ptr + key_offsets, mask=mask, other=0.0)
    value = tl.load(value_ptr + value_offsets, mask=mask, other=0.0)
    if QUANTIZED:
        key, k_scale = _quantize_rows(key.to(tl.float32), QMAX, TO_INT8)
        value, v_scale = _quantize_rows(value.to(tl.float32), QMAX, TO_INT8)
        scale_row = slot_offsets(slot, block_size, stride_s_block, stride_s_token)
        scale_offsets = scale_row + heads.to(tl.int64) * stride_s_head
        tl.store(k_scale_ptr + scale_offsets, k_scale, mask=head_mask)
        tl.store(v_scale_ptr + scale_offsets, v_scale, mask=head_mask)
    tl.store(k_cache_ptr + cache_offsets, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offsets, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """Store `key`/`value [T, kv_heads, head_dim]` at their flat slots; same contract as the reference.

    K and V may be strided views (they usually are slices of one fused qkv projection); only
    their head_dim must be contiguous. Both caches must share one layout, and so must the scale
    caches of a quantized cache.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or k_cache.shape[2:] != key.shape[1:] or v_cache.stride() != k_cache.stride():
        raise ValueError(f"K/V {tuple(key.shape)} do not fit caches {tuple(k_cache.shape)}")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("K, V and the caches need a contiguous head_dim")
    if num_tokens == 0:
        return
    args = (
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_cache.shape[1],
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
    )
    scale_args, quantized = quantized_launch_args(k_scales, v_scales, k_cache)
    if quantized != is_quantized(k_cache.dtype):
        raise ValueError(f"a {k_cache.dtype} cache is written {'with' if quantized else 'without'} scales")
    constexprs = {
        "NUM_KV_HEADS": num_kv_heads,
        "HEADS_PAD": triton.next_power_of_2(num_kv_heads),
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": triton.next_power_of_2(head_dim),
        "QUANTIZED": quantized,
        "QMAX": quant_max(k_cache.dtype) if quantized else 0.0,
        "TO_INT8": k_cache.dtype == torch.int8,
    }
    args = (*args, *scale_args)
    launch(KernelLaunch(_write_kv_kernel, (num_tokens,), args, constexprs, num_warps=4))
