"""What crosses between the front door and an engine core in a process of its own, as msgpack.

In: one `Commands` per batch of submissions, aborts, stop-string stops and heartbeat `Ping`s (whatever
the event loop gathered since its last flush). Out: one `StepOut` per engine step carrying every
request's new tokens and the core's live counters, a `Pong` per `Ping`, plus `Ready` or `StartFailed`
once at start. msgspec encodes them as arrays of plain values; nothing is pickled, so a message can
carry no code.

Each submission carries a `submission` number the front door gave it; the core echoes it in every
delta, so a delta is routed to the request that was submitted, never to a newer one that reused its id.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from engine.params import SamplingParams, StoppingParams


class GrammarSource(msgspec.Struct, array_like=True, frozen=True):
    """A constraint the front door parsed, as the engine's process compiles it before the request is
    scheduled: xgrammar kind and source, and the request field a refusal names."""

    kind: str
    source: str
    field: str
    # Token after which the grammar applies (a reasoning model's end of thinking); None: at once.
    activate_after: int | None
    # Whether JSON kinds also forbid the tokenizer's control tokens.
    control_free: bool


class Submit(msgspec.Struct, tag="submit", array_like=True):
    submission: int
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stopping: StoppingParams
    cache_salt: str
    grammar: GrammarSource | None
    priority: int
    tenant: str
    arrival_time: float | None
    n: int
    # The front door's request span as a W3C `traceparent`, so the core's spans join its trace; None
    # when tracing is off (`serving.tracing`).
    traceparent: str | None = None


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_id: str


class StopAt(msgspec.Struct, tag="stop_at", array_like=True):
    """The front door matched stop string `stop` in choice `index`'s text."""

    request_id: str
    index: int
    stop: str


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Abort what is live (each request gets its final ABORT delta), then exit."""


class Ping(msgspec.Struct, tag="ping", array_like=True):
    """The front door's heartbeat: the core's engine loop answers `Pong(number)` on its next iteration,
    so an answer proves the loop still steps, not only that the command thread reads."""

    number: int


Command = Submit | Abort | StopAt | Shutdown | Ping


class Commands(msgspec.Struct, array_like=True):
    commands: list[Command]


class Failure(msgspec.Struct, array_like=True, frozen=True):
    """An error the core met on a request: the gRPC status it maps to, and the message for the caller."""

    code: str
    message: str
    # The request field at fault, where the error names one (`ConstraintError.field`).
    field: str | None = None


class ChoiceState(msgspec.Struct, array_like=True):
    """One choice's state as the core last saw it, for the front door's usage, timings and logs
    (timings are monotonic seconds: both processes read the same clock)."""

    num_cached_tokens: int
    matched_stop: int | str | None
    admitted_time: float | None
    prefill_done_time: float | None
    first_token_time: float | None
    num_preemptions: int
    forked: bool


class Delta(msgspec.Struct, array_like=True):
    submission: int
    index: int
    token_ids: list[int]
    # (token id, logprob, [(alternative id, its logprob), ...]) per token, when asked for.
    logprobs: list[tuple[int, float, list[tuple[int, float]]]]
    finish_reason: str | None
    error: Failure | None
    # Only on a choice's first and last deltas, the ones whose readers need it (time to first token,
    # usage, timings, stop, the finish log): the steps between carry tokens alone.
    state: ChoiceState | None


class CoreStats(msgspec.Struct, array_like=True):
    """The core's live counters, read at each step; the front door's metrics export the latest."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_transfer_bytes: int = 0
    remote_prefills_completed: int = 0
    kv_transfer_seconds: float = 0.0
    kv_blocks_skipped: int = 0
    kv_transfer_failures: int = 0
    local_prefills: int = 0
    remote_prefills_failed: int = 0
    prefill_retries: int = 0
    prefill_local_fallbacks: int = 0
    # Speculative decoding (`engine.speculation.SpeculationStats`).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = msgspec.field(default_factory=list)
    # KV event batches sent, and dropped on a full queue (`engine.kv_event_publisher`).
    kv_events_published: int = 0
    kv_events_dropped: int = 0


class StepOut(msgspec.Struct, tag="step", array_like=True):
    deltas: list[Delta]
    stats: CoreStats
    # Seconds each step since the last message spent filling grammar masks (only steps that masked).
    grammar_fill_seconds: list[float]
    # Seconds of each grammar compile the core ran since the last message.
    grammar_compile_seconds: list[float] = msgspec.field(default_factory=list)


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """The core loaded its model and ran its warm-up forward."""


class StartFailed(msgspec.Struct, tag="start_failed", array_like=True):
    """The core could not start (model load, warm-up); the server exits naming it."""

    message: str


class Pong(msgspec.Struct, tag="pong", array_like=True):
    """The engine loop's answer to `Ping(number)`."""

    number: int


CoreMessage = StepOut | Ready | StartFailed | Pong

command_encoder = msgspec.msgpack.Encoder()
commands_decoder = msgspec.msgpack.Decoder(Commands)
core_message_decoder = msgspec.msgpack.Decoder(CoreMessage)


class CoreClient(Protocol):
    """What the front door asks of an engine core: `InProcessCore` on a thread of this process,
    `CoreProcess` in another. Each call is queued and applied at the core's next step; the answers come
    back as `StepOut`s."""

    def submit(self, request: Submit) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def stop_at_string(self, request_id: str, index: int, stop: str) -> None: ...
