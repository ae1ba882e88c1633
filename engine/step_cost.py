"""What one engine step costs on this host, measured at start, and the token budget that keeps steps short.

A step's forward costs about a fixed part (every weight read once, the step's own Python) plus a part
per token it computes. The budget of tokens per step is what bounds a step: a fixed budget that suits a
135 M model (512 tokens, a fraction of a second) makes one step of an 8 B model on two cores take tens of
seconds, past the decode tier's 30 s engine heartbeat that kills the core, and holds every decoding
stream that long. So after warm-up each tier times a probe forward of a few prompt sizes, fits
`StepCost` (fixed seconds + seconds per token), and, unless the operator fixed the budget
(`--max-num-batched-tokens N`), takes the largest budget whose step stays within `step_target_s`: at
most the tier's default ceiling, at least what the scheduler needs (one token per running sequence).
A long prompt then runs in chunks of at most that budget, and the engine loop answers the heartbeat
between them.

The probe is injectable (`Probe`): tests give an 8 B-like cost without an 8 B model.
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from base.logs import log_event

if TYPE_CHECKING:
    from engine.engine import Engine

logger = logging.getLogger(__name__)

Clock = Callable[[], float]

# The probe times a one-token step (about the fixed part alone, least of `FIXED_REPEATS`), then prompts
# of `FIRST_PROBE_TOKENS` tokens, doubling, up to the tier's ceiling: it stops once a step takes over half
# the target (the next would pass it), so probing costs about two target steps at most. Measured, not
# extrapolated from a small chunk: on SmolLM2-135M a 512-token step costs 3x what a 64-token one predicts.
FIXED_REPEATS = 2
FIRST_PROBE_TOKENS = 16
# The longest a step should take at the defaults, and the share of the heartbeat timeout it may use when
# that is shorter: a ping waits at most one step for its answer, so a step at a quarter of the timeout
# leaves the core three more steps' worth of slack before it is called dead.
MAX_STEP_TARGET_S = 2.0
HEARTBEAT_SHARE = 0.25
# An operator's fixed budget is warned about when its step would take more than this share of the
# heartbeat timeout: one slower step (a busy host, a longer context) and the core is killed.
HEARTBEAT_WARNING_SHARE = 0.5


@dataclass(frozen=True)
class StepCost:
    """A step computing n tokens takes about `fixed_s + per_token_s * n` seconds."""

    fixed_s: float
    per_token_s: float

    def seconds(self, tokens: int) -> float:
        return self.fixed_s + self.per_token_s * tokens

    def tokens_within(self, seconds: float) -> int:
        """The most tokens one step computes within `seconds`: 0 when the fixed part alone is longer, no
        limit when a token costs nothing measurable beside the step (the tier's ceiling bounds it then)."""
        if self.per_token_s <= 0:
            return sys.maxsize
        return max(0, int((seconds - self.fixed_s) / self.per_token_s))


# A probe: the engine, the step target and the most tokens a step may take -> the fitted cost.
Probe = Callable[["Engine", float, int], StepCost]


def step_target_s(heartbeat_timeout_s: float | None) -> float:
    """How long a step may take at the defaults: `MAX_STEP_TARGET_S`, or a quarter of the heartbeat
    timeout when that is shorter (None: a tier without a heartbeat)."""
    if heartbeat_timeout_s is None:
        return MAX_STEP_TARGET_S
    return min(MAX_STEP_TARGET_S, HEARTBEAT_SHARE * heartbeat_timeout_s)


def probe_step_cost(
    engine: Engine, target_s: float, max_tokens: int, clock: Clock = time.perf_counter
) -> StepCost:
    """Time one-token steps and prompts of growing size (see `FIRST_PROBE_TOKENS`) and fit the cost: the
    fixed part is the one-token step, the per-token part the steepest any probed prompt showed (so the
    budget errs short). Run it after warm-up, on the engine's thread, before any request is admitted."""
    prompts = itertools.count(1)
    fixed = min(_time_prompt(engine, 1, next(prompts), clock) or 0.0 for _ in range(FIXED_REPEATS))
    per_token = 0.0
    size = FIRST_PROBE_TOKENS
    while size <= min(max_tokens, engine.max_model_len - 1):
        seconds = _time_prompt(engine, size, next(prompts), clock)
        if seconds is None:
            break
        per_token = max(per_token, (seconds - fixed) / (size - 1))
        if seconds > target_s / 2:
            break
        size *= 2
    return StepCost(fixed, per_token)


def _time_prompt(engine: Engine, size: int, first: int, clock: Clock) -> float | None:
    """Seconds of one step prefilling a `size`-token prompt starting at token id `first`, which no other
    probe starts at (no prefix reuse: the step computes every token); its blocks are freed after. None
    when the KV pool cannot hold it."""
    from engine.model_runner import ScheduledChunk
    from engine.params import SamplingParams, StoppingParams

    tokens = [(first + i) % engine.vocab_size for i in range(size)]
    seq = engine.make_sequence(
        tokens,
        SamplingParams(temperature=0.0),
        StoppingParams(max_tokens=1, ignore_eos=True),
        "step-cost-probe",
        cache_salt="step-cost-probe",
    )
    if not engine.can_allocate(seq, seq.num_tokens):
        return None
    engine.allocate(seq, seq.num_tokens)
    try:
        start = clock()
        engine.step([ScheduledChunk(seq, seq.num_uncomputed_tokens)])
        return clock() - start
    finally:
        engine.free(seq)


@dataclass(frozen=True)
class TokenBudget:
    """The tokens one step may compute, and why: fitted to `cost` within `target_s`, or the operator's."""

    tokens: int
    cost: StepCost
    target_s: float
    fitted: bool

    def describe(self) -> str:
        """The start-up line: what a step costs, the budget, and the step that budget allows."""
        how = "fitted" if self.fitted else "set by --max-num-batched-tokens"
        return (
            f"a step costs ~{self.cost.fixed_s * 1e3:.1f} ms + {self.cost.per_token_s * 1e3:.2f} ms/token; "
            f"token budget {self.tokens} ({how}; step <= {self.cost.seconds(self.tokens):.2f} s, "
            f"target {self.target_s:g} s)"
        )


def choose_token_budget(
    cost: StepCost,
    configured: int,
    fit: bool,
    floor: int,
    heartbeat_timeout_s: float | None = None,
) -> TokenBudget:
    """The step token budget: with `fit`, the most tokens a step computes within `step_target_s`, at most
    `configured` (the tier's ceiling) and at least `floor` (the scheduler's minimum: one token for each
    sequence it may run); without, `configured` as the operator set it. Warns when the result's step
    would take longer than it should."""
    target_s = step_target_s(heartbeat_timeout_s)
    tokens = max(floor, min(configured, cost.tokens_within(target_s))) if fit else configured
    budget = TokenBudget(tokens, cost, target_s, fit)
    step_s = cost.seconds(tokens)
    if not fit and heartbeat_timeout_s is not None and step_s > HEARTBEAT_WARNING_SHARE * heartbeat_timeout_s:
        log_event(
            logger,
            logging.WARNING,
            "token budget near the heartbeat",
            detail=f"--max-num-batched-tokens {tokens} makes a step take ~{step_s:.1f} s, near the "
            f"{heartbeat_timeout_s:g} s --engine-heartbeat-timeout that kills the engine core; "
            "leave the flag at auto or lower it",
        )
    elif fit and step_s > target_s:
        log_event(
            logger,
            logging.WARNING,
            "step over its target",
            detail=f"one token for each of {floor} sequences (--max-num-seqs) takes ~{step_s:.1f} s a step, "
            f"over the {target_s:g} s target; lower --max-num-seqs for shorter steps",
        )
    return budget


def size_token_budget(
    engine: Engine,
    floor: int,
    fit: bool,
    heartbeat_timeout_s: float | None = None,
    probe: Probe = probe_step_cost,
) -> TokenBudget:
    """Probe the engine's step cost, choose the budget (`choose_token_budget`) and log what a step costs."""
    ceiling = engine.config.max_num_batched_tokens
    cost = probe(engine, step_target_s(heartbeat_timeout_s), ceiling)
    budget = choose_token_budget(cost, ceiling, fit, floor, heartbeat_timeout_s)
    logger.info(
        "%s",
        budget.describe(),
        extra={
            "event": "step cost",
            "fixed_ms": budget.cost.fixed_s * 1e3,
            "per_token_ms": budget.cost.per_token_s * 1e3,
            "token_budget": budget.tokens,
            "fitted": budget.fitted,
            "target_s": budget.target_s,
        },
    )
    return budget
