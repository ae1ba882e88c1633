"""Automatic prefix caching in the engine: greedy outputs identical with the cache on and off and equal to
Hugging Face, on a multi-turn chat (history resent every turn), on a batch sharing a long prefix admitted
in the same step, under eviction pressure, across a preemption, and with no reference leaked."""

from __future__ import annotations

import random

import pytest
from conftest import engine_for, hf_greedy, random_prompts, tiny_hf_model

from engine.engine import Engine, GenerateRequest
from engine.model_runner import ScheduledChunk
from engine.params import SamplingParams, StoppingParams

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model(21)


def greedy(prompt: list[int], max_tokens: int, salt: str = "") -> GenerateRequest:
    return GenerateRequest(prompt, GREEDY, StoppingParams(max_tokens=max_tokens, ignore_eos=True), salt)


def assert_idle(engine: Engine) -> None:
    """Every reference returned: refcounts all 0, the whole pool free, usage 0."""
    manager = engine.block_manager
    assert [b for b in range(manager.num_blocks) if manager.refcount(b)] == []
    assert manager.num_free_blocks == manager.num_blocks and manager.usage == 0.0


def chat(engine: Engine, system: list[int], users: list[list[list[int]]], reply_len: int) -> list[list[int]]:
    """C conversations x T turns, each turn resending the whole history; returns every reply in order."""
    histories = [list(system) for _ in users]
    replies = []
    for turn in range(len(users[0])):
        for history, conversation in zip(histories, users, strict=True):
            history.extend(conversation[turn])
        seqs = engine.generate([greedy(h, reply_len) for h in histories], max_num_batched_tokens=48)
        for history, seq in zip(histories, seqs, strict=True):
            replies.append(seq.output_token_ids)
            history.extend(seq.output_token_ids)
    return replies


def test_multi_turn_chat_is_identical_with_the_cache_on_and_off_and_equal_to_hf(hf_model):
    rng = random.Random(5)
    system = [rng.randrange(384) for _ in range(45)]
    users = [[[rng.randrange(384) for _ in range(rng.randint(3, 9))] for _ in range(3)] for _ in range(3)]
    on = engine_for(hf_model, block_size=8, num_blocks=128, shuffle_seed=1)
    off = engine_for(hf_model, block_size=8, num_blocks=128, shuffle_seed=1, enable_prefix_caching=False)
    replies = chat(on, system, users, reply_len=6)
    assert replies == chat(off, system, users, reply_len=6)
    assert on.block_manager.num_hit_tokens > 0 and off.block_manager.num_hit_tokens == 0
    histories = [list(system) for _ in users]
    expected = []
    for turn in range(3):
        for c, history in enumerate(histories):
            history.extend(users[c][turn])
            expected.append(hf_greedy(hf_model, history, 6))
            history.extend(expected[-1])
    assert replies == expected
    assert_idle(on)
    assert_idle(off)


def test_a_batch_sharing_a_long_prefix_admitted_in_one_step_matches_hf(hf_model):
    prefix = random_prompts(1, 7, min_len=60, max_len=60)[0]
    prompts = [prefix + tail for tail in random_prompts(6, 8, min_len=1, max_len=12)]
    engine = engine_for(hf_model, block_size=8, num_blocks=96, shuffle_seed=2)
    first = engine.generate([greedy(p, 8) for p in prompts], max_num_batched_tokens=512)
    assert engine.block_manager.num_hit_tokens == 0, "admitted together, nothing was cached yet"
    second = engine.generate([greedy(p, 8) for p in prompts], max_num_batched_tokens=512)
    assert engine.block_manager.num_hit_tokens >= 6 * 56
    for prompt, a, b in zip(prompts, first, second, strict=True):
        assert a.output_token_ids == b.output_token_ids == hf_greedy(hf_model, prompt, 8)
        assert b.num_cached_tokens == (len(prompt) - 1) // 8 * 8
    assert_idle(engine)


def test_eviction_under_pressure_keeps_outputs_exact(hf_model):
    # 12 blocks of 8 tokens: every new prompt evicts what earlier ones left cached.
    engine = engine_for(hf_model, block_size=8, num_blocks=12, shuffle_seed=3)
    prompts = random_prompts(10, 9, min_len=30, max_len=50)
    prompts += [prompts[0], prompts[9]]  # one long evicted, one just cached
    for prompt in prompts:
        (seq,) = engine.generate([greedy(prompt, 5)])
        assert seq.output_token_ids == hf_greedy(hf_model, prompt, 5)
    assert prompts[-1] is prompts[9] and seq.num_cached_tokens > 0
    assert_idle(engine)


def test_a_preempted_sequence_recomputes_only_what_was_evicted(hf_model):
    engine = engine_for(hf_model, block_size=8, num_blocks=32, shuffle_seed=4)
    prompt = random_prompts(1, 10, min_len=29, max_len=29)[0]
    seq = engine.make_sequence(prompt, GREEDY, StoppingParams(max_tokens=12, ignore_eos=True))
    manager = engine.block_manager
    manager.allocate(seq, seq.num_tokens)
    while seq.num_output_tokens < 6:
        manager.grow(seq.block_table, seq.num_tokens)
        engine.step([ScheduledChunk(seq, seq.num_uncomputed_tokens)])
    engine.free(seq)  # preempted after 6 tokens: 34 computed, 4 full blocks stay cached
    manager.allocate(seq, seq.num_tokens)
    assert seq.num_computed_tokens == 32
    while not seq.is_finished:
        manager.grow(seq.block_table, seq.num_tokens)
        engine.step([ScheduledChunk(seq, seq.num_uncomputed_tokens)])
    engine.free(seq)
    assert seq.output_token_ids == hf_greedy(hf_model, prompt, 12)
    assert_idle(engine)


def test_salted_requests_do_not_share_and_outputs_stay_exact(hf_model):
    engine = engine_for(hf_model, block_size=8, num_blocks=64)
    prompt = random_prompts(1, 11, min_len=40, max_len=40)[0]
    (a,) = engine.generate([greedy(prompt, 4, salt="tenant-a")])
    (b,) = engine.generate([greedy(prompt, 4, salt="tenant-b")])
    (c,) = engine.generate([greedy(prompt, 4, salt="tenant-a")])
    assert (a.num_cached_tokens, b.num_cached_tokens, c.num_cached_tokens) == (0, 0, 32)
    assert a.output_token_ids == b.output_token_ids == c.output_token_ids == hf_greedy(hf_model, prompt, 4)


def test_an_abort_storm_leaks_no_reference(hf_model):
    engine = engine_for(hf_model, block_size=4, num_blocks=64, shuffle_seed=6)
    rng = random.Random(12)
    prefix = random_prompts(1, 12, min_len=20, max_len=20)[0]
    live = []
    for round_ in range(30):
        prompt = prefix[: rng.randint(1, 20)] + random_prompts(1, round_, min_len=1, max_len=10)[0]
        seq = engine.make_sequence(prompt, GREEDY, StoppingParams(max_tokens=20, ignore_eos=True))
        if engine.block_manager.can_allocate(seq, seq.num_tokens):
            engine.block_manager.allocate(seq, seq.num_tokens)
            live.append(seq)
        chunks = []
        for s in live:
            take = min(s.num_uncomputed_tokens, rng.randint(1, 8))
            if engine.block_manager.can_grow(s.block_table, s.num_computed_tokens + take + 1):
                engine.block_manager.grow(s.block_table, s.num_computed_tokens + take + 1)
                chunks.append(ScheduledChunk(s, take))
        engine.step(chunks)
        for s in [s for s in live if s.is_finished or rng.random() < 0.3]:
            live.remove(s)
            engine.free(s)  # aborted wherever it was: waiting for tokens, mid-prompt or decoding
    for s in live:
        engine.free(s)
    assert engine.block_manager.num_hit_tokens > 0
    assert_idle(engine)
