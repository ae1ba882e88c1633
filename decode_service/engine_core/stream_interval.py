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

from decode_service.engine_core.request import StreamDelta
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

    Called on the engine thread only, like the `deliver` it wraps.
    """

    def __init__(self, interval: int, deliver: Deliver[StreamDelta]) -> None:
        self.interval = interval
        self._deliver = deliver
        self._held: dict[str, StreamDelta] = {}

    def __call__(self, deltas: list[StreamDelta]) -> None:
        if self.interval == 1:
            self._deliver(deltas)
            return
        ready = []
        for delta in deltas:
            request_id = delta.request.request_id
            held = self._held.pop(request_id, None)
            if held is not None and held.request is delta.request:
                delta = merge(held, delta)
            # Nothing of this request was sent yet exactly when this delta carries all its output.
            first = bool(delta.token_ids) and len(delta.token_ids) == delta.request.seq.num_output_tokens
            if delta.is_last or first or len(delta.token_ids) >= self.interval:
                ready.append(delta)
            else:
                self._held[request_id] = delta
        if ready:
            self._deliver(ready)
