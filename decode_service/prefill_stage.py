"""The prefill stage: how an admitted request's prompt KV gets into the blocks reserved for it.

Admission reserves the prompt's blocks and hands the request to a stage; when the stage has computed
the whole history (prompt, plus tokens generated before a preemption) and the next token is sampled,
the request joins the decode batch. In aggregated mode the stage is local chunked prefill mixed into
the decode iterations; a remote stage (a `Prefill` stream writing KV into the same reserved blocks)
plugs in here without the scheduler changing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from decode_service.request import ServedRequest
from engine.model_runner import ScheduledChunk


class PrefillStage(ABC):
    """Requests whose KV is being computed, in the order they were admitted."""

    def __init__(self) -> None:
        self._requests: list[ServedRequest] = []

    @property
    def requests(self) -> list[ServedRequest]:
        return list(self._requests)

    def __len__(self) -> int:
        return len(self._requests)

    def start(self, request: ServedRequest) -> None:
        """Begin prefilling an admitted request (its blocks are already reserved)."""
        self._requests.append(request)

    def remove(self, request: ServedRequest) -> None:
        """Forget a request: its prefill completed, or it was preempted or aborted."""
        self._requests.remove(request)

    @abstractmethod
    def plan_chunks(self, token_budget: int) -> list[ScheduledChunk]:
        """Chunks to run in this step's forward, using at most `token_budget` tokens."""


class LocalPrefillStage(PrefillStage):
    """Chunked prefill on this replica: prompt chunks share each step's token budget with decodes.

    Requests are served in admission order, so the oldest admitted prompt finishes first and joins
    the decode batch soonest; a long prompt takes as many steps as its length needs, never stalling
    the decodes that run next to it.
    """

    def plan_chunks(self, token_budget: int) -> list[ScheduledChunk]:
        chunks = []
        for request in self._requests:
            if token_budget <= 0:
                break
            take = min(request.seq.num_uncomputed_tokens, token_budget)
            chunks.append(ScheduledChunk(request.seq, take))
            token_budget -= take
        return chunks
