"""A request as the decode tier serves it: the engine's `Sequence` plus what scheduling and streaming need.

The engine only knows tokens and blocks. Priority, tenant, arrival order, preemption count and the
timings reported to the client belong to the tier that owns the queue, so they live here. These are
the core's own objects: the front door never sees them, only the `engine_core.messages` made of them
(`core`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from decode_service.engine_core.messages import GrammarSource
from engine.sequence import FinishReason, Sequence


class RequestState(enum.Enum):
    """Where a request is in the decode tier's pipeline.

    WAITING: queued, holds no blocks. PREFILLING: admitted, its prompt blocks are reserved and its KV
    is being computed (locally, or by a prefill tier). RUNNING: in the decode batch, one token
    per step. FINISHED: done or aborted, holds no blocks.
    """

    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class ServedRequest:
    """One live request of the decode tier (identity equality: two requests are never 'equal')."""

    seq: Sequence
    priority: int = 0
    tenant: str = ""
    # Monotonic seconds; the edge stamps it on receipt, else the scheduler does when the request is added.
    arrival_time: float | None = None
    state: RequestState = RequestState.WAITING
    # Set by the scheduler when the request is added: a total order of arrivals for FIFO ties.
    arrival_index: int = -1
    num_preemptions: int = 0
    admitted_time: float | None = None
    prefill_done_time: float | None = None
    first_token_time: float | None = None
    # Choices the client asked for. The scheduler forks choices 1..n-1 off this one (choice 0) once its
    # prompt is prefilled, so they share its prompt KV; `forked` says that happened.
    n: int = 1
    index: int = 0
    parent: ServedRequest | None = None
    forked: bool = False
    # While WAITING: the history tokens the prefix cache held when the request was queued, so that
    # ranking charges only the tokens admission would actually compute (an estimate: blocks may be
    # evicted before admission). Set by the scheduler at enqueue and at preemption.
    expected_cached_tokens: int = 0
    # The front door's number for this submission when the core runs in a process of its own: echoed
    # in every delta, so a delta never reaches a newer request that reused the id (`engine_core.core_client`).
    submission: int = 0
    # The constraint its answer is held to, compiled where the engine runs before the request reaches the
    # scheduler (`engine_core.grammar_gate`), which sets `seq.grammar`; None: unconstrained.
    grammar: GrammarSource | None = None
    # The W3C trace context of the front door's span for this request; None when tracing is off.
    traceparent: str | None = None

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def stream_owner(self) -> ServedRequest:
        """Choice 0, whose stream every choice's deltas go to."""
        return self.parent if self.parent is not None else self

    @property
    def estimated_remaining_tokens(self) -> int:
        """Tokens still to compute if it runs to max_tokens: uncomputed history (less what the prefix
        cache is expected to serve, while waiting) plus ungenerated output."""
        left_to_generate = self.seq.stopping.max_tokens - self.seq.num_output_tokens
        cached = self.expected_cached_tokens if self.state is RequestState.WAITING else 0
        return self.seq.num_uncomputed_tokens - cached + max(0, left_to_generate)


@dataclass
class TokenLogprobs:
    """Logprob of one generated token and the top alternatives, as the API reports them."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class StreamDelta:
    """What one engine step produced for one request: the tokens its stream sends next (the front door
    makes their text).

    A delta with `finish_reason` set is the last one. `error` is set instead when the engine failed
    on this request; the stream then ends with an error status.
    """

    request: ServedRequest
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: Exception | None = None

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None or self.error is not None
