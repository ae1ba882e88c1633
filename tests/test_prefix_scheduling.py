"""The decode scheduler with prefix caching: admission reserves only the uncached part, SJF and WFQ
charge what a request really costs, preemption keeps outputs exact, and abort storms leak nothing."""

from __future__ import annotations

import random

import pytest
from conftest import engine_for, hf_greedy, random_prompts, tiny_hf_model
from test_decode_scheduler import Harness, admission_order, first_step, last_step

from decode_service.engine_core.request import RequestState


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model(31)


def assert_idle(engine) -> None:
    manager = engine.block_manager
    assert [b for b in range(manager.num_blocks) if manager.refcount(b)] == []
    assert manager.num_free_blocks == manager.num_blocks and manager.usage == 0.0


@pytest.mark.parametrize("caching", [True, False])
def test_admission_reserves_only_the_uncached_part(hf_model, caching):
    # 10 blocks of 8: "long" holds 8 of them for its 57-token prompt; "sharer" adds 4 tokens to the
    # same 56-token prefix, so with the cache it needs 1 new block and is admitted at once.
    engine = engine_for(hf_model, block_size=8, num_blocks=10, enable_prefix_caching=caching)
    harness = Harness(engine, admission_watermark=0.0)
    prefix = random_prompts(1, 3, min_len=56, max_len=56)[0]
    harness.submit("long", prefix + [1], 7)
    harness.loop.step_once()  # "long" is prefilled (its full blocks get cached) and starts decoding
    harness.submit("sharer", prefix + [2, 3, 4, 5], 3)
    events = harness.run()
    overlaps = first_step(events, "sharer") <= last_step(events, "long")
    assert overlaps is caching
    assert harness.tokens["sharer"] == hf_greedy(hf_model, prefix + [2, 3, 4, 5], 3)
    assert harness.tokens["long"] == hf_greedy(hf_model, prefix + [1], 7)
    assert_idle(engine)


@pytest.mark.parametrize(("caching", "first"), [(True, "cached"), (False, "fresh")])
def test_sjf_ranks_a_waiting_request_by_the_tokens_it_will_compute(hf_model, caching, first):
    engine = engine_for(hf_model, block_size=8, num_blocks=64, max_num_seqs=1, enable_prefix_caching=caching)
    harness = Harness(engine, policy="sjf", sjf_aging_tokens_per_second=0.0)
    prefix = random_prompts(1, 4, min_len=64, max_len=64)[0]
    harness.submit("warm", prefix, 2)
    harness.run()
    harness.submit("cached", prefix + [7], 4)  # 65 tokens, 64 of them cached
    harness.submit("fresh", random_prompts(1, 5, min_len=20, max_len=20)[0], 4)
    events = harness.run()
    assert admission_order(events)[1] == first


def test_wfq_charges_only_the_prompt_tokens_a_request_computes(hf_model):
    engine = engine_for(hf_model, block_size=8, num_blocks=64)
    harness = Harness(engine, policy="wfq")
    policy = harness.scheduler.policy
    charged_at_admission = []
    admitted = policy.on_admitted

    def on_admitted(request) -> None:
        before = policy.virtual_tokens[request.tenant]
        admitted(request)
        charged_at_admission.append((request.request_id, policy.virtual_tokens[request.tenant] - before))

    policy.on_admitted = on_admitted
    prefix = random_prompts(1, 6, min_len=40, max_len=40)[0]
    harness.submit("first", prefix + [1], 1, tenant="t")
    harness.run()
    harness.submit("second", prefix + [2], 1, tenant="t")
    harness.run()
    assert charged_at_admission == [("first", 41), ("second", 41 - 40)]


def test_preemption_with_cached_shared_blocks_keeps_outputs_exact(hf_model):
    engine = engine_for(
        hf_model, block_size=8, num_blocks=20, shuffle_seed=7, max_num_seqs=8, max_num_batched_tokens=64
    )
    harness = Harness(engine)
    prefix = random_prompts(1, 8, min_len=24, max_len=24)[0]
    prompts = [prefix + tail for tail in random_prompts(8, 9, min_len=2, max_len=12)]
    for i, prompt in enumerate(prompts):
        harness.submit(f"r{i}", prompt, 24)
    harness.run()
    assert harness.scheduler.num_preemptions > 0 and engine.block_manager.num_hit_tokens > 0
    for i, prompt in enumerate(prompts):
        assert harness.tokens[f"r{i}"] == hf_greedy(hf_model, prompt, 24), f"r{i} diverged"
    assert_idle(engine)


def test_an_abort_storm_over_shared_prefixes_leaks_no_reference(hf_model):
    engine = engine_for(
        hf_model, block_size=4, num_blocks=40, shuffle_seed=8, max_num_seqs=16, max_num_batched_tokens=32
    )
    harness = Harness(engine)
    rng = random.Random(3)
    prefix = random_prompts(1, 10, min_len=16, max_len=16)[0]
    states = set()
    for round_ in range(12):
        for i in range(4):
            tail = random_prompts(1, round_ * 4 + i, min_len=1, max_len=8)[0]
            harness.submit(f"r{round_}-{i}", prefix[: rng.randint(4, 16)] + tail, rng.randint(1, 12))
        harness.loop.step_once()
        scheduler = harness.scheduler
        for request in [*scheduler.waiting, *scheduler.prefilling, *scheduler.running]:
            if rng.random() < 0.4:
                states.add(request.state)
                harness.loop.abort(request.request_id)
    harness.run()
    assert {RequestState.PREFILLING, RequestState.RUNNING} <= states
    assert engine.block_manager.num_hit_tokens > 0
    assert_idle(engine)
