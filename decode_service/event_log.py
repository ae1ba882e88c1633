"""A bounded in-process record of what every engine step ran: the batcher's flight recorder.

Tests and the benchmark's batch-occupancy plot read it to see continuous batching happen (who joined
when, prefill chunks next to decodes, blocks coming back). It is never exposed over the public API.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Literal

ChunkKind = Literal["prefill", "decode"]


@dataclass(frozen=True)
class ChunkRecord:
    """One request's share of a step: how many tokens, and whether it was prefill or decode."""

    request_id: str
    num_tokens: int
    kind: ChunkKind


@dataclass(frozen=True)
class StepRecord:
    """One engine step. `num_free_blocks` is counted after the step freed its finished sequences."""

    step: int
    time: float
    chunks: tuple[ChunkRecord, ...]
    num_free_blocks: int
    num_waiting: int
    preempted: tuple[str, ...]
    finished: tuple[str, ...]

    @property
    def request_ids(self) -> set[str]:
        return {chunk.request_id for chunk in self.chunks}

    @property
    def decode_ids(self) -> set[str]:
        return {c.request_id for c in self.chunks if c.kind == "decode"}

    @property
    def prefill_ids(self) -> set[str]:
        return {c.request_id for c in self.chunks if c.kind == "prefill"}


class EventLog:
    """Ring buffer of the last `maxlen` steps; appended by the engine thread, read from any thread."""

    def __init__(self, maxlen: int = 4096) -> None:
        self._records: deque[StepRecord] = deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def append(self, record: StepRecord) -> None:
        with self._lock:
            self._records.append(record)

    def snapshot(self) -> list[StepRecord]:
        """A copy of the records, oldest first."""
        with self._lock:
            return list(self._records)

    def __len__(self) -> int:
        return len(self._records)
