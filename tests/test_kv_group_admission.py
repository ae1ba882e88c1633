"""Admission for chunked prefill with sliding-window KV groups: a prompt reserves, per sliding group, only
the most blocks a chunk and its window can hold (full groups: the whole prompt), takes them chunk by
chunk, never runs out mid-prompt, and gives every block back on finish, abort and preemption. A pool that
fits that peak but not the whole prompt serves it on the prefill tier, the decode tier's aggregated path
and `Engine.generate`, with Hugging Face's greedy tokens; and the figure on Gemma 3 270M's layout."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from conftest import engine_for, hf_greedy, random_prompts
from test_kv_groups import BS, GEMMA3_270M_WINDOWS, LAYOUT, WINDOW, greedy, make_seq, windowed_hf_model

from decode_service.config import DecodeServiceConfig
from decode_service.engine_core.engine_loop import EngineLoop
from decode_service.engine_core.policies import make_policy
from decode_service.engine_core.request import ServedRequest, StreamDelta
from decode_service.engine_core.scheduler import ContinuousScheduler
from engine.block_manager import BlockManager
from engine.config import CacheConfig
from engine.kv_layout import NULL_BLOCK, KVLayout
from engine.params import SamplingParams, StoppingParams
from prefill_service.job import PrefillFinished, PrefillJob
from prefill_service.scheduler import ChunkedPrefillScheduler
from serving.event_log import EventLog

CHUNK = 8
PROMPT_LEN = 61
# Full group: ceil(61 / 4) = 16 blocks; each of the 3 sliding groups at most ceil((3 + 8 + 8 + 1) / 4) = 5:
# 31 blocks at admission, where the whole prompt in every group is 64.
PEAK_POOL = 34


def physical_free(manager: BlockManager) -> int:
    """Blocks in the pool nobody references, reserved or not."""
    return sum(1 for block in range(manager.num_blocks) if manager.refcount(block) == 0)


def prefill_in_chunks(manager: BlockManager, seq, chunk: int, margin: int, peaks: list[int]) -> None:
    """What a scheduler and `Engine.step` do: grow by a chunk, compute, commit, release what slid out."""
    while seq.num_uncomputed_tokens:
        take = min(chunk, seq.num_uncomputed_tokens)
        manager.allocate(seq, seq.num_computed_tokens + take + margin)
        peaks.append(manager.num_held_blocks(seq))
        assert 0 <= manager.num_free_blocks <= physical_free(manager)
        seq.num_computed_tokens += take
        manager.commit(seq)
        manager.release_slid_out(seq)


def test_admission_reserves_each_sliding_groups_peak_and_takes_it_chunk_by_chunk():
    manager = BlockManager(PEAK_POOL, BS, layout=LAYOUT)
    seq = make_seq(list(range(PROMPT_LEN)))
    assert manager.blocks_needed(seq, PROMPT_LEN + 1) == 64 > PEAK_POOL
    assert manager.admission_blocks(seq, PROMPT_LEN + 1, CHUNK) == 31
    manager.admit(seq, PROMPT_LEN + 1, CHUNK)
    assert manager.num_free_blocks == PEAK_POOL - 31
    assert len(seq.block_tables[0]) == 16 and all(len(t) == 2 for t in seq.block_tables[1:])
    peaks: list[int] = []
    prefill_in_chunks(manager, seq, CHUNK, 1, peaks)
    assert max(peaks) <= 31
    # The last chunk grew every table to the admission's target; the reservation ended with the prompt.
    assert {len(t) for t in seq.block_tables} == {16}
    assert manager.num_free_blocks == physical_free(manager) == PEAK_POOL - manager.num_held_blocks(seq)
    manager.free(seq)
    assert manager.num_free_blocks == physical_free(manager) == PEAK_POOL


@pytest.mark.parametrize("ending", ["abort_mid_prompt", "finish", "preempt_and_readmit"])
def test_every_block_comes_back(ending):
    manager = BlockManager(64, BS, layout=LAYOUT)
    start = manager.num_free_blocks
    seq = make_seq(list(range(PROMPT_LEN)))
    manager.admit(seq, PROMPT_LEN, CHUNK)
    if ending == "abort_mid_prompt":
        manager.allocate(seq, CHUNK * 3)
        seq.num_computed_tokens = CHUNK * 3
        manager.commit(seq)
        manager.release_slid_out(seq)
    else:
        prefill_in_chunks(manager, seq, CHUNK, 0, [])
        seq.append_token(5, (), 1000)
        manager.allocate(seq, seq.num_tokens)
    if ending == "preempt_and_readmit":
        manager.free(seq)
        assert manager.num_free_blocks == start
        manager.admit(seq, seq.num_tokens, CHUNK)  # the history is a prefix hit now
        assert seq.num_cached_tokens > WINDOW
        prefill_in_chunks(manager, seq, CHUNK, 0, [])
    manager.free(seq)
    assert manager.num_free_blocks == physical_free(manager) == start


@pytest.mark.parametrize("seed", range(6))
def test_concurrent_prompts_sharing_prefixes_never_run_out_mid_prompt(seed):
    # Prompts share leading tokens and arrive while others are half way, so prefix hits take references
    # to blocks another prompt's reservation owns; every admitted prompt must still finish its chunks.
    rng = random.Random(seed)
    manager = BlockManager(48, BS, layout=LAYOUT, order=rng.sample(range(48), 48))
    base = [rng.randrange(50) for _ in range(80)]
    pending = [
        base[: rng.randint(20, 80)] + [rng.randrange(50) for _ in range(rng.randint(1, 9))] for _ in range(8)
    ]
    live: list = []
    done = 0
    while pending or live:
        if pending:
            seq = make_seq(pending[0], f"r{len(pending)}")
            if manager.can_admit(seq, seq.num_tokens, CHUNK):
                manager.admit(seq, seq.num_tokens, CHUNK)
                pending.pop(0)
                live.append(seq)
        assert live, "an idle pool must admit the next prompt"
        for seq in list(live):
            take = min(rng.randint(1, CHUNK), seq.num_uncomputed_tokens)
            manager.allocate(seq, seq.num_computed_tokens + take)
            assert 0 <= manager.num_free_blocks <= physical_free(manager)
            seq.num_computed_tokens += take
            manager.commit(seq)
            manager.release_slid_out(seq)
            if not seq.num_uncomputed_tokens:
                live.remove(seq)
                manager.free(seq)
                done += 1
    assert done == 8
    assert manager.num_free_blocks == physical_free(manager) == 48


def test_kv_from_elsewhere_takes_the_last_window_from_the_reservation():
    manager = BlockManager(PEAK_POOL, BS, layout=LAYOUT, enable_caching=False)
    seq = make_seq(list(range(PROMPT_LEN)))
    manager.admit(seq, PROMPT_LEN, CHUNK)
    manager.release_unread(seq, PROMPT_LEN)
    # Position 61 reads 54..61: blocks 13..15 of each sliding group, all there to be written.
    for table in seq.block_tables[1:]:
        assert table[:13] == [NULL_BLOCK] * 13 and len(table) == 16 and NULL_BLOCK not in table[13:]
    assert manager.num_free_blocks == physical_free(manager) == PEAK_POOL - 16 - 3 * 3
    manager.free(seq)
    assert manager.num_free_blocks == PEAK_POOL


def test_one_group_layouts_admit_as_allocate_does():
    manager = BlockManager(32, BS)
    seq = make_seq(list(range(PROMPT_LEN)))
    assert manager.admission_blocks(seq, PROMPT_LEN, CHUNK) == manager.blocks_needed(seq, PROMPT_LEN) == 16
    manager.admit(seq, PROMPT_LEN, CHUNK)
    assert len(seq.block_table) == 16 and manager.num_free_blocks == 16


# -- the figure: Gemma 3 270M's layout, a 4,000-token prompt in 512-token chunks --------------------------


def peak_kv_bytes(
    windows: tuple[int | None, ...], prompt_len: int = 4000, chunk: int = 512
) -> tuple[int, int, int]:
    """Blocks reserved at admission, most blocks held while prefilling, and the bytes of one block (bf16)."""
    layout = KVLayout.from_layer_windows(windows)
    model = SimpleNamespace(head_dim=256, num_kv_heads=1, kv_layout=layout)
    block_bytes = CacheConfig(block_size=16).block_bytes(model, torch.bfloat16)
    manager = BlockManager(4096, 16, enable_caching=False, layout=layout)
    seq = make_seq([7] * prompt_len)
    reserved = manager.admission_blocks(seq, prompt_len, chunk)
    manager.admit(seq, prompt_len, chunk)
    assert manager.num_blocks - manager.num_free_blocks == reserved
    peaks: list[int] = []
    while seq.num_uncomputed_tokens:
        take = min(chunk, seq.num_uncomputed_tokens)
        manager.allocate(seq, seq.num_computed_tokens + take)
        peaks.append(manager.num_held_blocks(seq))
        assert manager.num_blocks - manager.num_free_blocks == max(reserved, peaks[-1])
        seq.num_computed_tokens += take
        manager.release_slid_out(seq)
    manager.free(seq)
    assert manager.num_free_blocks == manager.num_blocks
    return reserved, max(peaks), block_bytes


def test_gemma3_270m_reserves_and_holds_at_most_0_4x_of_full_attention_while_prefilling():
    reserved, peak, block_bytes = peak_kv_bytes(GEMMA3_270M_WINDOWS)
    full_reserved, full_peak, full_block_bytes = peak_kv_bytes((None,) * 18)
    # 250 full-group blocks plus 5 sliding groups of ceil((15 + 512 + 512) / 16) = 65: 575 of 3 layers,
    # where the whole prompt in every group was 1,500 (1.0x); 250 blocks of 18 layers at full attention.
    assert (reserved, full_reserved, full_peak) == (250 + 5 * 65, 250, 250)
    assert peak <= reserved
    ratio = reserved * block_bytes / (full_reserved * full_block_bytes)
    assert round(ratio, 3) == 0.383
    assert peak * block_bytes / (full_peak * full_block_bytes) <= ratio


# -- the tiers, on a tiny windowed model whose pool fits the peak but not the whole prompt ----------------

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def hybrid_model():
    return windowed_hf_model("qwen2", 3)


def long_prompts(count: int) -> list[list[int]]:
    return random_prompts(count, 17, min_len=PROMPT_LEN - 4, max_len=PROMPT_LEN)


def test_engine_generate_admits_a_prompt_that_fits_only_at_its_peak(hybrid_model):
    engine = engine_for(hybrid_model, block_size=BS, num_blocks=PEAK_POOL, shuffle_seed=4)
    assert engine.model_config.kv_layout == LAYOUT
    prompts = long_prompts(2)
    seqs = engine.generate([greedy(p, 6) for p in prompts], max_num_batched_tokens=CHUNK, max_num_seqs=2)
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.output_token_ids == hf_greedy(hybrid_model, prompt, 6)
    assert engine.num_free_blocks == PEAK_POOL


def test_engine_generate_decodes_more_prompts_than_their_growth_fits_at_once(hybrid_model):
    """Peak-sized admission lets in more prompts than the pool holds once they all decode and grow their
    full group: a decode whose next block is not free waits for a finishing sequence (it used to raise
    OutOfBlocksError, as on Gemma 3 270M with 12 prompts)."""
    pool = 58
    engine = engine_for(hybrid_model, block_size=BS, num_blocks=pool, shuffle_seed=5)
    prompts = long_prompts(3)
    seqs = engine.generate([greedy(p, 24) for p in prompts], max_num_batched_tokens=CHUNK, max_num_seqs=3)
    for prompt, seq in zip(prompts, seqs, strict=True):
        assert seq.output_token_ids == hf_greedy(hybrid_model, prompt, 24)
    assert engine.num_free_blocks == pool


def test_prefill_tier_admits_a_prompt_that_fits_only_at_its_peak(hybrid_model):
    engine = engine_for(hybrid_model, block_size=BS, num_blocks=PEAK_POOL, shuffle_seed=5)
    scheduler = ChunkedPrefillScheduler(engine, CHUNK, 4)
    prompts = long_prompts(2)
    jobs = []
    for i, prompt in enumerate(prompts):
        stopping = StoppingParams(max_tokens=1, ignore_eos=True)
        jobs.append(PrefillJob(engine.make_sequence(prompt, GREEDY, stopping, f"p{i}"), arrival_time=0.0))
        scheduler.add(jobs[-1])
    first_tokens = {}
    for _ in range(100):
        if not scheduler.can_step():
            break
        plan = scheduler.schedule()
        for job, event in scheduler.complete_step(plan, engine.step(plan.chunks), None):
            if isinstance(event, PrefillFinished):
                first_tokens[job.key] = event.token_id
                scheduler.release(job)
    assert not scheduler.has_work
    assert [first_tokens[job.key] for job in jobs] == [hf_greedy(hybrid_model, p, 1)[0] for p in prompts]
    assert engine.num_free_blocks == PEAK_POOL


def test_decode_tier_aggregated_admits_a_prompt_that_fits_only_at_its_peak(hybrid_model):
    engine = engine_for(
        hybrid_model,
        block_size=BS,
        num_blocks=PEAK_POOL,
        shuffle_seed=6,
        max_num_seqs=2,
        max_num_batched_tokens=CHUNK,
    )
    config = DecodeServiceConfig()
    scheduler = ContinuousScheduler(engine, make_policy("fifo", {}, 0.0), config.scheduler)
    tokens: dict[str, list[int]] = {}

    def deliver(deltas: list[StreamDelta]) -> None:
        for delta in deltas:
            assert delta.error is None, delta.error
            tokens.setdefault(delta.request.request_id, []).extend(delta.token_ids)

    loop = EngineLoop(engine, scheduler, deliver, EventLog(10_000))
    prompts = long_prompts(2)
    for i, prompt in enumerate(prompts):
        stopping = StoppingParams(max_tokens=6, ignore_eos=True)
        loop.submit(ServedRequest(engine.make_sequence(prompt, GREEDY, stopping, f"d{i}")))
    loop.run_until_idle(max_steps=300)
    assert not scheduler.has_work
    assert [tokens.get(f"d{i}") for i in range(2)] == [hf_greedy(hybrid_model, p, 6) for p in prompts]
    assert engine.num_free_blocks == PEAK_POOL
