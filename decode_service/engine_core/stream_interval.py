"""How a request's tokens are grouped into stream messages.

`coalesce` (always on, at the edge) merges whatever a stream has waiting when its writer wakes up, so
a writer that fell behind catches up in one message instead of one per token. `StreamIntervalBuffer`
(on the engine thread, `--stream-interval`, like vLLM's) holds each request's tokens until `interval`
of them are ready, even when the writer keeps up.

Every stream message costs the event loop, the network and the client some work; with many streams
or a slow link, holding a request's tokens until `interval` of them are ready divides that by
`interval`. The first token and the last message (finish, abort or error) always go out at once, so
TTFT and completion times do not change.
"""

from __future__ import annotations

from decode_service.engine_core.request import ServedRequest, StreamDelta
from serving.engine_thread import Deliver


def merge(earlier: StreamDelta, later: StreamDelta) -> StreamDelta:
    """One delta carrying both, in order; the later one's end (finish or error) wins."""
    return StreamDelta(
        earlier.request,
        token_ids=earlier.token_ids + later.token_ids,
        logprobs=earlier.logprobs + later.logprobs,
        finish_reason=later.finish_reason,
        error=later.error,
    )


def coalesce(deltas: list[StreamDelta]) -> list[StreamDelta]:
    """`deltas` in arrival order with each choice's consecutive run merged into one delta.

    Costs no latency: only deltas that are already waiting merge. An error is never merged into the
    tokens before it, so those tokens still reach the client before the stream fails.
    """
    if len(deltas) < 2:
        return deltas
    merged: list[StreamDelta] = []
    open_at: dict[int, int] = {}  # id(request) -> index in `merged` of its delta still taking tokens
    for delta in deltas:
        at = open_at.get(id(delta.request))
        if at is not None and delta.error is None:
            merged[at] = merge(merged[at], delta)
        else:
            open_at[id(delta.request)] = len(merged)
            merged.append(delta)
        if merged[open_at[id(delta.request)]].is_last:
            del open_at[id(delta.request)]
    return merged


class StreamIntervalBuffer:
    """Wraps the engine loop's `deliver`: holds each request's deltas until `interval` tokens are due.

    Called on the engine thread only, like the `deliver` it wraps. What was sent is tracked here, not
    read from the request's sequence: with the engine core in another process, the front door's copy of
    a sequence holds only its prompt.
    """

    def __init__(self, interval: int, deliver: Deliver[StreamDelta]) -> None:
        self.interval = interval
        self._deliver = deliver
        # By request object, not id: the choices of an `n` request share their id.
        self._held: dict[ServedRequest, StreamDelta] = {}
        # Requests (choices) that got their first tokens and have not ended.
        self._started: set[ServedRequest] = set()

    def __call__(self, deltas: list[StreamDelta]) -> None:
        if self.interval == 1:
            self._deliver(deltas)
            return
        ready = []
        for delta in deltas:
            request = delta.request
            held = self._held.pop(request, None)
            if held is not None:
                delta = merge(held, delta)
            if delta.is_last:
                self._started.discard(request)
                ready.append(delta)
            elif (delta.token_ids and request not in self._started) or len(delta.token_ids) >= self.interval:
                self._started.add(request)
                ready.append(delta)
            else:
                self._held[request] = delta
        if ready:
            self._deliver(ready)
