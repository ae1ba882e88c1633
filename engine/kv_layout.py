"""Which layers keep their KV together: layers grouped by attention type, each group with its own blocks.

A model whose layers all attend globally has one group holding every layer, and a block is what it
always was: one token range's K and V in all layers. A model that mixes full and sliding-window
layers (Gemma 3: five local layers to one global) would waste most of its KV if a block covered every
layer, because a local layer can only ever read its last `window` tokens. So layers are grouped by
their window, and each group keeps its own block table per sequence; a block of a local group that
has slid out of the window is freed while the global group's block for the same tokens stays.

All groups draw from one pool of equally sized blocks (as vLLM's hybrid KV cache manager does), so
no share of memory has to be guessed per attention type: groups have the same number of layer
*slots* (the smallest type's layer count; larger types split into several groups, the last one
padded), and the cache holds one K and one V tensor per slot. Layer `l` reads and writes the tensor
of its slot, with its group's block table; a block id belongs to one group at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

# A block-table entry that holds no block: a sliding group's block that slid out of the window (or was
# never needed, e.g. below a prefix hit's last window). Tensors built from tables map it to block 0,
# which the kernels never read since it lies outside every query's window.
NULL_BLOCK = -1


def first_visible_block(next_position: int, window: int | None, block_size: int) -> int:
    """The first logical block a query at `next_position` or later can still read (0 for full attention).

    A query at p reads keys p - window < j <= p, so block j // block_size of the first such j."""
    if window is None:
        return 0
    return max(0, next_position - window + 1) // block_size


@dataclass(frozen=True)
class KVGroup:
    """Layers that share one block table: their attention window (None: full attention) and indices."""

    window: int | None
    layers: tuple[int, ...]

    @property
    def is_sliding(self) -> bool:
        return self.window is not None


@dataclass(frozen=True)
class KVLayout:
    """The groups of a model's layers and the number of per-slot cache tensors they share."""

    groups: tuple[KVGroup, ...]
    num_slots: int

    @classmethod
    def from_layer_windows(cls, layer_windows: tuple[int | None, ...]) -> KVLayout:
        """Group layers by window, full attention first; one group when every layer has the same window."""
        by_window: dict[int | None, list[int]] = {}
        for layer, window in enumerate(layer_windows):
            by_window.setdefault(window, []).append(layer)
        windows = sorted(by_window, key=lambda w: (w is not None, w or 0))
        width = min(len(layers) for layers in by_window.values())
        groups = tuple(
            KVGroup(window, tuple(by_window[window][start : start + width]))
            for window in windows
            for start in range(0, len(by_window[window]), width)
        )
        return cls(groups=groups, num_slots=width)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def is_hybrid(self) -> bool:
        """True when some layer slides: blocks then leave a sequence's tables before it ends."""
        return any(group.is_sliding for group in self.groups)

    @cached_property
    def group_of_layer(self) -> tuple[int, ...]:
        return self._index(lambda g, s: g)

    @cached_property
    def slot_of_layer(self) -> tuple[int, ...]:
        return self._index(lambda g, s: s)

    def _index(self, pick) -> tuple[int, ...]:
        found = {
            layer: pick(g, slot)
            for g, group in enumerate(self.groups)
            for slot, layer in enumerate(group.layers)
        }
        return tuple(found[layer] for layer in range(len(found)))

    def describe(self) -> list[dict]:
        """The layout as plain data, for the tiers' compatibility hash and for logs."""
        return [{"window": g.window, "layers": list(g.layers)} for g in self.groups]
