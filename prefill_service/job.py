"""One Prefill call as both threads see it, and the events the engine thread sends back about it.

State crosses threads only as events: the engine thread owns the scheduling fields, the event loop
owns the `events` mailbox and `admitted`, and the engine thread's news reaches the event loop as
`JobEvent`s delivered once per step.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

from engine.sequence import Sequence

_job_keys = itertools.count()


@dataclass(frozen=True)
class Admitted:
    """The job left the queue: its prompt's blocks are reserved and its chunks get scheduled."""


@dataclass(frozen=True)
class KVReady:
    """Logical blocks [block_start, block_start + num_blocks) hold their final KV and can be sent.

    `num_tokens` is the request's token count: slots at or past it hold stale KV of the block's previous
    owner and must never leave the process; it also says which blocks of a sliding-window group are still
    read after the prompt (only those are sent, `KVLayout.first_sent_block`). `block_tables` is a snapshot
    of the job's physical blocks, one table per attention group (a one-group model may give its one table
    alone, `kv_transfer.wire.BlockTables`), so the sender never reads engine-thread state. On CUDA,
    `ready` is an event recorded after the step that wrote the blocks; the sender waits on it before
    reading them (None on the CPU, where the step has finished writing when it returns).
    """

    block_start: int
    num_blocks: int
    num_tokens: int
    block_tables: tuple[tuple[int, ...], ...] | tuple[int, ...]
    ready: object | None = None


@dataclass(frozen=True)
class PrefillFinished:
    """The whole prompt is computed and its first token sampled; every KVReady precedes this."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]
    queue_seconds: float
    prefill_seconds: float


@dataclass(frozen=True)
class PrefillFailed:
    """The job cannot finish (a failed step, or the server stopping); the call ends with `error`."""

    error: Exception


JobEvent = Admitted | KVReady | PrefillFinished | PrefillFailed


class PrefillJob:
    """A prompt being prefilled for one Prefill call.

    `key` is unique per call (a retried call may reuse its request_id while the old one is still
    being torn down), so the engine thread identifies jobs by key, never by request id. The
    caller may already hold the prompt's first blocks (`first_block`); sending starts after them.
    """

    def __init__(self, seq: Sequence, arrival_time: float, first_block: int = 0) -> None:
        self.key = next(_job_keys)
        self.seq = seq
        self.arrival_time = arrival_time
        # Engine thread only.
        self.admitted_time: float | None = None
        self.first_step_time: float | None = None
        # Blocks below `first_block` are held by the caller: never sent.
        self.num_blocks_streamed = first_block
        # Event loop only.
        self.events: asyncio.Queue[JobEvent] = asyncio.Queue()
        self.admitted = False

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return self.seq.num_prompt_tokens

    def __repr__(self) -> str:
        return f"PrefillJob(key={self.key}, request_id={self.request_id!r}, tokens={self.num_prompt_tokens})"
