"""What one decode step ran, as the tier's `serving.event_log.EventLog` records it: who joined when,
prefill chunks next to decodes, preemptions, finishes and blocks coming back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

ChunkKind = Literal["prefill", "decode"]


class ChunkRecord(NamedTuple):
    """One request's share of a step: how many tokens, and whether it was prefill or decode.

    A named tuple, not a frozen dataclass: every step records one per running request (128 at a time
    in the serving-path benchmark), and a tuple is built faster.
    """

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
