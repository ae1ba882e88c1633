"""A bounded in-process record of what every engine step ran: the tier's flight recorder.

Each tier appends its own step records (decode: batch composition, preemptions, finishes; prefill:
which prompts shared the forward). Tests and the benchmark's batch-occupancy plot read them to see the
batching happen; they are never exposed over an API.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Generic, TypeVar

RecordT = TypeVar("RecordT")


class EventLog(Generic[RecordT]):
    """Ring buffer of the last `maxlen` steps; appended by the engine thread, read from any thread."""

    def __init__(self, maxlen: int = 4096) -> None:
        self._records: deque[RecordT] = deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def append(self, record: RecordT) -> None:
        with self._lock:
            self._records.append(record)

    def snapshot(self) -> list[RecordT]:
        """A copy of the records, oldest first."""
        with self._lock:
            return list(self._records)

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)
