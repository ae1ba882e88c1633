"""The paged KV pool's bookkeeping: a fixed set of blocks, a free list, and reference counts.

Nothing here touches tensors: a block is an index into the per-layer cache tensors. Exact
accounting (`num_free_blocks`) is what lets tests prove that no request ever leaks a block.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from engine.errors import OutOfBlocksError


class BlockAllocator:
    """Hands out block indices from a fixed pool; a block returns to the pool when its refcount hits 0."""

    def __init__(self, num_blocks: int, order: Iterable[int] | None = None) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks) if order is None else order)
        if sorted(self._free) != list(range(num_blocks)):
            raise ValueError("order must be a permutation of range(num_blocks)")
        self._refcount = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int = 1) -> list[int]:
        """Take `count` blocks, all or nothing."""
        if count > len(self._free):
            raise OutOfBlocksError(f"need {count} KV blocks, {len(self._free)} free of {self.num_blocks}")
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self._refcount[block] = 1
        return blocks

    def share(self, block: int) -> None:
        """Add a reference to a live block (a forked or prefix-shared sequence)."""
        if self._refcount[block] == 0:
            raise ValueError(f"block {block} is free and cannot be shared")
        self._refcount[block] += 1

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; blocks nobody references go back to the pool."""
        for block in blocks:
            if self._refcount[block] <= 0:
                raise ValueError(f"block {block} freed twice")
            self._refcount[block] -= 1
            if self._refcount[block] == 0:
                self._free.append(block)


class BlockManager:
    """The KV pool as its users see it: block tables grow with `allocate` and empty with `free`, and
    `num_free_blocks` / `num_blocks` say how full it is. Schedulers of both tiers go through this API
    (via `Engine`), never through the allocator underneath."""

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def blocks_missing(self, block_table: list[int], num_tokens: int) -> int:
        return max(0, self.blocks_for_tokens(num_tokens) - len(block_table))

    def can_allocate(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_missing(block_table, num_tokens) <= self.allocator.num_free_blocks

    def allocate(self, block_table: list[int], num_tokens: int) -> None:
        """Extend `block_table` in place so it holds `num_tokens` tokens; all or nothing."""
        missing = self.blocks_missing(block_table, num_tokens)
        if missing:
            block_table.extend(self.allocator.allocate(missing))

    def free(self, block_table: list[int]) -> None:
        """Free every block of a table and empty it, so a second free is harmless."""
        self.allocator.free(block_table)
        block_table.clear()

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def num_blocks(self) -> int:
        """The pool's size in blocks."""
        return self.allocator.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool in use, for the kv_cache_usage_perc metric."""
        total = self.num_blocks
        return (total - self.num_free_blocks) / total if total else 0.0
