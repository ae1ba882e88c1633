"""The prefill stage: how an admitted request's prompt KV gets into the blocks reserved for it.

Admission reserves the prompt's blocks and hands the request to a stage; when the stage has computed
the whole history (prompt, plus tokens generated before a preemption) and the next token is sampled,
the request joins the decode batch. In aggregated mode the stage is local chunked prefill mixed into
the decode iterations. A remote stage (`remote_prefill.stage.RemotePrefillStage`: a `Prefill` stream writing
KV into the same reserved blocks) computes outside the step: it reports each finished prompt through
`collect`, and wakes the engine thread when it has news.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable

from decode_service.engine_core.request import ServedRequest
from engine.engine import TokenOutput
from engine.model_runner import ScheduledChunk

StageFailure = tuple[ServedRequest, Exception]


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

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        """How a stage that computes outside the step wakes an idle engine thread (thread-safe callable)."""
        return

    def collect(self) -> tuple[list[TokenOutput], list[StageFailure]]:
        """Prompts finished outside the step since the last call: their first tokens (already appended,
        `num_computed_tokens` at the full history), and the requests that cannot be prefilled."""
        return [], []


def plan_local_chunks(requests: Iterable[ServedRequest], token_budget: int) -> list[ScheduledChunk]:
    """Chunks of local prefill, oldest admitted first, until the budget is spent."""
    chunks = []
    for request in requests:
        if token_budget <= 0:
            break
        take = min(request.seq.num_uncomputed_tokens, token_budget)
        chunks.append(ScheduledChunk(request.seq, take))
        token_budget -= take
    return chunks


class LocalPrefillStage(PrefillStage):
    """Chunked prefill on this replica: prompt chunks share each step's token budget with decodes.

    Requests are served in admission order, so the oldest admitted prompt finishes first and joins
    the decode batch soonest; a long prompt takes as many steps as its length needs, never stalling
    the decodes that run next to it.
    """

    def plan_chunks(self, token_budget: int) -> list[ScheduledChunk]:
        return plan_local_chunks(self._requests, token_budget)
