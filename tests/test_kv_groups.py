"""KV groups: one block table per group, sliding blocks released as they leave the window, exact
accounting through finish, abort, preemption and forks, prefix hits that respect the window, the
sliding-window saving on Gemma 3 270M's layout, and the engine's greedy output on tiny windowed models
equal to Hugging Face's."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY_VOCAB, engine_for, hf_greedy, random_prompts
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

from engine.block_manager import BlockManager
from engine.config import CacheConfig
from engine.engine import Engine, GenerateRequest
from engine.kv_layout import NULL_BLOCK, KVLayout, first_visible_block
from engine.model_runner import ScheduledChunk
from engine.params import SamplingParams, StoppingParams
from engine.sequence import Sequence

BS = 4
WINDOW = 8
# Layers 0, 1, 3 slide over 8 tokens, layer 2 attends globally: four one-layer groups, the full one first.
LAYOUT = KVLayout.from_layer_windows((WINDOW, WINDOW, None, WINDOW))


def make_manager(num_blocks: int = 96, **kwargs) -> BlockManager:
    return BlockManager(num_blocks, BS, layout=LAYOUT, **kwargs)


def make_seq(tokens: list[int], name: str = "r") -> Sequence:
    return Sequence(name, tokens, SamplingParams(), StoppingParams())


def run_chunk(manager: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """What the scheduler and `Engine.step` do for one chunk: grow the tables, compute, commit, release."""
    manager.allocate(seq, seq.num_computed_tokens + num_tokens)
    seq.num_computed_tokens += num_tokens
    manager.commit(seq)
    manager.release_slid_out(seq)


def prefill(manager: BlockManager, seq: Sequence, chunk: int = 5) -> None:
    manager.allocate(seq, seq.num_tokens)
    while seq.num_uncomputed_tokens:
        run_chunk(manager, seq, min(chunk, seq.num_uncomputed_tokens))


def check_invariants(manager: BlockManager, live: list[Sequence]) -> None:
    """Every reference is accounted for, no block is in two groups, tables are a NULL run then blocks."""
    counts: dict[int, int] = {}
    group_of: dict[int, int] = {}
    for seq in live:
        tables = seq.block_tables
        assert len({len(t) for t in tables}) == 1, "all of a sequence's tables cover the same blocks"
        for group, table in enumerate(tables):
            held = [b for b in table if b != NULL_BLOCK]
            assert table[len(table) - len(held) :] == held, "NULL entries only below the held blocks"
            for block in held:
                counts[block] = counts.get(block, 0) + 1
                assert group_of.setdefault(block, group) == group, f"block {block} in two groups"
            if LAYOUT.groups[group].is_sliding:
                first = manager.first_kept_block(group, seq.num_computed_tokens)
                assert all(b == NULL_BLOCK for b in table[:first]), "a slid-out block is still held"
    for block in range(manager.num_blocks):
        assert manager.refcount(block) == counts.get(block, 0)
    assert manager.num_free_blocks == manager.num_blocks - len(counts)


def assert_idle(manager: BlockManager) -> None:
    assert all(manager.refcount(b) == 0 for b in range(manager.num_blocks))
    assert manager.num_free_blocks == manager.num_blocks and manager.usage == 0.0


def test_layout_and_visible_blocks():
    assert [g.window for g in LAYOUT.groups] == [None, WINDOW, WINDOW, WINDOW]
    assert LAYOUT.num_slots == 1
    # A query at p reads p - 7 .. p: at 7 block 0 still, at 8 no longer.
    assert first_visible_block(7, WINDOW, BS) == 0
    assert first_visible_block(8, WINDOW, BS) == 0 and first_visible_block(11, WINDOW, BS) == 1
    assert first_visible_block(12, WINDOW, BS) == 1 and first_visible_block(1000, None, BS) == 0


def test_a_sliding_group_holds_only_its_window_and_releases_in_the_same_step():
    manager = make_manager(enable_caching=False)
    seq = make_seq(list(range(30)))
    manager.allocate(seq, 30)
    assert manager.num_held_blocks(seq) == 4 * 8, "admission reserves the whole prompt in every group"
    run_chunk(manager, seq, 30)
    full, *sliding = seq.block_tables
    assert NULL_BLOCK not in full and len(full) == 8
    # Last computed position 29 reads 22..29: blocks 5..7.
    for table in sliding:
        assert table[:5] == [NULL_BLOCK] * 5 and NULL_BLOCK not in table[5:] and len(table) == 8
    assert manager.num_held_blocks(seq) == 8 + 3 * 3
    assert manager.num_free_blocks == manager.num_blocks - 17
    peak = 0
    for token in range(40):  # decoding: each sliding group never holds more than ceil(8 / 4) + 1
        seq.token_ids.append(token)
        run_chunk(manager, seq, 1)
        for table in seq.block_tables[1:]:
            peak = max(peak, len(table) - table.count(NULL_BLOCK))
        check_invariants(manager, [seq])
    assert peak == 3
    manager.free(seq)
    assert_idle(manager)


def test_chunked_prefill_holds_at_most_a_window_plus_a_chunk():
    manager = make_manager(enable_caching=False)
    seq = make_seq(list(range(64)))
    held = []
    while seq.num_uncomputed_tokens:
        run_chunk(manager, seq, min(8, seq.num_uncomputed_tokens))
        held.append(manager.num_held_blocks(seq) - len(seq.block_tables[0]))
        check_invariants(manager, [seq])
    assert max(held) <= 3 * 3
    manager.free(seq)
    assert_idle(manager)


def test_kv_that_arrives_from_elsewhere_reserves_only_the_last_window():
    manager = make_manager()
    seq = make_seq(list(range(40)))
    assert manager.blocks_needed(seq, 40, reads_from=39) == 10 + 3 * 2
    manager.allocate(seq, 40, reads_from=39)
    for table in seq.block_tables[1:]:
        assert table[:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in table[8:]
    seq.num_computed_tokens = 40  # the transfer wrote the blocks
    manager.commit(seq)
    manager.release_slid_out(seq)
    check_invariants(manager, [seq])
    manager.free(seq)
    assert_idle(manager)


def test_no_leak_through_finish_abort_preemption_and_forks():
    manager = make_manager(num_blocks=80)
    rng = random.Random(7)
    prefix = [rng.randrange(50) for _ in range(24)]
    live: list[Sequence] = []
    waiting: list[Sequence] = []
    preempted = forked = 0
    for round_ in range(300):
        if rng.random() < 0.3:
            tokens = prefix[: rng.randint(0, 24)] + [rng.randrange(50) for _ in range(rng.randint(1, 20))]
            waiting.append(make_seq(tokens, name=f"r{round_}"))
        if waiting and manager.can_allocate(waiting[0], waiting[0].num_tokens):
            seq = waiting.pop(0)
            manager.allocate(seq, seq.num_tokens)
            live.append(seq)
        for seq in list(live):
            take = min(seq.num_uncomputed_tokens, rng.randint(1, 9))
            if not manager.can_allocate(seq, seq.num_computed_tokens + take):
                manager.free(seq)  # preempted: recomputed from its cached prefix when readmitted
                live.remove(seq)
                waiting.append(seq)
                preempted += 1
                continue
            run_chunk(manager, seq, take)
            if not seq.num_uncomputed_tokens:
                seq.token_ids.append(rng.randrange(50))
        forkable = [s for s in live if s.num_computed_tokens == s.num_tokens - 1]
        if forkable and rng.random() < 0.2 and manager.num_free_blocks > 16:
            parent = forkable[0]
            child = make_seq(parent.token_ids[:-1], name=parent.request_id + "-fork")
            last = child.num_tokens - 1
            manager.fork(parent, child, reads_from=last)
            manager.extend(child, (last // BS) * BS + 1)
            child.num_computed_tokens = last
            live.append(child)
            forked += 1
        for seq in [s for s in live if s.num_tokens > 45 or rng.random() < 0.05]:
            live.remove(seq)  # finished or aborted
            manager.free(seq)
        check_invariants(manager, live)
    for seq in live:
        manager.free(seq)
    assert manager.num_hit_tokens > 0 and preempted > 0 and forked > 0
    assert_idle(manager)


def test_fork_shares_the_window_the_choice_reads():
    manager = make_manager()
    parent = make_seq(list(range(30)), name="parent")
    prefill(manager, parent)
    child = make_seq(list(range(30)), name="child")
    manager.fork(parent, child, reads_from=29)
    manager.extend(child, 29 + 1)
    child.num_computed_tokens = 29
    full, *sliding = child.block_tables
    assert full[:7] == parent.block_tables[0][:7]
    for table, parent_table in zip(sliding, parent.block_tables[1:], strict=True):
        assert table[:5] == [NULL_BLOCK] * 5 and table[5:7] == parent_table[5:7]
        assert table[7] not in (NULL_BLOCK, parent_table[7]), "the last prompt block is the child's own"
    check_invariants(manager, [parent, child])
    manager.free(parent)
    manager.free(child)
    assert_idle(manager)


def test_a_fork_cannot_read_blocks_its_parent_released():
    manager = make_manager()
    parent = make_seq(list(range(30)), name="parent")
    prefill(manager, parent)
    for token in range(12):
        parent.token_ids.append(token)
        run_chunk(manager, parent, 1)
    with pytest.raises(ValueError, match="slid out"):
        manager.fork(parent, make_seq(list(range(30)), name="child"), reads_from=29)
    manager.free(parent)
    assert_idle(manager)


def test_a_prefix_hit_takes_the_full_prefix_and_the_last_window_only():
    manager = make_manager()
    first = make_seq(list(range(30)), name="first")
    prefill(manager, first)
    manager.free(first)
    again = make_seq(list(range(30)) + [77, 78, 79], name="again")
    manager.allocate(again, again.num_tokens)
    # 7 full blocks cached (28 tokens); the next query (at 28) reads 21..28, and 27 is the last computed.
    assert again.num_computed_tokens == 28 and again.num_cached_tokens == 28
    full, *sliding = again.block_tables
    assert all(b != NULL_BLOCK for b in full[:7])
    for table in sliding:
        assert table[:5] == [NULL_BLOCK] * 5 and NULL_BLOCK not in table[5:]
    check_invariants(manager, [again])
    manager.free(again)
    assert_idle(manager)


def test_a_hit_shrinks_to_where_every_sliding_group_holds_its_window():
    manager = make_manager()
    # Computed here from the start: every group registered blocks 0..4 (20 tokens).
    short = make_seq(list(range(20)) + [5], name="short")
    prefill(manager, short)
    manager.free(short)
    # KV that arrived from elsewhere: the full group registers blocks 0..9, sliding groups only 8..9.
    remote = make_seq(list(range(40)), name="remote")
    manager.allocate(remote, 40, reads_from=39)
    remote.num_computed_tokens = 40
    manager.commit(remote)
    manager.free(remote)
    hit_all = make_seq(list(range(40)) + [1], name="all")
    assert manager.cached_prefix_tokens(hit_all) == 40, "blocks 8..9 are the window before position 40"
    # Sharing 32 tokens: the full group has blocks 0..7, the sliding groups' last pair is 3..4.
    partial = make_seq(list(range(32)) + [99] * 10, name="partial")
    assert manager.cached_prefix_tokens(partial) == 20
    manager.allocate(partial, partial.num_tokens)
    assert partial.num_computed_tokens == 20
    for table in partial.block_tables[1:]:
        assert table[:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in table[3:]
    manager.free(partial)
    assert_idle(manager)


def test_groups_never_share_a_cached_block():
    manager = make_manager()
    seq = make_seq(list(range(13)))
    prefill(manager, seq)
    registered = [b for table in seq.block_tables for b in table if b != NULL_BLOCK]
    assert len(registered) == len(set(registered))
    # Three full blocks in the full group, and those still held or released in the sliding ones: all.
    assert manager.num_cached_blocks == 4 * 3
    manager.free(seq)
    assert_idle(manager)


def test_one_full_attention_group_is_unchanged():
    single = BlockManager(16, BS, layout=KVLayout.from_layer_windows((None, None)))
    plain = BlockManager(16, BS)
    for manager in (single, plain):
        seq = make_seq(list(range(10)))
        manager.allocate(seq, 10)
        assert len(seq.block_tables) == 1 and seq.block_table == [0, 1, 2]
        assert not manager.sliding


@pytest.mark.parametrize("last_block_in_use", [False, True])
def test_prompts_admitted_together_on_a_sliding_model_catch_up_past_the_window(last_block_in_use):
    """Every layer windowed (one sliding group): a prompt admitted beside another that shares more than a
    window takes the blocks the other computed, NULL below their last window, and never pool block -1."""
    manager = BlockManager(32, BS, layout=KVLayout.from_layer_windows((WINDOW, WINDOW)))
    holder = make_seq(list(range(500, 504)), name="holder")
    if last_block_in_use:
        manager.allocate(holder, 4)  # takes block 0; pin the pool's last block instead
        manager._free.rotate(1)
        manager.allocate(other := make_seq(list(range(600, 604)), name="other"), 4)
        assert other.block_table == [31]
    shared = list(range(100, 100 + 4 * BS))
    first, second = make_seq([*shared, 1], name="a"), make_seq([*shared, 2, 3], name="b")
    for seq in (first, second):  # admitted together: nothing is cached yet
        manager.allocate(seq, seq.num_tokens)
    prefill(manager, first)
    assert manager.catch_up_prefix(second) == 4 * BS
    held = [block for block in second.block_table if block != NULL_BLOCK]
    assert second.block_table[:2] == [NULL_BLOCK] * 2, "the blocks below the last window are not held"
    assert second.block_table[2:4] == first.block_table[2:4] and len(held) == 3
    live = [first, second] + ([holder, other] if last_block_in_use else [])
    check_invariants(manager, live)
    for seq in live:
        manager.free(seq)
    assert_idle(manager)


# -- the must-show figure: Gemma 3 270M's layout ----------------------------------------------------------

GEMMA3_270M_WINDOWS = tuple(None if (layer + 1) % 6 == 0 else 512 for layer in range(18))


def held_kv_bytes(layout: KVLayout, prompt_len: int, block_size: int = 16) -> tuple[int, int]:
    """Blocks and bytes a `prompt_len`-token prompt holds once prefilled (chunks of 512), bf16 KV."""
    model = SimpleNamespace(head_dim=256, num_kv_heads=1, kv_layout=layout)
    block_bytes = CacheConfig(block_size=block_size).block_bytes(model, torch.bfloat16)
    manager = BlockManager(4096, block_size, enable_caching=False, layout=layout)
    seq = make_seq([7] * prompt_len)
    manager.allocate(seq, prompt_len)
    while seq.num_uncomputed_tokens:
        run_chunk(manager, seq, min(512, seq.num_uncomputed_tokens))
    held = manager.num_held_blocks(seq)
    assert manager.num_free_blocks == manager.num_blocks - held
    return held, held * block_bytes


def test_gemma3_270m_holds_at_most_0_35x_the_kv_of_a_full_attention_layout():
    hybrid = KVLayout.from_layer_windows(GEMMA3_270M_WINDOWS)
    assert [len(g.layers) for g in hybrid.groups] == [3] * 6 and hybrid.num_slots == 3
    full = KVLayout.from_layer_windows((None,) * 18)
    hybrid_blocks, hybrid_bytes = held_kv_bytes(hybrid, 4000)
    full_blocks, full_bytes = held_kv_bytes(full, 4000)
    assert (hybrid_blocks, full_blocks) == (250 + 5 * 32, 250)
    ratio = hybrid_bytes / full_bytes
    assert ratio <= 0.35, ratio
    assert round(ratio, 3) == 0.273


# -- the engine on tiny windowed models, against Hugging Face -------------------------------------------

GREEDY = SamplingParams(temperature=0.0)


def windowed_hf_model(kind: str, seed: int) -> torch.nn.Module:
    """4 layers, window 8: Qwen2 with layers 0, 1, 3 sliding and 2 global (four KV groups), or Mistral
    sliding everywhere (one sliding group)."""
    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        initializer_range=0.08,
        sliding_window=WINDOW,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    if kind == "qwen2":
        types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
        cfg = Qwen2Config(**common, use_sliding_window=True, layer_types=types)
    else:
        cfg = MistralConfig(**common)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def hybrid_model():
    return windowed_hf_model("qwen2", 3)


def greedy(prompt: list[int], max_tokens: int) -> GenerateRequest:
    return GenerateRequest(prompt, GREEDY, StoppingParams(max_tokens=max_tokens, ignore_eos=True))


def assert_engine_idle(engine: Engine) -> None:
    assert_idle(engine.block_manager)


@pytest.mark.parametrize("caching", [True, False])
def test_engine_matches_hf_on_a_hybrid_model_with_prompts_longer_than_the_window(hybrid_model, caching):
    # Two at a time (the driver never preempts) in a pool the five prompts cycle through, so released
    # blocks are written again by later sequences.
    engine = engine_for(
        hybrid_model, block_size=BS, num_blocks=128, shuffle_seed=1, enable_prefix_caching=caching
    )
    assert engine.model_config.kv_layout == LAYOUT
    prompts = random_prompts(5, 3, min_len=10, max_len=40)
    seqs = engine.generate([greedy(p, 12) for p in prompts], max_num_batched_tokens=16, max_num_seqs=2)
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.output_token_ids == hf_greedy(hybrid_model, prompt, 12)
    assert_engine_idle(engine)


def test_engine_multi_turn_hits_with_a_window_and_stays_exact(hybrid_model):
    engine = engine_for(hybrid_model, block_size=BS, num_blocks=96, shuffle_seed=2)
    rng = random.Random(9)
    history = [rng.randrange(TINY_VOCAB) for _ in range(20)]
    for _ in range(3):
        history += [rng.randrange(TINY_VOCAB) for _ in range(rng.randint(3, 9))]
        (seq,) = engine.generate([greedy(history, 8)], max_num_batched_tokens=16)
        assert seq.output_token_ids == hf_greedy(hybrid_model, history, 8)
        history += seq.output_token_ids
    assert seq.num_cached_tokens > WINDOW, "the last turn reused the history past a window"
    assert_engine_idle(engine)


def test_engine_releases_slid_out_blocks_in_the_step_that_computes_past_them(hybrid_model):
    engine = engine_for(hybrid_model, block_size=BS, num_blocks=96, enable_prefix_caching=False)
    seq = engine.make_sequence(random_prompts(1, 4, 30, 30)[0], GREEDY, StoppingParams(max_tokens=9))
    engine.allocate(seq, seq.num_tokens)
    engine.step([ScheduledChunk(seq, 20)])
    for table in seq.block_tables[1:]:  # last computed position 19 reads 12..19: blocks 3 and 4
        assert table[:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in table[3:]
    while not seq.is_finished:
        engine.allocate(seq, seq.num_tokens)
        engine.step([ScheduledChunk(seq, seq.num_uncomputed_tokens)])
        assert engine.block_manager.num_held_blocks(seq) <= len(seq.block_table) + 3 * 3
    engine.free(seq)
    assert_engine_idle(engine)


def test_forked_choices_share_the_window_and_decode_like_their_parent(hybrid_model):
    engine = engine_for(hybrid_model, block_size=BS, num_blocks=96, shuffle_seed=5)
    prompt = random_prompts(1, 6, 27, 27)[0]
    parent = engine.make_sequence(prompt, GREEDY, StoppingParams(max_tokens=10, ignore_eos=True))
    engine.allocate(parent, parent.num_tokens)
    engine.step([ScheduledChunk(parent, parent.num_tokens)])
    children = [engine.fork(parent, GREEDY, share_kv=True) for _ in range(2)]
    live = [parent, *children]
    while live:
        for seq in live:
            engine.allocate(seq, seq.num_tokens)
        for out in engine.step([ScheduledChunk(s, s.num_uncomputed_tokens) for s in live]):
            if out.finish_reason is not None:
                live.remove(out.seq)
                engine.free(out.seq)
    expected = hf_greedy(hybrid_model, prompt, 10)
    assert parent.output_token_ids == expected
    assert [c.output_token_ids for c in children] == [expected, expected]
    assert_engine_idle(engine)


def test_engine_matches_hf_when_every_layer_slides():
    hf_model = windowed_hf_model("mistral", 4)
    engine = engine_for(hf_model, block_size=BS, num_blocks=24, shuffle_seed=3)
    assert engine.model_config.kv_layout.num_groups == 1 and engine.block_manager.sliding
    prompts = random_prompts(4, 5, min_len=12, max_len=30)
    seqs = engine.generate([greedy(p, 10) for p in prompts], max_num_batched_tokens=16, max_num_seqs=2)
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.output_token_ids == hf_greedy(hf_model, prompt, 10)
    assert_engine_idle(engine)
