"""The event-loop side of live requests: who may join, and fan-out of the engine thread's deltas.

All methods except `deliver_threadsafe` run on the asyncio loop, so the registry needs no lock: the
duplicate-id, capacity and draining checks and the insertion are one atomic step between awaits.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from decode_service.request import ServedRequest, StreamDelta
from engine.errors import InvalidRequestError
from serving.errors import DrainingError, QueueFullError

logger = logging.getLogger(__name__)


@dataclass
class _LiveStream:
    request: ServedRequest
    queue: asyncio.Queue[StreamDelta]


class StreamHub:
    """Registry of live streams (at most `capacity`) and the mailbox each one reads its deltas from."""

    def __init__(self, loop: asyncio.AbstractEventLoop, capacity: int) -> None:
        self._loop = loop
        self.capacity = capacity
        self._streams: dict[str, _LiveStream] = {}
        self._draining = False
        self._empty = asyncio.Event()
        self._empty.set()

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._streams

    def check_accepting(self) -> None:
        if self._draining:
            raise DrainingError(
                "the server is draining and accepts no new requests; retry on another replica"
            )

    def open(self, request: ServedRequest) -> asyncio.Queue[StreamDelta]:
        """Register a validated request; returns the queue its deltas will arrive on."""
        self.check_accepting()
        if request.request_id in self._streams:
            raise InvalidRequestError(f"request_id {request.request_id!r} is already used by a live request")
        if len(self._streams) >= self.capacity:
            raise QueueFullError(
                f"the server already holds {len(self._streams)} requests, its limit; retry later"
            )
        stream = _LiveStream(request, asyncio.Queue())
        self._streams[request.request_id] = stream
        self._empty.clear()
        return stream.queue

    def close(self, request: ServedRequest) -> None:
        stream = self._streams.get(request.request_id)
        if stream is not None and stream.request is request:
            del self._streams[request.request_id]
        if not self._streams:
            self._empty.set()

    def begin_drain(self) -> None:
        self._draining = True

    async def wait_empty(self, timeout: float) -> bool:
        """Wait until no stream is live; False if `timeout` seconds passed first."""
        try:
            await asyncio.wait_for(self._empty.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def deliver_threadsafe(self, deltas: list[StreamDelta]) -> None:
        """Called by the engine thread once per step: hand the deltas to the event loop in one wake-up."""
        try:
            self._loop.call_soon_threadsafe(self._dispatch, deltas)
        except RuntimeError:
            logger.debug("event loop closed; dropped %d deltas", len(deltas))

    def _dispatch(self, deltas: list[StreamDelta]) -> None:
        for delta in deltas:
            stream = self._streams.get(delta.request.request_id)
            # A stream whose client left (or a newer request reusing its id) no longer wants these.
            if stream is not None and stream.request is delta.request:
                stream.queue.put_nowait(delta)
