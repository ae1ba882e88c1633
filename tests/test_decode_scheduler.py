"""The decode tier's batcher without gRPC: continuous batching, chunked prefill, preemption, policies,
static mode and aborts, driven step by step through `EngineLoop.step_once` on tiny random models."""

from __future__ import annotations

import itertools
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from conftest import engine_for, hf_greedy, random_prompts, tiny_hf_model

from decode_service.config import DecodeServiceConfig
from decode_service.engine_core.engine_loop import EngineLoop
from decode_service.engine_core.policies import make_policy
from decode_service.engine_core.request import RequestState, ServedRequest, StreamDelta
from decode_service.engine_core.scheduler import (
    DECODE_ROW_TOKENS,
    STEP_COST_TOKENS,
    ContinuousScheduler,
    StaticScheduler,
    prefills_for_least_ttft,
)
from decode_service.engine_core.step_record import StepRecord
from engine.params import SamplingParams, StoppingParams
from engine.sequence import FinishReason
from serving.event_log import EventLog

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model(11)


class FakeClock:
    """A clock the test advances by hand, so aging and timeouts are deterministic."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """An engine loop with a scheduler, collecting every delta per request."""

    def __init__(
        self, engine, policy: str = "fifo", batching: str = "continuous", clock=None, **config_kwargs
    ) -> None:
        self.engine = engine
        self.config = DecodeServiceConfig(policy=policy, batching=batching, **config_kwargs)
        scheduler_type = StaticScheduler if batching == "static" else ContinuousScheduler
        policy_obj = make_policy(policy, self.config.tenant_weights, self.config.sjf_aging_tokens_per_second)
        kwargs = {"clock": clock} if clock is not None else {}
        self.scheduler = scheduler_type(engine, policy_obj, self.config, **kwargs)
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.finish: dict[str, FinishReason] = {}
        self.errors: dict[str, Exception] = {}
        self.loop = EngineLoop(engine, self.scheduler, self._deliver, EventLog(100_000))

    def _deliver(self, deltas: list[StreamDelta]) -> None:
        for delta in deltas:
            rid = delta.request.request_id
            self.tokens[rid].extend(delta.token_ids)
            if delta.finish_reason is not None:
                self.finish[rid] = delta.finish_reason
            if delta.error is not None:
                self.errors[rid] = delta.error

    def submit(self, request_id: str, prompt: list[int], max_tokens: int, **kwargs) -> ServedRequest:
        stopping = StoppingParams(max_tokens=max_tokens, ignore_eos=True)
        request = ServedRequest(self.engine.make_sequence(prompt, GREEDY, stopping, request_id), **kwargs)
        self.loop.submit(request)
        return request

    def run(self) -> list[StepRecord]:
        self.loop.run_until_idle()
        return self.loop.events.snapshot()


def first_step(events: list[StepRecord], request_id: str) -> int:
    return next(e.step for e in events if request_id in e.request_ids)


def last_step(events: list[StepRecord], request_id: str) -> int:
    return max(e.step for e in events if request_id in e.request_ids)


def admission_order(events: list[StepRecord]) -> list[str]:
    order: list[str] = []
    for event in events:
        order.extend(c.request_id for c in event.chunks if c.kind == "prefill" and c.request_id not in order)
    return order


def test_new_requests_join_while_others_run_and_blocks_come_back(hf_model):
    engine = engine_for(hf_model, block_size=8, num_blocks=200, max_num_seqs=4, max_num_batched_tokens=64)
    harness = Harness(engine)
    prompts = random_prompts(12, 21, min_len=2, max_len=50)
    max_tokens = [2, 40, 5, 30, 3, 25, 8, 12, 35, 4, 20, 6]
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        harness.submit(f"r{i}", prompt, n)
    events = harness.run()

    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        assert harness.tokens[f"r{i}"] == hf_greedy(hf_model, prompt, n)
        assert harness.finish[f"r{i}"] is FinishReason.LENGTH
    assert max(len(e.request_ids) for e in events) == 4
    late = [f"r{i}" for i in range(12) if first_step(events, f"r{i}") > 0]
    assert late, "every request started at step 0: nothing joined a running batch"
    for rid in late:
        joined = first_step(events, rid)
        still_running = [
            other
            for other in (f"r{i}" for i in range(12))
            if first_step(events, other) < joined <= last_step(events, other) and other != rid
        ]
        assert still_running, f"{rid} joined at step {joined} only after the whole batch had drained"
    # A finish frees its slot and blocks at once: whenever requests still waited, the next step admitted one.
    for event, following in itertools.pairwise(events):
        if event.finished and event.num_waiting > 0:
            assert following.prefill_ids - event.request_ids, f"step {following.step} admitted nobody"
    assert events[-1].num_free_blocks == 200
    assert engine.block_manager.num_free_blocks == 200


def test_long_prompt_is_chunked_while_decodes_keep_going(hf_model):
    engine = engine_for(hf_model, block_size=8, num_blocks=100, max_num_seqs=4, max_num_batched_tokens=16)
    harness = Harness(engine)
    short = random_prompts(2, 22, min_len=3, max_len=6)
    for i, prompt in enumerate(short):
        harness.submit(f"short{i}", prompt, 60)
    while len(harness.tokens) < 2:
        harness.loop.step_once()
    long_prompt = random_prompts(1, 23, min_len=200, max_len=200)[0]
    harness.submit("long", long_prompt, 3)
    events = harness.run()

    prefill_steps = [e for e in events if "long" in e.prefill_ids]
    assert len(prefill_steps) >= 200 // 14
    for event in prefill_steps:
        assert event.decode_ids == {"short0", "short1"}, f"step {event.step} stalled a running decode"
        assert sum(c.num_tokens for c in event.chunks) <= 16
    assert harness.tokens["long"] == hf_greedy(hf_model, long_prompt, 3)
    assert harness.tokens["short0"] == hf_greedy(hf_model, short[0], 60)


@pytest.mark.parametrize("max_prefills", [0, 1, 2])
def test_max_prefills_per_step_spreads_prompts_that_arrive_together(hf_model, max_prefills):
    """Four short prompts at once: without a cap one step prefills them all; with a cap of k each step
    prefills at most k, so the first k get their first token a step or more before the last."""
    engine = engine_for(hf_model, block_size=8, num_blocks=100, max_num_seqs=4, max_num_batched_tokens=64)
    harness = Harness(engine, max_prefills_per_step=max_prefills)
    prompts = random_prompts(4, 24, min_len=6, max_len=12)
    for i, prompt in enumerate(prompts):
        harness.submit(f"r{i}", prompt, 4)
    events = harness.run()

    per_step = [len(e.prefill_ids) for e in events if e.prefill_ids]
    assert per_step == ([4] if max_prefills == 0 else [max_prefills] * (4 // max_prefills))
    for i, prompt in enumerate(prompts):
        assert harness.tokens[f"r{i}"] == hf_greedy(hf_model, prompt, 4)


@pytest.mark.parametrize(
    ("prompts", "tokens", "decode_rows", "expected"),
    [
        (1, 500, 0, 1),
        (4, 400, 0, 1),  # a chat turn's prompts arriving together with nothing decoding: one per step
        (64, 12_800, 0, 2),  # a burst of 200-token prompts before anything decodes
        (64, 12_800, 8, 3),  # the same beside 8 decode rows, which every extra step runs again
        (48, 9_600, 64, 5),
        (64, 640, 0, 9),  # short prompts share steps even with nothing decoding
    ],
)
def test_prefills_for_least_ttft_weighs_the_step_cost_against_the_prompts(
    prompts, tokens, decode_rows, expected
):
    assert prefills_for_least_ttft(prompts, tokens, decode_rows) == expected


def _mean_end_time(num_prompts: int, prompt_tokens: int, step_cost: float, per_step: int) -> float:
    """The mean step end at which each of `num_prompts` equal prompts is prefilled, `per_step` a step."""
    elapsed = total = 0.0
    left = num_prompts
    while left:
        taken = min(per_step, left)
        elapsed += step_cost + taken * prompt_tokens
        total += taken * elapsed
        left -= taken
    return total / num_prompts


def test_prefills_for_least_ttft_is_near_the_best_count_of_its_cost_model():
    """Against every count from 1 to n on the same cost model, steps of whole equal prompts: the closed
    form's choice gives a mean time to first token within 5% of the least."""
    for num_prompts, prompt_tokens, decode_rows in itertools.product(
        (2, 3, 4, 8, 16, 64, 200), (1, 5, 20, 80, 200, 1000), (0, 1, 4, 16, 64)
    ):
        step_cost = STEP_COST_TOKENS + DECODE_ROW_TOKENS * decode_rows
        chosen = prefills_for_least_ttft(num_prompts, num_prompts * prompt_tokens, decode_rows)
        best = min(
            _mean_end_time(num_prompts, prompt_tokens, step_cost, k) for k in range(1, num_prompts + 1)
        )
        chosen_time = _mean_end_time(num_prompts, prompt_tokens, step_cost, chosen)
        assert chosen_time <= 1.05 * best, (num_prompts, prompt_tokens, decode_rows, chosen)


def test_auto_prefills_prompts_arriving_together_one_per_step(hf_model):
    """The default (`auto`) on a CPU: four 24-token prompts with nothing decoding get a step each, where
    the token budget alone would prefill all four in one, and every answer still matches HF."""
    engine = engine_for(hf_model, block_size=8, num_blocks=100, max_num_seqs=4, max_num_batched_tokens=128)
    harness = Harness(engine)
    assert harness.config.max_prefills_per_step is None
    prompts = random_prompts(4, 24, min_len=24, max_len=24)
    for i, prompt in enumerate(prompts):
        harness.submit(f"r{i}", prompt, 4)
    events = harness.run()

    assert [len(e.prefill_ids) for e in events if e.prefill_ids] == [1, 1, 1, 1]
    for i, prompt in enumerate(prompts):
        assert harness.tokens[f"r{i}"] == hf_greedy(hf_model, prompt, 4)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_auto_spreads_prompts_only_for_the_continuous_scheduler_on_a_cpu(hf_model, device, batching):
    """On a GPU a prefill token costs little beside a step's fixed cost, so `auto` sets no cap there; the
    static baseline always packs. The scheduler reads the device once, when it is built: the harness is
    built as if on a GPU, then the steps run on this machine's CPU."""
    engine = engine_for(hf_model, block_size=8, num_blocks=100, max_num_seqs=4, max_num_batched_tokens=128)
    cpu = engine.device
    engine.device = torch.device(device)
    try:
        harness = Harness(engine, batching=batching)
    finally:
        engine.device = cpu
    for i, prompt in enumerate(random_prompts(4, 24, min_len=24, max_len=24)):
        harness.submit(f"r{i}", prompt, 2)
    events = harness.run()

    spread = device == "cpu" and batching == "continuous"
    assert [len(e.prefill_ids) for e in events if e.prefill_ids] == ([1, 1, 1, 1] if spread else [4])


def test_auto_prefills_prompts_together_beside_many_decode_rows(hf_model):
    """With eight sequences decoding, four 8-token prompts arriving together share a step (three, then
    one): a step of its own for each would run the eight decode rows three more times."""
    engine = engine_for(hf_model, block_size=8, num_blocks=200, max_num_seqs=12, max_num_batched_tokens=128)
    harness = Harness(engine)
    running = random_prompts(8, 16, min_len=16, max_len=16)
    for i, prompt in enumerate(running):
        harness.submit(f"d{i}", prompt, 30)
    while len(harness.scheduler.running) < len(running):
        harness.loop.step_once()
    arriving = random_prompts(4, 8, min_len=8, max_len=8)
    for i, prompt in enumerate(arriving):
        harness.submit(f"r{i}", prompt, 4)
    events = harness.run()

    late = [e for e in events if e.prefill_ids and e.prefill_ids <= {f"r{i}" for i in range(4)}]
    assert [len(e.prefill_ids) for e in late] == [3, 1]
    assert all(len(e.decode_ids) >= 8 for e in late)
    for i, prompt in enumerate(arriving):
        assert harness.tokens[f"r{i}"] == hf_greedy(hf_model, prompt, 4)


@pytest.mark.parametrize("max_prefills", [0, 1])
def test_prompts_admitted_together_compute_their_shared_prefix_once(hf_model, max_prefills):
    """Three prompts sharing 32 tokens arrive at once: the first computes the prefix, the others take its
    blocks once registered and prefill only their own 4 tokens, and every answer still matches HF."""
    engine = engine_for(
        hf_model, block_size=8, num_blocks=100, shuffle_seed=5, max_num_seqs=4, max_num_batched_tokens=32
    )
    harness = Harness(engine, max_prefills_per_step=max_prefills)
    shared = random_prompts(1, 32, min_len=32, max_len=32)[0]
    prompts = [[*shared, *tail] for tail in random_prompts(3, 4, min_len=4, max_len=4)]
    for i, prompt in enumerate(prompts):
        harness.submit(f"r{i}", prompt, 3)
    events = harness.run()

    prefilled = {f"r{i}": 0 for i in range(3)}
    for event in events:
        for chunk in event.chunks:
            if chunk.kind == "prefill":
                prefilled[chunk.request_id] += chunk.num_tokens
    assert prefilled == {"r0": 36, "r1": 4, "r2": 4}
    assert engine.block_manager.num_hit_tokens == 64
    for i, prompt in enumerate(prompts):
        assert harness.tokens[f"r{i}"] == hf_greedy(hf_model, prompt, 3)


def test_preemption_recomputes_and_outputs_match_hf(hf_model):
    # 8 requests of up to 44 tokens need 6 blocks each at full length: 48 blocks, the pool has 16.
    engine = engine_for(
        hf_model, block_size=8, num_blocks=16, shuffle_seed=3, max_num_seqs=8, max_num_batched_tokens=64
    )
    harness = Harness(engine)
    prompts = random_prompts(8, 24, min_len=10, max_len=20)
    for i, prompt in enumerate(prompts):
        harness.submit(f"r{i}", prompt, 24)
    events = harness.run()

    assert harness.scheduler.num_preemptions > 0
    assert any(e.preempted for e in events)
    for i, prompt in enumerate(prompts):
        assert harness.tokens[f"r{i}"] == hf_greedy(hf_model, prompt, 24), f"r{i} diverged after preemption"
        assert harness.finish[f"r{i}"] is FinishReason.LENGTH
    assert engine.block_manager.num_free_blocks == 16


@pytest.mark.parametrize(
    ("policy", "requests", "expected"),
    [
        # (request id, prompt length, max_tokens, priority)
        ("fifo", [("a", 9, 9, 0), ("b", 2, 2, 9), ("c", 5, 5, 0), ("d", 1, 1, 0)], ["a", "b", "c", "d"]),
        (
            "priority",
            [("a", 3, 3, 0), ("b", 3, 3, 5), ("c", 3, 3, 1), ("d", 3, 3, 5), ("e", 3, 3, -1)],
            ["b", "d", "c", "a", "e"],
        ),
        (
            "sjf",
            [("a", 20, 10, 0), ("b", 5, 5, 0), ("c", 10, 10, 0), ("d", 3, 2, 0), ("e", 15, 10, 0)],
            ["d", "b", "c", "e", "a"],
        ),
    ],
)
def test_policy_admission_order(hf_model, policy, requests, expected):
    engine = engine_for(hf_model, block_size=8, num_blocks=64, max_num_seqs=1, max_num_batched_tokens=64)
    harness = Harness(engine, policy=policy, clock=FakeClock())
    for (rid, prompt_len, max_tokens, priority), prompt in zip(
        requests, random_prompts(len(requests), 25, min_len=20, max_len=20), strict=True
    ):
        harness.submit(rid, prompt[:prompt_len], max_tokens, priority=priority)
    assert admission_order(harness.run()) == expected


def test_wfq_admission_interleaves_tenants_by_weight(hf_model):
    engine = engine_for(hf_model, block_size=8, num_blocks=64, max_num_seqs=1, max_num_batched_tokens=64)
    harness = Harness(engine, policy="wfq", tenant_weights={"a": 2.0, "b": 1.0}, clock=FakeClock())
    prompt = random_prompts(1, 26, min_len=4, max_len=4)[0]
    for tenant in "ab":
        for i in range(6):
            harness.submit(f"{tenant}{i}", prompt, 4, tenant=tenant)
    # Each request costs 8 virtual tokens for b and 4 for a; ties go to the earlier arrival.
    expected = ["a0", "b0", "a1", "a2", "b1", "a3", "a4", "b2", "a5", "b3", "b4", "b5"]
    assert admission_order(harness.run()) == expected


def test_wfq_token_shares_follow_weights_when_one_tenant_floods(hf_model):
    engine = engine_for(hf_model, block_size=8, num_blocks=128, max_num_seqs=3, max_num_batched_tokens=64)
    harness = Harness(engine, policy="wfq", tenant_weights={"a": 2.0, "b": 1.0})
    prompts = random_prompts(60, 27, min_len=4, max_len=8)
    tenant_of = {}
    # b floods first with twice as many requests; it must not starve a, nor get more than its weight.
    for i in range(40):
        tenant_of[f"b{i}"] = "b"
        harness.submit(f"b{i}", prompts[i], 10, tenant="b")
    for i in range(20):
        tenant_of[f"a{i}"] = "a"
        harness.submit(f"a{i}", prompts[40 + i], 10, tenant="a")
    events = harness.run()

    # Measure while both tenants are backlogged: until a's last request is admitted.
    window_end = max(first_step(events, f"a{i}") for i in range(20))
    served = defaultdict(int)
    for event in events[: window_end + 1]:
        for chunk in event.chunks:
            served[tenant_of[chunk.request_id]] += chunk.num_tokens
    share_a = served["a"] / (served["a"] + served["b"])
    assert abs(share_a - 2 / 3) <= 0.1 * 2 / 3, f"tenant a got {share_a:.2f} of the tokens, weight says 0.67"


def test_wfq_forgets_tenants_without_live_requests(hf_model):
    """Issue 13 item 8: 200 finished requests from 200 tenant names once left 200 counters behind."""
    engine = engine_for(hf_model, block_size=8, num_blocks=64, max_num_seqs=2, max_num_batched_tokens=64)
    harness = Harness(engine, policy="wfq")
    prompt = random_prompts(1, 31, min_len=4, max_len=4)[0]
    harness.submit("anchor", prompt, 400, tenant="steady")
    for i in range(200):
        harness.submit(f"r{i}", prompt, 1, tenant=f"tenant-{i}")
        while f"r{i}" not in harness.finish:
            harness.loop.step_once()
    policy = harness.scheduler.policy
    # Only the live tenant has a counter; the others' leads are bounded and go once nobody is live.
    assert set(policy.virtual_tokens) == {"steady"}
    assert len(policy.idle_leads) <= policy.max_idle_tenants
    harness.run()
    assert policy.virtual_tokens == {} and policy.idle_leads == {}


def fake_request(tenant: str, index: int, prompt_tokens: int = 10) -> SimpleNamespace:
    seq = SimpleNamespace(num_prompt_tokens=prompt_tokens, num_cached_tokens=0)
    return SimpleNamespace(tenant=tenant, arrival_index=index, num_preemptions=0, seq=seq)


def test_wfq_a_tenant_ahead_keeps_its_lead_across_idle_gaps():
    """Leaving and coming back must not reset a tenant that was served more than the others."""
    policy = make_policy("wfq", max_idle_tenants=1)
    slow, fast = fake_request("slow", 0, prompt_tokens=1), fake_request("fast", 1, prompt_tokens=50)
    for request in (slow, fast):
        policy.on_enqueued(request)
        policy.on_admitted(request)
    policy.on_finished(fast)
    assert policy.idle_leads == {"fast": 51.0}  # it arrived at the floor, 1
    back = fake_request("fast", 2)
    policy.on_enqueued(back)
    assert policy.rank(back, 0.0) == (51.0, 2)
    # A tenant at or below the floor restarts at the floor: nothing to remember.
    other = fake_request("other", 3, prompt_tokens=0)
    policy.on_enqueued(other)
    policy.on_finished(other)
    assert "other" not in policy.idle_leads
    # The bound keeps the biggest leads.
    policy.on_admitted(back)
    policy.on_finished(back)
    third = fake_request("third", 4, prompt_tokens=200)
    policy.on_enqueued(third)
    policy.on_admitted(third)
    policy.on_finished(third)
    assert policy.idle_leads == {"third": 201.0}


@pytest.mark.parametrize(("aging", "admitted"), [(5.0, True), (0.0, False)])
def test_sjf_aging_admits_a_long_job_despite_a_stream_of_short_ones(hf_model, aging, admitted):
    engine = engine_for(hf_model, block_size=8, num_blocks=64, max_num_seqs=1, max_num_batched_tokens=64)
    clock = FakeClock()
    harness = Harness(engine, policy="sjf", sjf_aging_tokens_per_second=aging, clock=clock)
    prompts = random_prompts(2, 28, min_len=4, max_len=4)
    long_job = harness.submit("long", prompts[0], 50)
    for step in range(150):
        waiting_short = [r for r in harness.scheduler.waiting if r is not long_job]
        if len(waiting_short) < 2:
            harness.submit(f"short{step}", prompts[1][:2], 2)
        harness.loop.step_once()
        clock.now += 1.0
        if long_job.state is not RequestState.WAITING:
            break
    assert (long_job.state is not RequestState.WAITING) is admitted


@pytest.mark.parametrize(("policy", "victim"), [("priority", "early-low"), ("fifo", "late-high")])
def test_policy_picks_the_preemption_victim(hf_model, policy, victim):
    # Two sequences of up to 20 tokens need 5 blocks each; the pool has 6, so one must be preempted.
    engine = engine_for(hf_model, block_size=4, num_blocks=6, max_num_seqs=2, max_num_batched_tokens=16)
    harness = Harness(engine, policy=policy)
    prompts = random_prompts(2, 29, min_len=4, max_len=4)
    harness.submit("early-low", prompts[0], 16, priority=0)
    harness.submit("late-high", prompts[1], 16, priority=5)
    events = harness.run()
    preempted = [rid for e in events for rid in e.preempted]
    assert preempted and preempted[0] == victim
    for rid, prompt in zip(("early-low", "late-high"), prompts, strict=True):
        assert harness.tokens[rid] == hf_greedy(hf_model, prompt, 16)
    assert engine.block_manager.num_free_blocks == 6


@pytest.mark.parametrize(("max_preemptions", "first_after_victim"), [(1, "low"), (100, "high2")])
def test_a_request_preempted_too_often_goes_first(hf_model, max_preemptions, first_after_victim):
    engine = engine_for(hf_model, block_size=4, num_blocks=6, max_num_seqs=2, max_num_batched_tokens=16)
    harness = Harness(engine, policy="priority", max_preemptions=max_preemptions)
    prompts = random_prompts(3, 30, min_len=4, max_len=4)
    harness.submit("low", prompts[0], 16, priority=0)
    harness.loop.step_once()
    harness.submit("high", prompts[1], 16, priority=5)
    harness.submit("high2", prompts[2], 16, priority=5)
    events = harness.run()
    assert [rid for e in events for rid in e.preempted][0] == "low"
    victim_step = next(e.step for e in events if e.preempted)
    readmitted = [c.request_id for e in events[victim_step + 1 :] for c in e.chunks if c.kind == "prefill"]
    assert readmitted[0] == first_after_victim
    assert all(rid in harness.finish for rid in ("low", "high", "high2"))
    assert engine.block_manager.num_free_blocks == 6


def test_static_batching_same_tokens_with_idle_slots(hf_model):
    prompts = random_prompts(8, 31, min_len=3, max_len=30)
    max_tokens = [2, 20, 4, 3, 18, 2, 5, 3]
    steps = {}
    for batching in ("static", "continuous"):
        engine = engine_for(
            hf_model, block_size=8, num_blocks=100, max_num_seqs=4, max_num_batched_tokens=128
        )
        harness = Harness(engine, batching=batching)
        for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
            harness.submit(f"r{i}", prompt, n)
        events = harness.run()
        steps[batching] = len(events)
        for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
            assert harness.tokens[f"r{i}"] == hf_greedy(hf_model, prompt, n)
        assert engine.block_manager.num_free_blocks == 100
        if batching == "static":
            first_batch = {f"r{i}" for i in range(4)}
            second_start = min(first_step(events, f"r{i}") for i in range(4, 8))
            assert second_start > max(last_step(events, rid) for rid in first_batch)
            idle = [e for e in events if e.num_waiting > 0 and len(e.request_ids) < 4]
            assert idle, "static batching never left a slot idle while requests waited"
    assert steps["continuous"] < steps["static"]


def test_static_batch_waits_for_a_full_batch_or_the_timeout(hf_model):
    engine = engine_for(hf_model, block_size=8, num_blocks=100, max_num_seqs=4, max_num_batched_tokens=64)
    clock = FakeClock()
    harness = Harness(engine, batching="static", static_batch_timeout_s=2.0, clock=clock)
    prompts = random_prompts(2, 32, min_len=3, max_len=8)
    for i, prompt in enumerate(prompts):
        harness.submit(f"r{i}", prompt, 3)
    assert not harness.loop.step_once()
    assert harness.scheduler.idle_wait_seconds() == pytest.approx(2.0)
    clock.now = 2.0
    assert harness.loop.step_once()
    assert harness.loop.events.snapshot()[-1].prefill_ids == {"r0", "r1"}


def test_abort_frees_waiting_prefilling_and_running_requests(hf_model):
    engine = engine_for(hf_model, block_size=8, num_blocks=64, max_num_seqs=2, max_num_batched_tokens=8)
    harness = Harness(engine)
    prompts = random_prompts(3, 33, min_len=4, max_len=4)
    running = harness.submit("running", prompts[0], 50)
    harness.loop.step_once()
    prefilling = harness.submit("prefilling", prompts[1] * 20, 5)
    waiting = harness.submit("waiting", prompts[2], 5)
    harness.loop.step_once()
    assert (running.state, prefilling.state, waiting.state) == (
        RequestState.RUNNING,
        RequestState.PREFILLING,
        RequestState.WAITING,
    )
    assert engine.block_manager.num_free_blocks < 64
    for rid in ("running", "prefilling", "waiting"):
        harness.loop.abort(rid)
    harness.loop.abort("no-such-request")
    harness.loop.step_once()
    assert harness.finish == dict.fromkeys(("running", "prefilling", "waiting"), FinishReason.ABORT)
    assert engine.block_manager.num_free_blocks == 64
    assert not harness.scheduler.has_work


def test_a_failing_forward_fails_its_requests_and_frees_their_blocks(hf_model, monkeypatch):
    engine = engine_for(hf_model, block_size=8, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
    harness = Harness(engine)
    prompts = random_prompts(2, 34, min_len=4, max_len=10)
    harness.submit("a", prompts[0], 5)
    harness.loop.step_once()

    def broken_step(chunks):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "step", broken_step)
    harness.loop.step_once()
    assert isinstance(harness.errors["a"], RuntimeError)
    assert engine.block_manager.num_free_blocks == 64
    monkeypatch.undo()
    harness.submit("b", prompts[1], 5)
    harness.run()
    assert harness.tokens["b"] == hf_greedy(hf_model, prompts[1], 5)


def test_a_failed_warm_up_is_reported_instead_of_ready(hf_model, monkeypatch):
    engine = engine_for(hf_model, block_size=8, num_blocks=16)
    harness = Harness(engine)

    def broken_step(chunks):
        raise RuntimeError("no kernel image for this device")

    monkeypatch.setattr(engine, "step", broken_step)
    harness.loop.start(warm_up=True)
    with pytest.raises(RuntimeError, match="no kernel image"):
        harness.loop.wait_ready(30)
    assert engine.block_manager.num_free_blocks == 16
    harness.loop.stop()


def test_a_failure_in_step_bookkeeping_ends_that_request_and_frees_its_blocks(hf_model, monkeypatch):
    """Issue 13: an exception in complete_step was only logged; its requests hung until their deadline."""
    engine = engine_for(hf_model, block_size=8, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
    harness = Harness(engine)
    prompts = random_prompts(2, 41, min_len=4, max_len=9)
    harness.submit("bad", prompts[0], 6)
    harness.submit("good", prompts[1], 6)
    on_token = harness.scheduler.policy.on_token_generated

    def fail_for_bad(request):
        if request.request_id == "bad":
            raise RuntimeError("bookkeeping bug")
        on_token(request)

    monkeypatch.setattr(harness.scheduler.policy, "on_token_generated", fail_for_bad)
    harness.run()
    assert isinstance(harness.errors["bad"], RuntimeError)
    assert harness.finish["good"] is FinishReason.LENGTH and len(harness.tokens["good"]) == 6
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_failure_in_schedule_ends_every_live_request_and_the_loop_goes_on(hf_model, monkeypatch):
    engine = engine_for(hf_model, block_size=8, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
    harness = Harness(engine)
    prompts = random_prompts(3, 42, min_len=4, max_len=9)
    harness.submit("a", prompts[0], 20)
    harness.loop.step_once()
    harness.submit("b", prompts[1], 20)
    admit = harness.scheduler._admit
    calls = []

    def fail_once(now):
        calls.append(now)
        if len(calls) == 1:
            raise RuntimeError("scheduling bug")
        admit(now)

    monkeypatch.setattr(harness.scheduler, "_admit", fail_once)
    harness.loop.step_once()
    assert set(harness.errors) == {"a", "b"}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    harness.submit("c", prompts[2], 3)
    harness.run()
    assert harness.finish["c"] is FinishReason.LENGTH and "c" not in harness.errors


# --- n > 1: choices forked off the prefilled prompt ----------------------------------------------


class ChoiceHarness(Harness):
    """A harness that keeps each choice's tokens apart: keys are (request_id, index)."""

    def _deliver(self, deltas: list[StreamDelta]) -> None:
        for delta in deltas:
            key = (delta.request.request_id, delta.request.index)
            self.tokens[key].extend(delta.token_ids)
            if delta.finish_reason is not None:
                self.finish[key] = delta.finish_reason

    def submit_choices(self, request_id: str, prompt: list[int], max_tokens: int, sampling, n: int):
        stopping = StoppingParams(max_tokens=max_tokens, ignore_eos=True)
        request = ServedRequest(self.engine.make_sequence(prompt, sampling, stopping, request_id), n=n)
        self.loop.submit(request)
        return request


def sampled_alone(hf_model, prompt: list[int], max_tokens: int, sampling: SamplingParams) -> list[int]:
    engine = engine_for(hf_model, block_size=8, num_blocks=64)
    harness = Harness(engine)
    stopping = StoppingParams(max_tokens=max_tokens, ignore_eos=True)
    harness.loop.submit(ServedRequest(engine.make_sequence(prompt, sampling, stopping, "alone")))
    harness.run()
    return harness.tokens["alone"]


@pytest.mark.parametrize("prompt_len", [21, 24])  # last prompt token in a partial block / in a full one
def test_choices_share_the_prompt_prefill_and_sample_with_seed_plus_index(hf_model, prompt_len):
    engine = engine_for(hf_model, block_size=8, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
    harness = ChoiceHarness(engine)
    prompt = random_prompts(1, 35, min_len=prompt_len, max_len=prompt_len)[0]
    sampling = SamplingParams(temperature=1.0, seed=1000)
    harness.submit_choices("multi", prompt, 6, sampling, n=3)
    harness.loop.step_once()  # prefill, choice 0's first token, fork
    prompt_blocks = -(-prompt_len // 8)
    shared = [b for b in range(64) if engine.block_manager.refcount(b) == 3]
    assert len(shared) == (prompt_len - 1) // 8, "the full blocks before the last prompt token are shared"
    assert engine.block_manager.num_free_blocks == 64 - prompt_blocks - 2  # one private block per child
    events = harness.run()

    prefilled = sum(c.num_tokens for e in events for c in e.chunks if c.kind == "prefill")
    assert prefilled == prompt_len, "the prompt was prefilled once, not once per choice"
    for index in range(3):
        choice_sampling = SamplingParams(temperature=1.0, seed=1000 + index)
        assert harness.tokens[("multi", index)] == sampled_alone(hf_model, prompt, 6, choice_sampling)
        assert harness.finish[("multi", index)] is FinishReason.LENGTH
    assert len({tuple(harness.tokens[("multi", i)]) for i in range(3)}) > 1
    assert engine.block_manager.num_free_blocks == 64


def test_greedy_choices_match_hf_and_choices_without_a_seat_are_prefilled_later(hf_model):
    engine = engine_for(hf_model, block_size=8, num_blocks=64, max_num_seqs=2, max_num_batched_tokens=64)
    harness = ChoiceHarness(engine)
    prompt = random_prompts(1, 36, min_len=13, max_len=13)[0]
    harness.submit_choices("greedy", prompt, 5, GREEDY, n=3)
    harness.run()
    for index in range(3):
        assert harness.tokens[("greedy", index)] == hf_greedy(hf_model, prompt, 5)
    assert engine.block_manager.num_free_blocks == 64 and not harness.scheduler.has_work


def test_abort_ends_every_choice_and_frees_shared_blocks(hf_model):
    engine = engine_for(hf_model, block_size=8, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
    harness = ChoiceHarness(engine)
    prompt = random_prompts(1, 37, min_len=30, max_len=30)[0]
    harness.submit_choices("doomed", prompt, 50, GREEDY, n=3)
    harness.loop.step_once()
    harness.loop.step_once()
    assert engine.block_manager.num_free_blocks < 64
    harness.loop.abort("doomed")
    harness.loop.step_once()
    assert harness.finish == {("doomed", i): FinishReason.ABORT for i in range(3)}
    assert engine.block_manager.num_free_blocks == 64 and not harness.scheduler.has_work


def test_a_stop_string_from_the_front_door_ends_one_choice_and_frees_its_blocks(hf_model):
    engine = engine_for(hf_model, block_size=8, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
    harness = ChoiceHarness(engine)
    prompt = random_prompts(1, 38, min_len=30, max_len=30)[0]
    request = harness.submit_choices("req", prompt, 50, GREEDY, n=2)
    harness.loop.step_once()
    harness.loop.step_once()
    harness.loop.stop_at_string("req", 0, "stop here")
    harness.loop.stop_at_string("req", 5, "no such choice")  # ignored
    harness.loop.step_once()
    assert harness.finish == {("req", 0): FinishReason.STOP}
    assert request.seq.matched_stop == "stop here" and len(harness.scheduler.running) == 1
    harness.loop.stop_at_string("req", 0, "again")  # already ended: ignored
    harness.run()
    assert harness.finish == {("req", 0): FinishReason.STOP, ("req", 1): FinishReason.LENGTH}
    assert len(harness.tokens[("req", 1)]) == 50 and len(harness.tokens[("req", 0)]) < 50
    assert engine.block_manager.num_free_blocks == 64 and not harness.scheduler.has_work
