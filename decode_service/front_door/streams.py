"""The event-loop side of live requests: a stream's mailbox, and the duplicate-id and capacity checks.

The shared part (drain, wait-until-empty, one wake-up per engine step) is
`serving.registry.LiveCallRegistry`.

Capacity counts work, not connections: a request takes a slot when it is reserved (before its prompt
is tokenized) and gives it back when the engine is done with it, even if its client has not read the
last messages yet. What such a client can still hold is bounded by `max_buffer` undelivered messages
per stream: past it the request is aborted (its blocks freed) and its stream ends with
RESOURCE_EXHAUSTED; the stall watchdog ends the call itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from base.errors import InvalidRequestError
from decode_service.engine_core.request import ServedRequest, StreamDelta
from decode_service.front_door.mailbox import Mailbox
from serving.errors import QueueFullError
from serving.registry import LiveCallRegistry


@dataclass(eq=False)
class _LiveStream:
    """A reserved slot (`request` None until validated) or a live stream; `working` while it holds a slot."""

    request: ServedRequest | None
    mailbox: Mailbox[StreamDelta] = field(default_factory=Mailbox)
    working: bool = True
    # Choices whose last delta has not arrived yet (a request with n > 1 holds its slot until all end).
    choices_left: int = 1


class StreamHub(LiveCallRegistry[str, _LiveStream, StreamDelta]):
    """Registry of live streams (at most `capacity` with engine work) and the mailbox of each."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        capacity: int,
        max_buffer: int,
        abort: Callable[[str], None] = lambda request_id: None,
    ) -> None:
        super().__init__(loop, capacity)
        self.max_buffer = max_buffer
        # Called with a request id whose client fell too far behind: the engine drops it.
        self.abort = abort
        self.num_working = 0
        self.num_overflowed = 0

    def reserve(self, request_id: str) -> None:
        """Take a slot for a request about to be validated, or refuse it (draining, duplicate id, full)."""
        self.check_accepting()
        if request_id in self._calls:
            raise InvalidRequestError(f"request_id {request_id!r} is already used by a live request")
        self._add(request_id, _LiveStream(None))
        self.num_working += 1

    def release(self, request_id: str) -> None:
        """Give back the slot of a reservation that did not become a stream (validation failed)."""
        stream = self._calls.get(request_id)
        if stream is not None and stream.request is None:
            self._forget(request_id, stream)

    def open(self, request: ServedRequest) -> Mailbox[StreamDelta]:
        """Turn the request's reservation into a live stream; returns the mailbox its deltas arrive in."""
        stream = self._calls[request.request_id]
        stream.request = request
        stream.choices_left = request.n
        return stream.mailbox

    def close(self, request: ServedRequest) -> None:
        stream = self._calls.get(request.request_id)
        if stream is not None and stream.request is request:
            self._forget(request.request_id, stream)

    def _forget(self, request_id: str, stream: _LiveStream) -> None:
        self._stop_working(stream)
        self._remove(request_id, stream)

    def _stop_working(self, stream: _LiveStream) -> None:
        if stream.working:
            stream.working = False
            self.num_working -= 1

    def _check_capacity(self) -> None:
        if self.num_working >= self.capacity:
            raise QueueFullError(
                f"the server already holds {self.num_working} requests, its limit; retry later"
            )

    def _dispatch(self, deltas: list[StreamDelta]) -> None:
        for delta in deltas:
            owner = delta.request.stream_owner
            stream = self._calls.get(owner.request_id)
            # A stream whose client left, that overflowed, or a newer request reusing its id: not wanted.
            if stream is None or stream.request is not owner or not stream.working:
                continue
            if delta.is_last:
                # A request aborted before its prompt was prefilled never forked its other choices.
                stream.choices_left = stream.choices_left - 1 if owner.forked and delta.error is None else 0
                if stream.choices_left == 0:
                    self._stop_working(stream)
            elif len(stream.mailbox) >= self.max_buffer:
                self._overflow(stream, owner)
                continue
            stream.mailbox.put(delta)

    def _overflow(self, stream: _LiveStream, request: ServedRequest) -> None:
        self._stop_working(stream)
        self.num_overflowed += 1
        self.abort(request.request_id)
        error = QueueFullError(
            f"the client fell {self.max_buffer} messages behind, this server's limit (--max-stream-buffer); "
            "the request was cancelled"
        )
        stream.mailbox.put(StreamDelta(request, error=error))
