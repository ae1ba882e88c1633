"""A bounded in-process record of every prefill step: which prompts shared the forward, and the pool.

Tests and benchmarks read it to see chunked prefill pack several prompts into one forward and blocks
come back; it is never exposed over the API.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class StepRecord:
    """One forward. `chunks` holds (request_id, num_tokens) per prompt in it, in scheduling order."""

    step: int
    time: float
    chunks: tuple[tuple[str, int], ...]
    num_free_blocks: int
    num_waiting: int
    failed: bool

    @property
    def request_ids(self) -> set[str]:
        return {request_id for request_id, _ in self.chunks}

    @property
    def num_tokens(self) -> int:
        return sum(num_tokens for _, num_tokens in self.chunks)


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
        with self._lock:
            return len(self._records)
