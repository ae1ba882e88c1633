"""What one prefill step ran, as the tier's `serving.event_log.EventLog` records it: which prompts
shared the forward, and the pool left after it."""

from __future__ import annotations

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
