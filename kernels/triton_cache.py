"""Writing a step's new K/V rows into their paged-cache slots, both caches in one launch.

One program per token copies that token's `[kv_heads, head_dim]` K and V rows to slot
`slot_mapping[t]` (block slot // block_size, row slot % block_size). A slot of -1 marks a padding
token of a fixed-size batch and writes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import KernelLaunch, launch, slot_offsets


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
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    row_offset = slot_offsets(slot, block_size, stride_c_block, stride_c_token)
    cache_offsets = row_offset + heads[:, None].to(tl.int64) * stride_c_head + dims[None, :]
    key_offsets = token * stride_k_token + heads[:, None] * stride_k_head + dims[None, :]
    value_offsets = token * stride_v_token + heads[:, None] * stride_v_head + dims[None, :]
    key = tl.load(key_ptr + key_offsets, mask=mask)
    value = tl.load(value_ptr + value_offsets, mask=mask)
    tl.store(k_cache_ptr + cache_offsets, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offsets, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store `key`/`value [T, kv_heads, head_dim]` at their flat slots; same contract as the reference.

    K and V may be strided views (they usually are slices of one fused qkv projection); only
    their head_dim must be contiguous. Both caches must share one layout.
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
    constexprs = {
        "NUM_KV_HEADS": num_kv_heads,
        "HEADS_PAD": triton.next_power_of_2(num_kv_heads),
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": triton.next_power_of_2(head_dim),
    }
    launch(KernelLaunch(_write_kv_kernel, (num_tokens,), args, constexprs, num_warps=4))
