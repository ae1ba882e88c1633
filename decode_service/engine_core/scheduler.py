"""The iteration-level batcher: decides, before every forward, who runs and with how many tokens.

Each step: every running sequence gets one decode token (or, after its grammar forced some text, those
tokens and the one after them), growing its block table and preempting by policy when the pool is dry;
then new requests are admitted in policy order while slots and blocks last (their prompt blocks reserved,
handed to the prefill stage); then prefill chunks fill what is left of the token budget. After the
forward, finished sequences free their blocks at once, so the next step's admission already sees them.

The prefill stage is how an admitted request's prompt KV gets into the blocks reserved for it: when
the stage has computed the whole history (prompt, plus tokens generated before a preemption) and the
next token is sampled, the request joins the decode batch. In aggregated mode it is local chunked
prefill mixed into the decode iterations (`LocalPrefillStage`). A remote stage
(`remote_prefill.stage.RemotePrefillStage`: a `Prefill` stream writing KV into the same reserved
blocks) computes outside the step: it reports each finished prompt through `collect`, and wakes the
engine thread when it has news.

`StaticScheduler` is the baseline continuous batching is measured against: it fills a batch (or waits
a timeout), reserves every member's full length, and admits nothing until the whole batch is done.

The scheduler is single-threaded: only the engine loop thread calls it.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from base.errors import ConfigError, InvalidRequestError
from decode_service.engine_core.config import SchedulerConfig
from decode_service.engine_core.policies import Rank, SchedulingPolicy
from decode_service.engine_core.request import RequestState, ServedRequest, StreamDelta, TokenLogprobs
from decode_service.engine_core.step_record import ChunkKind
from engine.engine import Engine, TokenOutput
from engine.model_runner import ScheduledChunk
from engine.sampler import SEED_MASK
from engine.sequence import Sequence

logger = logging.getLogger(__name__)


StageFailure = tuple[ServedRequest, Exception]

# The step cost model of `prefills_for_least_ttft`, in units of one prompt token's prefill on a CPU: a step
# costs about STEP_COST_TOKENS whatever it runs (reading every weight once, the step's own Python), and
# each decode row about DECODE_ROW_TOKENS (attention over its whole context, a GEMM's rows at a size where
# it runs below its peak). bench/README.md ("Prompts arriving together") has the measurements.
STEP_COST_TOKENS = 12.0
DECODE_ROW_TOKENS = 1.5


def prefills_for_least_ttft(num_prompts: int, uncomputed_tokens: int, decode_rows: int) -> int:
    """How many of `num_prompts` prompts waiting for prefill (`uncomputed_tokens` in all) one step should
    take, beside `decode_rows` decode rows, for the least mean time to their first tokens.

    Prefilling k of n prompts of p tokens each step ends them after n/k steps of cost c + k·p each, where
    c is what a step costs besides its prompts (its fixed part and its decode rows); the mean of those end
    times, (c + k·p)(n/k + 1)/2, is least at k = sqrt(n·c/p). So prompts that arrive together with little
    else running go one per step (each step costs little beyond its prompt, and the first answer starts
    early), and prompts beside many decode rows share steps (an extra step would cost every row again).
    """
    if num_prompts <= 1:
        return 1
    mean_tokens = max(uncomputed_tokens / num_prompts, 1.0)
    step_cost = STEP_COST_TOKENS + DECODE_ROW_TOKENS * decode_rows
    return max(1, round(math.sqrt(num_prompts * step_cost / mean_tokens)))


class PrefillStage(ABC):
    """Requests whose KV is being computed, in the order they were admitted."""

    def __init__(self) -> None:
        self._requests: list[ServedRequest] = []

    @property
    def requests(self) -> list[ServedRequest]:
        return list(self._requests)

    def __len__(self) -> int:
        return len(self._requests)

    def start(self, request: ServedRequest) -> None:
        """Begin prefilling an admitted request (its blocks are already reserved)."""
        self._requests.append(request)

    def remove(self, request: ServedRequest) -> None:
        """Forget a request: its prefill completed, or it was preempted or aborted."""
        self._requests.remove(request)

    @abstractmethod
    def plan_chunks(self, token_budget: int) -> list[ScheduledChunk]:
        """Chunks to run in this step's forward, using at most `token_budget` tokens."""

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        """How a stage that computes outside the step wakes an idle engine thread (thread-safe callable)."""
        return

    def collect(self) -> tuple[list[TokenOutput], list[StageFailure]]:
        """Prompts finished outside the step since the last call: their first tokens (already appended,
        `num_computed_tokens` at the full history), and the requests that cannot be prefilled."""
        return [], []


def plan_local_chunks(requests: Iterable[ServedRequest], token_budget: int) -> list[ScheduledChunk]:
    """Chunks of local prefill, oldest admitted first, until the budget is spent."""
    chunks = []
    for request in requests:
        if token_budget <= 0:
            break
        take = min(request.seq.num_uncomputed_tokens, token_budget)
        chunks.append(ScheduledChunk(request.seq, take))
        token_budget -= take
    return chunks


class LocalPrefillStage(PrefillStage):
    """Chunked prefill on this replica: prompt chunks share each step's token budget with decodes.

    Requests are served in admission order, so the oldest admitted prompt finishes first and joins
    the decode batch soonest; a long prompt takes as many steps as its length needs, never stalling
    the decodes that run next to it.
    """

    def plan_chunks(self, token_budget: int) -> list[ScheduledChunk]:
        return plan_local_chunks(self._requests, token_budget)


@dataclass
class StepPlan:
    """One step's work: the chunks of the forward, what kind each is, and who was preempted for it."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    kinds: list[ChunkKind] = field(default_factory=list)
    preempted: list[ServedRequest] = field(default_factory=list)

    def add(self, chunk: ScheduledChunk, kind: ChunkKind) -> None:
        self.chunks.append(chunk)
        self.kinds.append(kind)


class ContinuousScheduler:
    """Continuous batching with chunked prefill, policy-ordered admission and preemption."""

    # Whether `--max-prefills-per-step auto` chooses each step's prefills (`prefills_for_least_ttft`).
    chooses_prefills = True

    def __init__(
        self,
        engine: Engine,
        policy: SchedulingPolicy,
        config: SchedulerConfig,
        prefill_stage: PrefillStage | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.policy = policy
        self.config = config
        # Not `or`: a stage is falsy while it holds no request.
        self.prefill_stage = prefill_stage if prefill_stage is not None else LocalPrefillStage()
        self.clock = clock
        self.max_num_seqs = engine.config.max_num_seqs
        self.token_budget = 0
        self.set_token_budget(engine.config.max_num_batched_tokens)
        self.watermark_blocks = int(config.admission_watermark * engine.num_blocks)
        # `auto` chooses the prefills of each step on a CPU only: on a GPU a prefill token costs little
        # beside a step's fixed cost, and batching prompts raises the kernels' arithmetic intensity.
        self._auto_prefills = (
            self.chooses_prefills and config.max_prefills_per_step is None and engine.device.type == "cpu"
        )
        # Sliding-window groups take a local prefill's blocks chunk by chunk (`Engine.admit`).
        manager = engine.block_manager
        self._grows_chunks = manager.num_groups > 1 and manager.sliding
        self.waiting: list[ServedRequest] = []
        self.running: list[ServedRequest] = []
        self.num_preemptions = 0
        # request_id -> its live choices (one unless the request asked for n > 1).
        self._live: dict[str, list[ServedRequest]] = {}
        self._next_arrival_index = 0

    def set_token_budget(self, tokens: int) -> None:
        """Tokens each step may compute from now on: the configured budget, or the one fitted to the step
        cost measured at start (`engine.step_cost`), set before any request is admitted."""
        if tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({tokens}) must be >= max_num_seqs ({self.max_num_seqs}) "
                "so that every running sequence gets its token each step"
            )
        self.token_budget = tokens

    # -- bookkeeping ---------------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self._live)

    @property
    def prefilling(self) -> list[ServedRequest]:
        return self.prefill_stage.requests

    def live_request_ids(self) -> list[str]:
        return list(self._live)

    def add(self, request: ServedRequest) -> None:
        """Queue a validated request; it holds no blocks until admitted."""
        if request.request_id in self._live:
            raise InvalidRequestError(f"request_id {request.request_id!r} is already live")
        if request.arrival_time is None:
            request.arrival_time = self.clock()
        request.arrival_index = self._next_arrival_index
        self._next_arrival_index += 1
        request.state = RequestState.WAITING
        request.expected_cached_tokens = self.engine.cached_prefix_tokens(request.seq)
        self._live[request.request_id] = [request]
        self.waiting.append(request)
        self.policy.on_enqueued(request)

    def abort(self, request_id: str) -> list[ServedRequest]:
        """Remove every live choice of a request wherever it is and free its blocks; returns them."""
        choices = list(self._live.get(request_id, ()))
        for request in choices:
            request.seq.abort()
            self._finish(request)
        return choices

    def stop_at_string(self, request_id: str, index: int, stop: str) -> ServedRequest | None:
        """End choice `index` of a request whose text reached stop string `stop` (the front door matched
        it) and free its blocks; returns it, or None when it had already ended."""
        choice = next((r for r in self._live.get(request_id, ()) if r.index == index), None)
        if choice is not None:
            choice.seq.stop_at_string(stop)
            self._finish(choice)
        return choice

    def _choice_of(self, seq: Sequence) -> ServedRequest | None:
        """The live request (choice) that runs `seq`."""
        choices = self._live.get(seq.request_id, ())
        if len(choices) == 1:  # n == 1, the common case: skip the generator
            return choices[0] if choices[0].seq is seq else None
        return next((r for r in choices if r.seq is seq), None)

    def idle_wait_seconds(self) -> float | None:
        """How long the loop may sleep for new input when `schedule` found nothing to run (None: forever)."""
        return None

    # -- ranking -------------------------------------------------------------------------------------

    def _rank(self, request: ServedRequest, now: float) -> tuple[int, Rank]:
        """Policy rank, behind a thrash guard: requests preempted too often go first."""
        protected = request.num_preemptions >= self.config.max_preemptions
        return (0 if protected else 1, self.policy.rank(request, now))

    # -- planning ------------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plan the next step: decodes first, then admissions, then prefill chunks, within the budget."""
        now = self.clock()
        plan = StepPlan()
        budget = self._schedule_decodes(plan, now)
        if not plan.preempted:
            self._admit(now)
        # Prompts admitted together that share a prefix: each reuses what the ones before it computed, and
        # the budget it no longer needs goes to the next prompt (which may catch up in turn).
        while True:
            chunks = self.prefill_stage.plan_chunks(budget)
            if len(chunks) > 1:  # a step with one prompt or none, the usual decode step, needs no cap
                chunks = chunks[: self._max_prefills(len(plan.chunks))]
            if not sum([self.engine.catch_up_prefix(chunk.seq) for chunk in chunks]):
                break
        for chunk in chunks:
            if self._grows_chunks:
                self.engine.allocate(chunk.seq, chunk.seq.num_computed_tokens + chunk.num_tokens)
            plan.add(chunk, "prefill")
        return plan

    def _max_prefills(self, decode_rows: int) -> int | None:
        """The most prompts this step may prefill (None: as many as the token budget holds)."""
        if self._auto_prefills:
            # Every prompt this replica prefills itself, whole: a remote stage's transfers take no step.
            pending = self.prefill_stage.plan_chunks(sys.maxsize)
            return prefills_for_least_ttft(len(pending), sum(c.num_tokens for c in pending), decode_rows)
        return self.config.max_prefills_per_step or None

    def _schedule_decodes(self, plan: StepPlan, now: float) -> int:
        """Give each running sequence its uncomputed tokens (one, unless a grammar forced more), most urgent
        first; returns the budget left."""
        budget = self.token_budget
        engine = self.engine
        scheduled: set[ServedRequest] = set()
        batch = len(self.running)
        speculate = engine.speculative.enabled and batch <= engine.speculative.disable_by_batch_size
        for request in sorted(self.running, key=lambda r: self._rank(r, now)):
            if request.state is not RequestState.RUNNING or budget == 0:
                continue
            seq = request.seq
            needed = seq.num_tokens
            # Most steps the blocks already hold the next token (one comparison); else make room.
            if not engine.holds_slots(seq, needed) and not self._make_room(
                request, needed, scheduled, plan, now
            ):
                continue
            # One token, or a grammar's forced tokens (jump-forward) and the one after them.
            take = min(seq.num_uncomputed_tokens, budget)
            draft = self._draft(seq, budget - take, batch) if speculate and take == 1 else ()
            plan.add(ScheduledChunk(seq, take, draft), "decode")
            scheduled.add(request)
            budget -= take + len(draft)
        return budget

    def _draft(self, seq: Sequence, budget: int, batch: int) -> tuple[int, ...]:
        """Draft tokens for a decoding sequence among `batch`, their slots allocated; none when the pool
        would have to give up blocks for them (a guess never preempts anyone)."""
        draft = self.engine.propose_draft(seq, budget, batch)
        if not draft:
            return draft
        needed = seq.num_tokens + len(draft)
        if self.engine.holds_slots(seq, needed):
            return draft
        if not self.engine.can_allocate(seq, needed):
            return ()
        self.engine.allocate(seq, needed)
        return draft

    def _make_room(
        self, request: ServedRequest, needed: int, scheduled: set[ServedRequest], plan: StepPlan, now: float
    ) -> bool:
        """Allocate blocks for `needed` tokens of `request`, preempting less urgent requests not yet
        scheduled this step; False when `request` itself was the one preempted."""
        while not self.engine.can_allocate(request.seq, needed):
            victim = self._pick_victim(request, scheduled, now)
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is request:
                return False
        self.engine.allocate(request.seq, needed)
        return True

    def _pick_victim(self, needy: ServedRequest, scheduled: set[ServedRequest], now: float) -> ServedRequest:
        """The least urgent request holding blocks that this step has not already scheduled."""
        candidates = [r for r in self.running if r not in scheduled] + self.prefill_stage.requests
        return max(candidates, key=lambda r: self._rank(r, now), default=needy)

    def _preempt(self, request: ServedRequest) -> None:
        """Free a request's blocks and requeue it; it recomputes its prompt and outputs when readmitted."""
        if request.state is RequestState.RUNNING:
            self.running.remove(request)
        else:
            self.prefill_stage.remove(request)
        self.engine.free(request.seq)
        request.state = RequestState.WAITING
        request.expected_cached_tokens = self.engine.cached_prefix_tokens(request.seq)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(request)
        logger.debug("preempted %s (%d times)", request.request_id, request.num_preemptions)

    def _admission_open(self, now: float) -> bool:
        return True

    def _reserved_tokens(self, request: ServedRequest) -> int:
        """Tokens to reserve blocks for at admission: the known history (prompt + outputs so far)."""
        return request.seq.num_tokens

    def _admission_blocks(self, request: ServedRequest) -> int:
        """Free blocks admitting `request` consumes: its history's, a sliding group's only up to the most
        a prefill chunk and its window hold (`Engine.admit`)."""
        return self.engine.admission_blocks(request.seq, self._reserved_tokens(request), self.token_budget)

    def _reserve(self, request: ServedRequest) -> None:
        self.engine.admit(request.seq, self._reserved_tokens(request), self.token_budget)

    def _admit(self, now: float) -> None:
        """Admit waiting requests in policy order while slots and blocks last; stop at the first misfit.

        Stopping (rather than skipping to a smaller request) keeps the policy's order honest: a big
        request at the head is not overtaken forever by small ones.
        """
        if not self.waiting or not self._admission_open(now):
            return
        engine = self.engine
        while self.waiting and len(self.running) + len(self.prefill_stage) < self.max_num_seqs:
            request = min(self.waiting, key=lambda r: self._rank(r, now))
            needed = self._admission_blocks(request)
            busy = bool(self.running) or len(self.prefill_stage) > 0
            reserve = self.watermark_blocks if busy else 0
            if needed + reserve > engine.num_free_blocks:
                break
            self.waiting.remove(request)
            self._reserve(request)
            request.state = RequestState.PREFILLING
            if request.admitted_time is None:
                request.admitted_time = now
            self.policy.on_admitted(request)
            self.prefill_stage.start(request)

    # -- after the forward ---------------------------------------------------------------------------

    def complete_step(self, outputs: list[TokenOutput]) -> list[StreamDelta]:
        """Turn the step's sampled tokens into stream deltas; free finished sequences right away.

        A request whose bookkeeping raises ends with that error (INTERNAL) and its blocks freed, as does
        one the engine could not go on with (`out.error`, its grammar's dead end); the others in the step
        go on.
        """
        now = self.clock()
        deltas = []
        for out in outputs:
            request = self._choice_of(out.seq)
            if request is None:
                continue
            if out.error is not None:
                deltas.append(self._fail(request, out.error))
                continue
            try:
                deltas.append(self._complete_one(request, out, now))
            except Exception as exc:
                logger.exception("completing a step of %s failed; ending it", request.request_id)
                deltas.append(self._fail(request, exc))
        return deltas

    def _complete_one(self, request: ServedRequest, out: TokenOutput, now: float) -> StreamDelta:
        if request.state is RequestState.PREFILLING:
            self.prefill_stage.remove(request)
            request.state = RequestState.RUNNING
            self.running.append(request)
            if request.prefill_done_time is None:
                request.prefill_done_time = now
            if request.n > 1 and not request.forked:
                self._fork_choices(request, now)
        if request.first_token_time is None:
            request.first_token_time = now
        self.policy.on_token_generated(request)
        logprobs = []
        if request.seq.sampling.logprobs > 0:
            logprobs.extend(TokenLogprobs(*kept) for kept in out.accepted_drafts)
            logprobs.append(TokenLogprobs(out.token_id, out.logprob, out.top_logprobs))
        if out.accepted_drafts or out.forced_token_ids:
            token_ids = out.token_ids
        else:
            token_ids = [out.token_id]
        delta = StreamDelta(request, token_ids, logprobs, out.finish_reason)
        if out.finish_reason is not None:
            self._finish(request)
        return delta

    def fail_all(self, error: Exception) -> list[StreamDelta]:
        """Scheduling itself failed, so no request's state can be trusted: end every live one with the
        error and free its blocks, leaving a clean scheduler for the requests that come next."""
        return [
            self._fail(request, error) for choices in list(self._live.values()) for request in list(choices)
        ]

    def _fail(self, request: ServedRequest, error: Exception) -> StreamDelta:
        """End one request with `error`; its blocks are freed even if its bookkeeping is inconsistent."""
        request.seq.abort()
        try:
            self._finish(request)
        except Exception:
            logger.exception("finishing %s failed; dropping it", request.request_id)
            for queue in (self.waiting, self.running):
                if request in queue:
                    queue.remove(request)
            if request in self.prefill_stage.requests:
                self.prefill_stage.remove(request)
            self.engine.free(request.seq)
            choices = self._live.get(request.request_id, [])
            if request in choices:
                choices.remove(request)
            if not choices:
                self._live.pop(request.request_id, None)
            request.state = RequestState.FINISHED
        return StreamDelta(request, error=error)

    def complete_prefills(self) -> list[StreamDelta]:
        """Prompts the prefill stage finished outside the step (remote prefill) join the batch now;
        those it could not prefill end with their error, freeing their blocks."""
        outputs, failures = self.prefill_stage.collect()
        deltas = self.complete_step(outputs) if outputs else []
        for request, error in failures:
            request.seq.abort()
            self._finish(request)
            deltas.append(StreamDelta(request, error=error))
        return deltas

    def fail_step(self, plan: StepPlan, error: Exception) -> list[StreamDelta]:
        """The forward failed: end every request in it with the error, freeing its blocks."""
        requests = (self._choice_of(chunk.seq) for chunk in plan.chunks)
        return [self._fail(request, error) for request in requests if request is not None]

    def _finish(self, request: ServedRequest) -> None:
        if request.state is RequestState.WAITING:
            self.waiting.remove(request)
        elif request.state is RequestState.PREFILLING:
            self.prefill_stage.remove(request)
        elif request.state is RequestState.RUNNING:
            self.running.remove(request)
        self.engine.free(request.seq)
        request.state = RequestState.FINISHED
        choices = self._live[request.request_id]
        choices.remove(request)
        if not choices:
            del self._live[request.request_id]
        self.policy.on_finished(request)

    def _fork_choices(self, request: ServedRequest, now: float) -> None:
        """Start choices 1..n-1 of a request whose prompt was just prefilled (choice 0 has its first token).

        Each shares the prompt's KV and joins the decode batch at once while seats and blocks last;
        the rest wait with no blocks and are prefilled like preempted requests. With a seed, choice i
        samples with seed + i, so the choices differ yet stay reproducible.
        """
        request.forked = True
        for index in range(1, request.n):
            sampling = request.seq.sampling
            if sampling.seed is not None:
                sampling = replace(sampling, seed=(sampling.seed + index) & SEED_MASK)
            seats = self.max_num_seqs - len(self.running) - len(self.prefill_stage)
            share = seats > 0 and self.engine.num_free_blocks > self.watermark_blocks
            child = ServedRequest(
                self.engine.fork(request.seq, sampling, share_kv=share),
                priority=request.priority,
                tenant=request.tenant,
                arrival_time=request.arrival_time,
                arrival_index=request.arrival_index,
                admitted_time=request.admitted_time if share else None,
                prefill_done_time=now if share else None,
                n=request.n,
                index=index,
                parent=request,
                forked=True,
            )
            self._live[request.request_id].append(child)
            self.policy.on_enqueued(child)
            if share:
                child.state = RequestState.RUNNING
                self.running.append(child)
            else:
                self.waiting.append(child)


class StaticScheduler(ContinuousScheduler):
    """Static batching: fill a batch (or wait `static_batch_timeout_s`), run it to its longest member.

    Every member's blocks are reserved for prompt + max_tokens up front, as static batching does, so a
    batch never needs preemption; slots freed by early finishers stay empty until the batch ends.
    The baseline prefills its batch as the token budget packs it, whatever `auto` would choose.
    """

    chooses_prefills = False

    def _batch_in_flight(self) -> bool:
        return bool(self.running) or len(self.prefill_stage) > 0

    def _admission_open(self, now: float) -> bool:
        if self._batch_in_flight():
            return False
        if len(self.waiting) >= self.max_num_seqs:
            return True
        oldest = min(r.arrival_time for r in self.waiting)
        return now - oldest >= self.config.static_batch_timeout_s

    def _reserved_tokens(self, request: ServedRequest) -> int:
        return request.seq.num_prompt_tokens + request.seq.stopping.max_tokens

    def _admission_blocks(self, request: ServedRequest) -> int:
        return self.engine.blocks_needed(request.seq, self._reserved_tokens(request))

    def _reserve(self, request: ServedRequest) -> None:
        self.engine.allocate(request.seq, self._reserved_tokens(request))

    def idle_wait_seconds(self) -> float | None:
        if not self.waiting or self._batch_in_flight():
            return None
        oldest = min(r.arrival_time for r in self.waiting)
        return max(0.0, oldest + self.config.static_batch_timeout_s - self.clock())
