"""The paged KV cache tensors: per layer, K and V of shape [num_blocks, block_size, kv_heads, head_dim].

A quantized cache (`--kv-cache-dtype int8` or `fp8_e4m3`) also holds, per layer, one fp32 scale per
(slot, KV head) for K and for V, `[num_blocks, block_size, kv_heads]`, indexed by the same block
numbers: a block's elements and scales move together (copies, the wire), so a block is never
half-quantized. Its keys are stored rotated by `rotation` (see `kernels.kv_quant`), which the model
applies to keys and queries alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.config import ModelConfig
from kernels.kv_quant import SCALE_DTYPE, is_quantized, kv_rotation


@dataclass
class KVCache:
    """One K and one V tensor per layer, all indexed by the same physical block numbers; one K and one
    V scale tensor per layer when the cache is quantized (empty lists otherwise)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    k_scales: list[torch.Tensor] = field(default_factory=list)
    v_scales: list[torch.Tensor] = field(default_factory=list)
    # The `[head_dim, head_dim]` rotation of a quantized cache's keys (and of the queries that read them).
    rotation: torch.Tensor | None = None

    @classmethod
    def allocate(
        cls, model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> KVCache:
        """Zeroed caches of element `dtype` (the KV dtype), with scale caches when it is quantized."""
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)

        def tensors(shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
            return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]

        if not is_quantized(dtype):
            return cls(k=tensors(shape, dtype), v=tensors(shape, dtype))
        return cls(
            k=tensors(shape, dtype),
            v=tensors(shape, dtype),
            k_scales=tensors(shape[:3], SCALE_DTYPE),
            v_scales=tensors(shape[:3], SCALE_DTYPE),
            rotation=kv_rotation(model.head_dim).to(device),
        )

    @property
    def block_size(self) -> int:
        return self.k[0].shape[1]

    @property
    def dtype(self) -> torch.dtype:
        """The element dtype of K and V."""
        return self.k[0].dtype

    @property
    def quantized(self) -> bool:
        return bool(self.k_scales)

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer `layer`'s K and V scale caches, or (None, None) for a cache that is not quantized."""
        if not self.k_scales:
            return None, None
        return self.k_scales[layer], self.v_scales[layer]

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K, V and scales in every layer: a forked sequence's copy of a shared block."""
        for cache in (*self.k, *self.v, *self.k_scales, *self.v_scales):
            cache[dst].copy_(cache[src])
