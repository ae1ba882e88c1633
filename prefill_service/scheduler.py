"""The chunked-prefill scheduler: FIFO admission into a paged pool, and a per-step token budget.

Prefill is compute-bound, so each step packs as many prompt tokens as the budget allows, taking
chunks from several prompts, oldest admitted first: short prompts ride along with the tail of a long
one instead of each paying for its own forward. A prompt is admitted only when blocks for all of its
tokens are free (in a sliding-window group: for the most a chunk and its window hold, taken chunk by
chunk from what admission reserved, `Engine.admit`), so admitted prompts never wait on each other for
memory and none ever deadlocks.

A prompt whose KV is computed keeps its blocks until its stream has sent them (or failed, or was
cancelled): only `release`, called once the stream is over, frees them. Everything here runs on the
engine thread.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.engine import Engine, TokenOutput
from engine.model_runner import ScheduledChunk
from prefill_service.job import JobEvent, KVReady, PrefillFailed, PrefillFinished, PrefillJob

JobEvents = list[tuple[PrefillJob, JobEvent]]

logger = logging.getLogger(__name__)


@dataclass
class StepPlan:
    """One forward: `chunks[i]` belongs to `jobs[i]`; `admitted` left the queue for this step."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    jobs: list[PrefillJob] = field(default_factory=list)
    admitted: list[PrefillJob] = field(default_factory=list)
    # Jobs whose admission or chunk planning raised: they fail alone, the step goes on without them.
    failed: JobEvents = field(default_factory=list)


class ChunkedPrefillScheduler:
    """Owns the queue and the prompts in progress of one prefill engine (engine thread only)."""

    def __init__(
        self,
        engine: Engine,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        self.engine = engine
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self._clock = clock
        self.waiting: deque[PrefillJob] = deque()
        self.running: list[PrefillJob] = []
        # Computed or failed, blocks still reserved until the job's stream is over.
        self.held: dict[int, PrefillJob] = {}
        # Sliding-window groups take their blocks chunk by chunk; one group holds the prompt's from admission.
        self._grows_chunks = engine.block_manager.num_groups > 1 and engine.block_manager.sliding

    @property
    def has_work(self) -> bool:
        """True when a job is queued or prefilling (a step may run now or once blocks come back)."""
        return bool(self.waiting or self.running)

    def can_step(self) -> bool:
        """True when the next `schedule` would run something: a prompt in progress, or one it can admit."""
        return bool(self.running) or (bool(self.waiting) and self._can_admit_head())

    def _can_admit_head(self) -> bool:
        return len(self.running) < self.max_num_seqs and self.engine.can_admit(
            self.waiting[0].seq, self.waiting[0].num_prompt_tokens, self.max_num_batched_tokens
        )

    def add(self, job: PrefillJob) -> None:
        """Queue a validated job at the back (FIFO)."""
        self.waiting.append(job)

    def release(self, job: PrefillJob) -> str | None:
        """Forget a job wherever it is and free its blocks; returns where it was, None if unknown.

        Called when the job's stream is over: done, cancelled by the caller, past its deadline or
        failed. A cancelled job still prefilling simply runs no further step.
        """
        where: str | None = None
        if job in self.waiting:
            self.waiting.remove(job)
            where = "waiting"
        elif job in self.running:
            self.running.remove(job)
            where = "running"
        elif self.held.pop(job.key, None) is not None:
            where = "held"
        if job.seq.block_table:
            self.engine.free(job.seq)
        return where

    def schedule(self) -> StepPlan:
        """Admit what fits (FIFO, whole prompts), then fill the token budget, oldest prompts first, growing
        sliding-window groups by each chunk."""
        plan = StepPlan()
        now = self._clock()
        while self.waiting and self._can_admit_head():
            job = self.waiting.popleft()
            self.running.append(job)
            try:
                self.engine.admit(job.seq, job.num_prompt_tokens, self.max_num_batched_tokens)
            except Exception as exc:
                self._fail_alone(plan, job, exc)
                continue
            job.admitted_time = now
            plan.admitted.append(job)
        budget = self.max_num_batched_tokens
        for job in list(self.running):
            if budget == 0:
                break
            try:
                take = self._plan_chunk(job, budget)
            except Exception as exc:
                self._fail_alone(plan, job, exc)
                continue
            plan.chunks.append(ScheduledChunk(job.seq, take))
            plan.jobs.append(job)
            budget -= take
            if job.first_step_time is None:
                job.first_step_time = now
        return plan

    def _plan_chunk(self, job: PrefillJob, budget: int) -> int:
        """The tokens `job` computes this step, its blocks grown to hold them."""
        # A prompt admitted beside one sharing its prefix reuses what that one computed meanwhile.
        self.engine.catch_up_prefix(job.seq)
        take = min(job.seq.num_uncomputed_tokens, budget)
        if self._grows_chunks:
            self.engine.allocate(job.seq, job.seq.num_computed_tokens + take)
        return take

    def _fail_alone(self, plan: StepPlan, job: PrefillJob, error: Exception) -> None:
        """Scheduling `job` raised (a bug, not a full pool): it fails with that error, its blocks held
        until its stream is over, and the other jobs and later steps go on as if it never came."""
        logger.exception("scheduling %s failed; failing it alone", job.seq.request_id)
        plan.failed.append((job, self._fail(job, error)))

    def complete_step(self, plan: StepPlan, outputs: list[TokenOutput], ready: object | None) -> JobEvents:
        """The events of a step that ran: blocks each chunk completed, and first tokens of finished prompts.

        Full blocks are sent as soon as a chunk completes them; a prompt's last, partial block goes
        with its final chunk. `ready` (a CUDA event or None) travels with the KV so the sender can wait
        for the writes.
        """
        sampled = {id(output.seq): output for output in outputs}
        now = self._clock()
        events: JobEvents = []
        for job in plan.jobs:
            output = sampled.get(id(job.seq))
            kv = self._newly_complete_blocks(job, finished=output is not None, ready=ready)
            if kv is not None:
                events.append((job, kv))
            if output is not None:
                self.running.remove(job)
                self.held[job.key] = job
                events.append((job, self._finished(job, output, now)))
        return events

    def fail_step(self, plan: StepPlan, error: Exception) -> JobEvents:
        """A step raised: every job in it fails (its blocks stay held until its stream is over)."""
        return [(job, self._fail(job, error)) for job in plan.jobs]

    def fail_all(self, error: Exception) -> JobEvents:
        """Fail every job not yet computed (the server is stopping)."""
        jobs = [*self.waiting, *self.running]
        self.waiting.clear()
        return [(job, self._fail(job, error)) for job in jobs]

    def _fail(self, job: PrefillJob, error: Exception) -> PrefillFailed:
        if job in self.running:
            self.running.remove(job)
            self.held[job.key] = job
        return PrefillFailed(error)

    def _newly_complete_blocks(self, job: PrefillJob, finished: bool, ready: object | None) -> KVReady | None:
        block_size = self.engine.block_size
        computed = job.seq.num_computed_tokens
        end = -(-computed // block_size) if finished else computed // block_size
        if end <= job.num_blocks_streamed:
            return None
        event = KVReady(
            job.num_blocks_streamed,
            end - job.num_blocks_streamed,
            job.num_prompt_tokens,
            tuple(tuple(table) for table in job.seq.block_tables),
            ready,
        )
        job.num_blocks_streamed = end
        return event

    @staticmethod
    def _finished(job: PrefillJob, output: TokenOutput, now: float) -> PrefillFinished:
        admitted = job.admitted_time if job.admitted_time is not None else job.arrival_time
        first_step = job.first_step_time if job.first_step_time is not None else admitted
        return PrefillFinished(
            token_id=output.token_id,
            logprob=output.logprob,
            top_logprobs=tuple(output.top_logprobs),
            queue_seconds=max(0.0, admitted - job.arrival_time),
            prefill_seconds=max(0.0, now - first_step),
        )
