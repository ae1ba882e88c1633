"""One request's remote prefill as both decode threads see it, what it reports back, and counters.

Why KV can be written off the engine thread. The engine thread reserves the request's blocks at
admission and, while the request is being prefilled remotely, never puts it in a step, never grows its
block table and never reads or writes those blocks; the cache tensors are allocated once and never
resized or moved. A forward running meanwhile touches only the blocks of the sequences in its step,
so the writer and the forward never touch the same bytes. (On CUDA both enqueue on the device's
default stream, so they are ordered anyway.) The one dangerous moment is when the engine thread gives
the blocks back (abort, preemption, or fallback to local prefill), since they may go to another
request at once: `cancel` takes the lock every write holds, so it waits for a write in progress and
no write starts after it. The engine thread calls `cancel` before it frees the blocks.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from base.errors import TandemError
from decode_service.engine_core.request import ServedRequest
from engine.params import SamplingParams
from kv_transfer import KVFrame, KVNonFiniteError, KVRangeError, PagedKV
from protos.tandem.internal.v1 import prefill_pb2
from serving.errors import TierUnavailableError


class PrefillUnavailableError(TierUnavailableError):
    """No prefill replica could prefill the prompt (down, refused, too slow); maps to UNAVAILABLE."""


class TransferCancelledError(TandemError):
    """The engine thread gave the request's blocks back; this transfer must not write anymore."""


@dataclass
class PrefillTransferStats:
    """Counters of the decode side of disaggregated prefill, for the metrics exporter to read.

    Each field has exactly one writer thread: the engine thread for the routing counters
    (`local_prefills`, `remote_prefills_started`, `fallbacks_local`), the event loop for the rest.
    Over completed remote prefills, `kv_blocks_skipped` counts the leading blocks not transferred
    because this replica's prefix cache held them, `transfer_seconds` sums the time from the `Prefill`
    call to its `PrefillDone`, `kv_stream_seconds` from the first KV message to `PrefillDone` (pure
    transfer when the prompt was computed in one prefill step; otherwise it includes the later chunks'
    compute).
    """

    local_prefills: int = 0
    remote_prefills_started: int = 0
    remote_prefills_completed: int = 0
    remote_prefills_failed: int = 0
    fallbacks_local: int = 0
    attempt_failures: int = 0
    retries: int = 0
    kv_messages_received: int = 0
    kv_bytes_received: int = 0
    kv_blocks_skipped: int = 0
    transfer_seconds: float = 0.0
    kv_stream_seconds: float = 0.0


class KVTransfer:
    """The KV of one request's prompt arriving from a prefill replica into the blocks decode reserved.

    Created on the engine thread with snapshots of everything the other threads need (token ids,
    sampling, block tables), so they never read the engine's `Sequence`. Per attention group, the
    blocks expected start at `first_blocks[group]`: after those this replica's prefix cache holds, and,
    for a sliding-window group, no earlier than the first block its window still reads
    (`KVLayout.first_sent_block`), exactly what the prefill tier sends.
    """

    def __init__(
        self, request: ServedRequest, kv: PagedKV, held_prefix_hash: bytes = b"", affinity_key: bytes = b""
    ) -> None:
        seq = request.seq
        # Identity only: the request is engine-thread state.
        self.request = request
        self.request_id = seq.request_id
        self.token_ids = tuple(seq.token_ids)
        self.sampling: SamplingParams = seq.sampling
        self.layout = layout = kv.layout
        self.cache_salt = seq.cache_salt
        # Leading blocks decode took from its own prefix cache (shared, read-only): never sent, never written.
        self.num_held_blocks = seq.num_computed_tokens // layout.block_size
        self.held_prefix_hash = held_prefix_hash
        self.affinity_key = affinity_key
        # The request's trace: each attempt is a span of it, and the prefill tier's spans join it.
        self.traceparent = request.traceparent
        self.num_blocks = -(-len(self.token_ids) // layout.block_size)
        self.first_blocks = tuple(
            max(self.num_held_blocks, layout.first_sent_block(group, len(self.token_ids)))
            for group in range(layout.num_groups)
        )
        self._block_tables = tuple(tuple(table[: self.num_blocks]) for table in seq.block_tables)
        for group, table in enumerate(self._block_tables):
            first = layout.first_sent_block(group, len(self.token_ids))
            if len(table) != self.num_blocks or any(block < 0 for block in table[first:]):
                raise ValueError(
                    f"{self.request_id}: group {group} has blocks reserved {list(table)}, its "
                    f"{len(self.token_ids)} tokens need logical blocks [{first}, {self.num_blocks})"
                )
        self._kv = kv
        self._lock = threading.Lock()
        self._cancelled = False
        # Per group, which (block, layer) pairs the current attempt has written; blocks not expected
        # (held here, or slid out of a sliding group's window) count as written.
        self._written = [
            np.zeros((self.num_blocks, len(group.layers)), dtype=bool) for group in layout.groups
        ]
        for written, first in zip(self._written, self.first_blocks, strict=True):
            written[:first] = True
        self.future: Future[None] | None = None

    def write(self, frame: KVFrame) -> int:
        """Validate and write one received frame (writer thread); returns its payload bytes.

        Raises TransferCancelledError once the blocks were given back, or the frame's KVTransferError.
        """
        with self._lock:
            if self._cancelled:
                raise TransferCancelledError(f"{self.request_id}: transfer cancelled")
            header = frame.header
            if header.block_start < self.num_held_blocks:
                raise KVRangeError(
                    f"chunk starts at block {header.block_start}, but blocks below {self.num_held_blocks} "
                    "are held here (cached, shared) and must not be sent"
                )
            if header.group < len(self.first_blocks) and header.block_start < self.first_blocks[header.group]:
                raise KVRangeError(
                    f"chunk of group {header.group} starts at block {header.block_start}, but its blocks "
                    f"below {self.first_blocks[header.group]} slid out of the group's window and must not "
                    "be sent"
                )
            written = self._kv.write(frame, self._block_tables, self.num_blocks)
            blocks = slice(header.block_start, header.block_start + header.num_blocks)
            layers = slice(header.layer_start, header.layer_start + header.num_layers)
            self._written[header.group][blocks, layers] = True
        return written

    def restart(self) -> None:
        """A new attempt re-sends every block: forget what the failed one wrote (it will be overwritten)."""
        with self._lock:
            for written, first in zip(self._written, self.first_blocks, strict=True):
                written[first:] = False

    def check_complete(self, done: prefill_pb2.PrefillDone, vocab_size: int) -> None:
        """Refuse a PrefillDone that does not close a whole, matching transfer (KVRangeError), or whose
        asked-for logprobs are NaN (KVNonFiniteError: no sampled token has a NaN probability).

        A peer that skipped a block would otherwise leave stale KV from the block's previous owner
        under a sequence that then decodes without any error: a wrong answer.
        """
        if done.num_prompt_tokens != len(self.token_ids):
            raise KVRangeError(
                f"PrefillDone reports {done.num_prompt_tokens} prompt tokens; "
                f"the request has {len(self.token_ids)}"
            )
        if not 0 <= done.first_token_id < vocab_size:
            raise KVRangeError(
                f"first token id {done.first_token_id} is outside the vocabulary [0, {vocab_size})"
            )
        # Without logprobs asked for, the sampler reports NaN on purpose (it skipped the log-softmax).
        asked = self.request.seq.sampling.logprobs > 0
        if asked and any(math.isnan(logprob) for logprob in _logprobs(done)):
            raise KVNonFiniteError("PrefillDone carries a NaN logprob: the prefill replica's numbers broke")
        with self._lock:
            total = sum(written.size for written in self._written)
            missing = total - sum(int(np.count_nonzero(written)) for written in self._written)
        if missing:
            raise KVRangeError(
                f"PrefillDone arrived with {missing} of {total} (block, layer) pairs never sent"
            )

    def cancel(self) -> None:
        """Engine thread, before it frees the blocks: wait for a write in progress, refuse later ones."""
        with self._lock:
            self._cancelled = True
        if self.future is not None:
            self.future.cancel()


def _logprobs(done: prefill_pb2.PrefillDone) -> list[float]:
    """The first token's logprob and its alternatives'."""
    return [done.first_token_logprob, *(top.logprob for top in done.top_logprobs)]


@dataclass(frozen=True)
class PrefillCompleted:
    """Every block arrived and the prefill replica sampled the first token."""

    transfer: KVTransfer
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class PrefillGaveUp:
    """No replica could prefill the prompt. The stage prefills it locally when `--fallback-local` is
    set and `can_fall_back` (not when the server is stopping), or fails the request with `error`."""

    transfer: KVTransfer
    error: Exception
    can_fall_back: bool = True


PrefillOutcome = PrefillCompleted | PrefillGaveUp
