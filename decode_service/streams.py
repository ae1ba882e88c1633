"""The event-loop side of live requests: a stream's mailbox, and the duplicate-id and capacity checks.

The shared part (drain, wait-until-empty, one wake-up per engine step) is
`serving.registry.LiveCallRegistry`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from decode_service.request import ServedRequest, StreamDelta
from engine.errors import InvalidRequestError
from serving.errors import QueueFullError
from serving.registry import LiveCallRegistry


@dataclass
class _LiveStream:
    request: ServedRequest
    queue: asyncio.Queue[StreamDelta]


class StreamHub(LiveCallRegistry[str, _LiveStream, StreamDelta]):
    """Registry of live streams (at most `capacity`) and the mailbox each one reads its deltas from."""

    def open(self, request: ServedRequest) -> asyncio.Queue[StreamDelta]:
        """Register a validated request; returns the queue its deltas will arrive on."""
        self.check_accepting()
        if request.request_id in self._calls:
            raise InvalidRequestError(f"request_id {request.request_id!r} is already used by a live request")
        stream = _LiveStream(request, asyncio.Queue())
        self._add(request.request_id, stream)
        return stream.queue

    def close(self, request: ServedRequest) -> None:
        stream = self._calls.get(request.request_id)
        self._remove(request.request_id, stream if stream is not None and stream.request is request else None)

    def _check_capacity(self) -> None:
        if len(self._calls) >= self.capacity:
            raise QueueFullError(
                f"the server already holds {len(self._calls)} requests, its limit; retry later"
            )

    def _dispatch(self, deltas: list[StreamDelta]) -> None:
        for delta in deltas:
            stream = self._calls.get(delta.request.request_id)
            # A stream whose client left (or a newer request reusing its id) no longer wants these.
            if stream is not None and stream.request is delta.request:
                stream.queue.put_nowait(delta)
