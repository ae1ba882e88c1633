"""Block allocator and manager: exhaustion, exact accounting, reference counts."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockAllocator, BlockManager
from engine.errors import OutOfBlocksError


def test_allocate_until_exhausted_then_clear_error():
    alloc = BlockAllocator(4)
    assert alloc.allocate(3) == [0, 1, 2]
    with pytest.raises(OutOfBlocksError, match="need 2 KV blocks, 1 free of 4"):
        alloc.allocate(2)
    assert alloc.num_free_blocks == 1, "a failed allocation must take nothing"


def test_free_returns_every_block_and_double_free_is_refused():
    alloc = BlockAllocator(8, order=[7, 6, 5, 4, 3, 2, 1, 0])
    blocks = alloc.allocate(5)
    assert blocks == [7, 6, 5, 4, 3]
    alloc.free(blocks)
    assert alloc.num_free_blocks == 8
    with pytest.raises(ValueError, match="freed twice"):
        alloc.free([7])


def test_shared_block_survives_until_last_reference():
    alloc = BlockAllocator(2)
    (block,) = alloc.allocate(1)
    alloc.share(block)
    assert alloc.refcount(block) == 2
    alloc.free([block])
    assert alloc.num_free_blocks == 1 and alloc.refcount(block) == 1
    alloc.free([block])
    assert alloc.num_free_blocks == 2
    with pytest.raises(ValueError, match="is free"):
        alloc.share(block)


def test_order_must_be_a_permutation():
    with pytest.raises(ValueError, match="permutation"):
        BlockAllocator(3, order=[0, 0, 1])


def test_manager_grows_one_token_at_a_time_and_releases():
    manager = BlockManager(BlockAllocator(3), block_size=4)
    table: list[int] = []
    for num_tokens in range(1, 13):
        manager.allocate(table, num_tokens)
        assert len(table) == (num_tokens + 3) // 4
    assert manager.num_free_blocks == 0 and manager.usage == 1.0
    assert not manager.can_allocate(table, 13)
    with pytest.raises(OutOfBlocksError):
        manager.allocate(table, 13)
    assert len(table) == 3
    manager.free(table)
    assert table == [] and manager.num_free_blocks == 3 and manager.usage == 0.0
    manager.free(table)
    assert manager.num_free_blocks == 3
