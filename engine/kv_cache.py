"""The paged KV cache tensors: per layer, K and V of shape [num_blocks, block_size, kv_heads, head_dim]."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig


@dataclass
class KVCache:
    """One K and one V tensor per layer, all indexed by the same physical block numbers."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @classmethod
    def allocate(
        cls, model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> KVCache:
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        return cls(
            k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)],
            v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)],
        )

    @property
    def block_size(self) -> int:
        return self.k[0].shape[1]

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K and V, in every layer (a forked sequence's own copy of a shared block)."""
        for cache in (*self.k, *self.v):
            cache[dst].copy_(cache[src])
