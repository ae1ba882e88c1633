"""The paged KV cache tensors: per layer slot, K and V of shape [num_blocks, block_size, kv_heads, head_dim].

Layers are grouped by attention window (`engine.kv_layout`): the cache holds one K and one V tensor per
*slot*, and layer l uses slot `slot_of_layer[l]` with its group's block table. `k[l]`/`v[l]` are that
slot's tensors (the same objects for layers of different groups in one slot); a block id belongs to one
group at a time, so a block's rows in a slot tensor are its group's layer. A model whose layers all
attend alike has one group and one slot per layer: exactly one tensor per layer, as always.

A quantized cache (`--kv-cache-dtype int8` or `fp8_e4m3`) also holds, per layer, one fp32 scale per
(slot, KV head) for K and for V, `[num_blocks, block_size, kv_heads]`, indexed by the same block
numbers: a block's elements and scales move together (copies, the wire), so a block is never
half-quantized. Its keys are stored rotated by `rotation` (see `kernels.kv_quant`), which the model
applies to keys and queries alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from base.kv_dtypes import SCALE_DTYPE, is_quantized
from engine.config import ModelConfig
from engine.kv_layout import KVLayout
from kernels.kv_quant import kv_rotation


@dataclass
class KVCache:
    """One K and one V tensor per layer (slot tensors, shared by the layers of one slot), all indexed by
    the same physical block numbers; one K and one V scale tensor per layer likewise when the cache is
    quantized (empty lists otherwise)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    k_scales: list[torch.Tensor] = field(default_factory=list)
    v_scales: list[torch.Tensor] = field(default_factory=list)
    # The `[head_dim, head_dim]` rotation of a quantized cache's keys (and of the queries that read them).
    rotation: torch.Tensor | None = None
    # Which layers share a slot tensor; None: one slot per layer (a cache built from plain lists).
    layout: KVLayout | None = None

    @classmethod
    def allocate(
        cls, model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> KVCache:
        """Zeroed caches of element `dtype` (the KV dtype), one per layout slot, with scale caches when it
        is quantized; listed per layer."""
        layout = model.kv_layout
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)

        def tensors(shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
            slots = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.num_slots)]
            return [slots[slot] for slot in layout.slot_of_layer]

        if not is_quantized(dtype):
            return cls(k=tensors(shape, dtype), v=tensors(shape, dtype), layout=layout)
        return cls(
            k=tensors(shape, dtype),
            v=tensors(shape, dtype),
            k_scales=tensors(shape[:3], SCALE_DTYPE),
            v_scales=tensors(shape[:3], SCALE_DTYPE),
            rotation=kv_rotation(model.head_dim).to(device),
            layout=layout,
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

    def slot_layers(self) -> list[int]:
        """One layer per slot tensor: the layers whose `k`/`v` entries are all the distinct tensors."""
        if self.layout is None:
            return list(range(len(self.k)))
        return list(self.layout.groups[0].layers)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K, V and scales in every slot: a forked sequence's copy of a shared block.

        Both blocks belong to one group (the caller copies within a group's table), whose layers are
        exactly the block's rows in the slot tensors."""
        layers = self.slot_layers()
        for caches in (self.k, self.v, self.k_scales, self.v_scales):
            for layer in layers if caches else ():
                caches[layer][dst].copy_(caches[layer][src])
