"""Block manager: exhaustion, exact accounting, reference counts, prefix caching, LRU eviction, forks."""

from __future__ import annotations

import pytest

from base.errors import OutOfBlocksError
from engine import block_manager as bm_module
from engine.block_manager import BlockManager
from engine.params import SamplingParams, StoppingParams
from engine.sequence import Sequence


def make_seq(tokens: list[int], salt: str = "", name: str = "r") -> Sequence:
    return Sequence(name, tokens, SamplingParams(), StoppingParams(), cache_salt=salt)


def computed(manager: BlockManager, tokens: list[int], salt: str = "", name: str = "r") -> Sequence:
    """A sequence admitted and fully computed (as a step would leave it), still holding its blocks."""
    seq = make_seq(tokens, salt, name)
    manager.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    manager.commit(seq)
    return seq


def assert_idle(manager: BlockManager) -> None:
    assert all(manager.refcount(b) == 0 for b in range(manager.num_blocks))
    assert manager.num_free_blocks == manager.num_blocks and manager.usage == 0.0


def test_allocate_until_exhausted_then_clear_error_and_take_nothing():
    manager = BlockManager(4, block_size=4)
    seq = make_seq(list(range(12)))
    manager.allocate(seq, 12)
    assert seq.block_table == [0, 1, 2]
    other = make_seq(list(range(100, 105)))
    with pytest.raises(OutOfBlocksError, match="need 2 KV blocks, 1 free of 4"):
        manager.allocate(other, 5)
    assert other.block_table == [] and manager.num_free_blocks == 1, "a failed allocation takes nothing"


def test_free_returns_every_block_and_double_free_is_refused():
    manager = BlockManager(8, block_size=4, order=[7, 6, 5, 4, 3, 2, 1, 0])
    seq = make_seq(list(range(18)))
    manager.allocate(seq, 18)
    assert seq.block_table == [7, 6, 5, 4, 3]
    table = list(seq.block_table)
    manager.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert_idle(manager)
    manager.free(seq)  # an emptied table frees nothing
    seq.block_table.extend(table[:1])
    with pytest.raises(ValueError, match="freed twice"):
        manager.free(seq)


def test_order_must_be_a_permutation():
    with pytest.raises(ValueError, match="permutation"):
        BlockManager(3, block_size=4, order=[0, 0, 1])


def test_grows_one_token_at_a_time():
    manager = BlockManager(3, block_size=4)
    table: list[int] = []
    for num_tokens in range(1, 13):
        manager.grow(table, num_tokens)
        assert len(table) == (num_tokens + 3) // 4
    assert manager.num_free_blocks == 0 and manager.usage == 1.0
    assert not manager.can_grow(table, 13)
    with pytest.raises(OutOfBlocksError):
        manager.grow(table, 13)
    assert len(table) == 3


def test_second_request_reuses_the_shared_full_blocks_and_computes_only_the_rest():
    manager = BlockManager(16, block_size=4)
    first = computed(manager, list(range(10)))  # blocks [0..3] [4..7] full, [8, 9] partial
    second = make_seq(list(range(9)) + [77, 78])
    assert manager.blocks_needed(second, second.num_tokens) == 1  # 3 blocks, 2 of them cached and live
    manager.allocate(second, second.num_tokens)
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2], "partial blocks are never shared"
    assert second.num_computed_tokens == 8 and second.num_cached_tokens == 8
    assert [manager.refcount(b) for b in first.block_table] == [2, 2, 1]
    assert (manager.num_queried_tokens, manager.num_hit_tokens) == (21, 8)
    manager.free(first)
    manager.free(second)
    assert_idle(manager)
    assert manager.num_cached_blocks == 2


def test_the_last_token_is_always_computed():
    manager = BlockManager(8, block_size=4)
    computed(manager, list(range(8)))
    again = make_seq(list(range(8)))
    manager.allocate(again, 8)
    assert again.num_computed_tokens == 4, "a whole-prompt hit must leave its last token to compute"


def test_released_blocks_stay_cached_until_an_allocation_evicts_them_least_recent_first():
    manager = BlockManager(4, block_size=2)
    old = computed(manager, [1, 2, 3], name="old")  # one full cached block
    manager.free(old)
    new = computed(manager, [5, 6, 7], name="new")
    manager.free(new)
    assert manager.num_free_blocks == 4 and manager.num_cached_blocks == 2
    filler = make_seq(list(range(100, 105)), name="filler")
    manager.allocate(filler, 5)  # 2 never-cached blocks + 1 eviction: the older chain goes
    assert manager.num_cached_blocks == 1
    assert manager.match_prefix(make_seq([1, 2, 3])) == []
    assert len(manager.match_prefix(make_seq([5, 6, 7]))) == 1
    manager.free(filler)
    assert_idle(manager)


def test_a_chain_tail_is_evicted_before_its_head():
    manager = BlockManager(3, block_size=2)
    manager.free(computed(manager, [1, 2, 3, 4, 5]))  # two cached blocks: head [1, 2], tail [3, 4]
    manager.allocate(make_seq([9, 9], name="x"), 2)  # takes the never-used block
    manager.allocate(make_seq([8, 8], name="y"), 2)  # must evict one: the tail
    assert len(manager.match_prefix(make_seq([1, 2, 3, 4, 5]))) == 1


def test_reviving_an_evictable_hit_costs_a_free_block():
    manager = BlockManager(4, block_size=2)
    manager.free(computed(manager, [1, 2, 3, 4, 5]))
    seq = make_seq([1, 2, 3, 4, 6])
    assert manager.blocks_needed(seq, 5) == 3  # 2 revived hits + 1 new block
    manager.allocate(seq, 5)
    assert manager.num_free_blocks == 1 and seq.num_computed_tokens == 4


def test_different_salts_and_namespaces_never_share():
    manager = BlockManager(16, block_size=4)
    computed(manager, list(range(9)), salt="tenant-a")
    assert manager.match_prefix(make_seq(list(range(9)), salt="tenant-b")) == []
    assert len(manager.match_prefix(make_seq(list(range(9)), salt="tenant-a"))) == 2
    other_model = BlockManager(16, block_size=4, namespace=b"another model")
    assert manager.prefix_hash(make_seq(list(range(9))), 2) != other_model.prefix_hash(
        make_seq(list(range(9))), 2
    )


def test_a_hash_collision_is_refused_by_token_comparison(monkeypatch):
    monkeypatch.setattr(bm_module, "chain_hash", lambda parent, tokens: b"same for every block")
    manager = BlockManager(16, block_size=4)
    computed(manager, [1, 2, 3, 4, 5])
    impostor = make_seq([9, 9, 9, 9, 5])
    manager.allocate(impostor, 5)
    assert impostor.num_computed_tokens == 0, "a block with other tokens must never be served"


def test_caching_off_never_matches_and_frees_plainly():
    manager = BlockManager(8, block_size=4, enable_caching=False)
    manager.free(computed(manager, list(range(9))))
    seq = make_seq(list(range(9)))
    manager.allocate(seq, 9)
    assert seq.num_computed_tokens == 0 and manager.num_cached_blocks == 0


def test_identical_prompts_computed_side_by_side_register_one_copy():
    manager = BlockManager(8, block_size=4)
    a, b = make_seq(list(range(9)), name="a"), make_seq(list(range(9)), name="b")
    manager.allocate(a, 9)
    manager.allocate(b, 9)  # admitted in the same step: nothing cached yet
    for seq in (a, b):
        seq.num_computed_tokens = 9
        manager.commit(seq)
    assert manager.num_cached_blocks == 2
    assert manager.match_prefix(make_seq(list(range(9)))) == a.block_table[:2]
    manager.free(a)
    manager.free(b)
    assert_idle(manager)


def test_a_prompt_admitted_beside_its_twin_catches_up_on_the_blocks_the_twin_computed():
    manager = BlockManager(16, block_size=4)
    shared = list(range(100, 112))
    first, second = make_seq([*shared, 1, 2], name="a"), make_seq([*shared, 3, 4, 5], name="b")
    for seq in (first, second):  # admitted together: nothing is cached yet
        manager.allocate(seq, seq.num_tokens)
    assert manager.catch_up_prefix(second) == 0 and manager.num_free_blocks == 16 - 4 - 4
    first.num_computed_tokens = 8  # a first chunk of two blocks, registered
    manager.commit(first)
    fresh = list(second.block_table)
    assert manager.catch_up_prefix(second) == 8
    assert second.block_table[:2] == first.block_table[:2] and second.block_table[2:] == fresh[2:]
    assert (second.num_computed_tokens, second.num_cached_tokens, second.num_committed_blocks) == (8, 8, 2)
    assert manager.num_free_blocks == 16 - 4 - 2, "the two unwritten blocks went back to the pool"
    assert [manager.refcount(b) for b in first.block_table[:2]] == [2, 2]
    first.num_computed_tokens = first.num_tokens
    manager.commit(first)
    assert manager.catch_up_prefix(second) == 4, "the third shared block, once computed"
    second.num_computed_tokens += 2  # `second` computed tokens of its own: nothing more to take
    assert manager.catch_up_prefix(second) == 0
    for seq in (first, second):
        manager.free(seq)
    assert manager.num_free_blocks == manager.num_blocks


def test_fork_shares_full_computed_blocks_by_reference():
    manager = BlockManager(8, block_size=4, enable_caching=False)
    parent = computed(manager, list(range(10)), name="parent")
    child = make_seq(list(range(10)), name="child")
    manager.fork(parent, child)
    assert child.block_table == parent.block_table[:2] and child.num_computed_tokens == 8
    manager.grow(child.block_table, child.num_tokens)
    assert [manager.refcount(b) for b in parent.block_table] == [2, 2, 1]
    manager.free(parent)
    assert [manager.refcount(b) for b in child.block_table] == [1, 1, 1]
    manager.free(child)
    assert_idle(manager)
    with pytest.raises(ValueError, match="does not start with"):
        manager.fork(computed(manager, list(range(10))), make_seq([7] * 10, name="stranger"))


def test_block_table_is_group_zeros_table():
    seq = make_seq(list(range(5)))
    assert seq.block_tables == [[]] and seq.block_table is seq.block_tables[0]
    seq.block_table = [3, 4]
    assert seq.block_tables == [[3, 4]]


def test_extend_grows_without_matching_the_prefix_cache():
    manager = BlockManager(8, block_size=4)
    manager.free(computed(manager, list(range(9))))
    seq = make_seq(list(range(9)))
    manager.extend(seq, 5)
    assert seq.num_computed_tokens == 0 and manager.num_queried_tokens == 9, "no lookup, no hit"
    assert manager.num_held_blocks(seq) == 2
    with pytest.raises(OutOfBlocksError):
        manager.extend(seq, 37)
    assert manager.num_held_blocks(seq) == 2, "a failed extension takes nothing"
    manager.free(seq)
    assert_idle(manager)
