"""Steps that stay alive at any model size: the start-up step cost probe, the token budget it gives, the
flag that overrides it, and a decode core under an 8 B-like cost whose steps never come near the heartbeat.

No test runs a large model or measures time: the engine's steps advance a fake clock by what an 8 B model's
step would cost on two cores, and the assertions are on the scheduler's decisions (tokens per step)."""

from __future__ import annotations

import argparse
import functools
import heapq
import logging
from collections.abc import Callable
from itertools import count

import pytest
from conftest import engine_for, random_prompts, tiny_hf_model

from base.errors import ConfigError
from decode_service.config import DecodeServiceConfig
from decode_service.engine_core.core_client import CoreHeartbeat
from decode_service.engine_core.engine_loop import EngineLoop
from decode_service.engine_core.policies import make_policy
from decode_service.engine_core.request import ServedRequest
from decode_service.engine_core.scheduler import ContinuousScheduler
from engine.params import SamplingParams, StoppingParams
from engine.step_cost import (
    MAX_STEP_TARGET_S,
    StepCost,
    choose_token_budget,
    probe_step_cost,
    size_token_budget,
    step_target_s,
)
from prefill_service.engine_loop import PrefillEngineLoop
from prefill_service.scheduler import ChunkedPrefillScheduler
from serving.event_log import EventLog

# Llama-3.1-8B on two CPU cores: ~16 GFLOP a token at ~200 GFLOP/s, so a 512-token chunk takes ~41 s.
EIGHT_B = StepCost(fixed_s=0.5, per_token_s=0.080)
# SmolLM2-135M on the same host (measured: ~20 ms + ~1.4-2.4 ms/token, AMD EPYC, 2 cores).
SMOLLM2 = StepCost(fixed_s=0.020, per_token_s=0.0024)
HEARTBEAT_S = 30.0
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model(5)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def slowed(engine, cost: StepCost, clock: FakeClock) -> list[int]:
    """Make each of `engine`'s steps advance `clock` by what `cost` says it takes; returns the tokens of
    every step, in order."""
    tokens_per_step: list[int] = []
    step = engine.step

    def costly_step(chunks):
        tokens = sum(chunk.num_tokens + len(chunk.draft_token_ids) for chunk in chunks)
        tokens_per_step.append(tokens)
        clock.now += cost.seconds(tokens)
        return step(chunks)

    engine.step = costly_step
    return tokens_per_step


# -- the budget rule ---------------------------------------------------------------------------------------


def test_an_8b_cost_gets_a_budget_whose_step_stays_within_the_target():
    budget = choose_token_budget(EIGHT_B, configured=512, fit=True, floor=4, heartbeat_timeout_s=HEARTBEAT_S)
    assert budget.tokens == 18
    assert EIGHT_B.seconds(budget.tokens) <= MAX_STEP_TARGET_S
    # Today's fixed budget would make one step take 41.5 s, past the 30 s heartbeat.
    assert EIGHT_B.seconds(512) > HEARTBEAT_S


def test_a_smollm2_cost_keeps_the_default_budget():
    budget = choose_token_budget(SMOLLM2, configured=512, fit=True, floor=64, heartbeat_timeout_s=HEARTBEAT_S)
    assert budget.tokens == 512
    assert budget.fitted


def test_the_target_is_a_quarter_of_a_short_heartbeat():
    assert step_target_s(HEARTBEAT_S) == MAX_STEP_TARGET_S
    assert step_target_s(2.0) == 0.5
    assert step_target_s(None) == MAX_STEP_TARGET_S
    budget = choose_token_budget(SMOLLM2, configured=512, fit=True, floor=1, heartbeat_timeout_s=2.0)
    assert SMOLLM2.seconds(budget.tokens) <= 0.5 < SMOLLM2.seconds(budget.tokens + 1)


def test_one_token_per_sequence_is_the_least_budget_and_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="engine.step_cost"):
        budget = choose_token_budget(EIGHT_B, 512, fit=True, floor=64, heartbeat_timeout_s=HEARTBEAT_S)
    assert budget.tokens == 64
    assert "lower --max-num-seqs" in caplog.text


def test_an_explicit_budget_wins_and_is_warned_about_near_the_heartbeat(caplog):
    with caplog.at_level(logging.WARNING, logger="engine.step_cost"):
        budget = choose_token_budget(EIGHT_B, 512, fit=False, floor=4, heartbeat_timeout_s=HEARTBEAT_S)
    assert (budget.tokens, budget.fitted) == (512, False)
    assert "--max-num-batched-tokens 512" in caplog.text
    assert "--engine-heartbeat-timeout" in caplog.text


def test_an_explicit_budget_far_from_the_heartbeat_is_not_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="engine.step_cost"):
        budget = choose_token_budget(SMOLLM2, 2048, fit=False, floor=4, heartbeat_timeout_s=HEARTBEAT_S)
    assert budget.tokens == 2048
    assert not caplog.records


# -- the probe and the start-up line -----------------------------------------------------------------------


def test_the_probe_measures_the_step_cost_and_gives_back_its_blocks(hf_model):
    engine = engine_for(hf_model, block_size=8, num_blocks=256)
    clock = FakeClock()
    tokens_per_step = slowed(engine, EIGHT_B, clock)
    free = engine.num_free_blocks
    cost = probe_step_cost(engine, MAX_STEP_TARGET_S, 512, clock)
    # Two one-token steps, then 16 tokens: their step is over half the target, so the probe stops there.
    assert tokens_per_step == [1, 1, 16]
    assert cost.fixed_s == pytest.approx(EIGHT_B.seconds(1))
    assert cost.per_token_s == pytest.approx(EIGHT_B.per_token_s)
    assert engine.num_free_blocks == free


def test_the_probe_stops_at_the_ceiling_for_a_small_model(hf_model):
    engine = engine_for(hf_model, block_size=8, num_blocks=256)
    clock = FakeClock()
    tokens_per_step = slowed(engine, SMOLLM2, clock)
    probe_step_cost(engine, MAX_STEP_TARGET_S, 512, clock)
    assert tokens_per_step == [1, 1, 16, 32, 64, 128, 256, 512]


def test_the_start_up_line_says_what_a_step_costs(hf_model, caplog):
    engine = engine_for(hf_model, max_num_batched_tokens=512, fit_token_budget=True)
    with caplog.at_level(logging.INFO, logger="engine.step_cost"):
        size_token_budget(engine, 4, True, HEARTBEAT_S, probe=lambda *_: EIGHT_B)
    assert "a step costs ~500.0 ms + 80.00 ms/token; token budget 18 (fitted; step <= 1.94 s" in caplog.text


def test_the_prefill_tier_fits_its_chunks_to_the_step_cost(hf_model):
    engine = engine_for(hf_model, max_num_batched_tokens=2048, fit_token_budget=True)
    scheduler = ChunkedPrefillScheduler(engine, 2048, 4)
    loop = PrefillEngineLoop(engine, scheduler, lambda _: None, EventLog(10), probe=lambda *_: EIGHT_B)
    loop.warm_up()
    assert scheduler.max_num_batched_tokens == 18


# -- the flag ------------------------------------------------------------------------------------------------


def engine_config(tier: str, *flags: str):
    from serving.flags import engine_config_from_args
    from tandem.cli import build_parser

    return engine_config_from_args(build_parser().parse_args(["serve", tier, *flags]))


@pytest.mark.parametrize(("tier", "ceiling"), [("decode", 512), ("prefill", 2048)])
def test_the_budget_is_fitted_unless_the_flag_sets_it(tier, ceiling):
    for flags in [(), ("--max-num-batched-tokens", "auto")]:
        config = engine_config(tier, *flags)
        assert (config.max_num_batched_tokens, config.fit_token_budget) == (ceiling, True)
    config = engine_config(tier, "--max-num-batched-tokens", "256")
    assert (config.max_num_batched_tokens, config.fit_token_budget) == (256, False)
    with pytest.raises(ConfigError, match="--max-num-batched-tokens must be >= 1"):
        engine_config(tier, "--max-num-batched-tokens", "0")


def test_a_budget_that_is_neither_auto_nor_a_count_is_refused():
    from serving.flags import parse_token_budget

    with pytest.raises(argparse.ArgumentTypeError, match="expected auto or a count"):
        parse_token_budget(512, "lots")


# -- the decode core under an 8 B cost ---------------------------------------------------------------------


class FakeEventLoop:
    """What `CoreHeartbeat` needs of an asyncio loop, on the fake clock: `call_later` timers that `run_due`
    fires in time order, each seeing its own due time as the loop's time."""

    def __init__(self, clock: FakeClock) -> None:
        self._clock = clock
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._order = count()
        self._firing: float | None = None

    def time(self) -> float:
        return self._firing if self._firing is not None else self._clock.now

    def call_later(self, delay: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (self.time() + delay, next(self._order), callback))

    def run_due(self) -> None:
        while self._timers and self._timers[0][0] <= self._clock.now:
            self._firing, _, callback = heapq.heappop(self._timers)
            callback()
        self._firing = None


def serve_a_long_prompt_beside_four_streams(hf_model, fit: bool) -> tuple[list[int], list[float], int, int]:
    """Four streams decode on an engine with the 8 B cost; a 400-token prompt arrives among them. The
    core's loop answers the real `CoreHeartbeat` between steps. Returns the tokens of every step after
    start, the silences the heartbeat saw, the pings answered and the long prompt's prefill chunks."""
    engine = engine_for(
        hf_model,
        block_size=16,
        num_blocks=256,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        fit_token_budget=fit,
    )
    clock = FakeClock()
    tokens_per_step = slowed(engine, EIGHT_B, clock)
    config = DecodeServiceConfig()
    scheduler = ContinuousScheduler(engine, make_policy("fifo"), config, clock=clock)
    probe = functools.partial(probe_step_cost, clock=clock)
    loop = EngineLoop(engine, scheduler, lambda _: None, EventLog(100_000), HEARTBEAT_S, probe)
    loop.warm_up()
    started = len(tokens_per_step)

    events = FakeEventLoop(clock)
    silences: list[float] = []
    answered: list[int] = []
    heartbeat: CoreHeartbeat

    def ping(number: int) -> None:
        def answer() -> None:
            answered.append(number)
            heartbeat.answered(number)

        loop.answer_heartbeat(answer)

    heartbeat = CoreHeartbeat(events, HEARTBEAT_S, ping, lambda: None, silences.append)
    heartbeat.start()

    def submit(request_id: str, prompt: list[int], max_tokens: int) -> None:
        stopping = StoppingParams(max_tokens=max_tokens, ignore_eos=True)
        loop.submit(ServedRequest(engine.make_sequence(prompt, GREEDY, stopping, request_id)))

    for i, prompt in enumerate(random_prompts(4, 7, min_len=4, max_len=8)):
        submit(f"stream-{i}", prompt, 60)
    for step in range(1000):
        if step == 5:
            submit("long", random_prompts(1, 8, min_len=400, max_len=400)[0], 2)
        if step > 5 and not scheduler.has_work:
            break
        loop.step_once()
        events.run_due()
    heartbeat.stop()
    chunks = [c for record in loop.events.snapshot() for c in record.chunks if c.request_id == "long"]
    return tokens_per_step[started:], silences, len(answered), sum(c.kind == "prefill" for c in chunks)


def test_a_long_prompt_beside_decoding_streams_never_makes_a_step_near_the_heartbeat(hf_model):
    tokens_per_step, silences, answered, long_chunks = serve_a_long_prompt_beside_four_streams(hf_model, True)
    longest = max(EIGHT_B.seconds(tokens) for tokens in tokens_per_step)
    assert longest <= MAX_STEP_TARGET_S
    # The prompt went in many chunks, the heartbeat answered between them, and never went silent.
    assert long_chunks > 20
    assert answered > 10
    assert silences == []


def test_todays_fixed_budget_would_have_the_core_killed(hf_model):
    tokens_per_step, silences, _, long_chunks = serve_a_long_prompt_beside_four_streams(hf_model, False)
    assert max(tokens_per_step) > 400
    assert long_chunks == 1
    assert silences and silences[0] >= HEARTBEAT_S
