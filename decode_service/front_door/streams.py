"""The event-loop side of live requests: each stream's mailbox, how its tokens group into messages,
and the duplicate-id and capacity checks.

The shared part (drain, wait-until-empty, one wake-up per engine step) is
`serving.live_calls.LiveCallRegistry`.

Capacity counts work, not connections: a request takes a slot when it is reserved (before its prompt
is tokenized) and gives it back when the engine is done with it, even if its client has not read the
last messages yet. What such a client can still hold is bounded by `max_buffer` undelivered messages
per stream: past it the request is aborted (its blocks freed) and its stream ends with
RESOURCE_EXHAUSTED; the stall watchdog ends the call itself.

A stream's `Mailbox` is not an `asyncio.Queue`: a stream has exactly one reader, which always wants
everything waiting (to merge it into as few messages as it can), and one engine step puts one delta
into each of up to hundreds of mailboxes. A put is a list append, plus a wake-up only when the reader
is actually waiting, and a take hands over the list itself; a Queue pays its bookkeeping
(unfinished-task count, getter and putter deques, one `get_nowait` per item) on every delta, on the
event loop every stream shares.

How tokens group into messages: `coalesce` (always on, at the edge) merges whatever a stream has
waiting when its writer wakes up, so a writer that fell behind catches up in one message instead of
one per token. `StreamIntervalBuffer` (`--stream-interval`, like vLLM's) holds each request's tokens
until `interval` of them are ready, even when the writer keeps up: every stream message costs the
event loop, the network and the client some work, so with many streams or a slow link this divides
that by `interval`. The first token and the last message (finish, abort or error) always go out at
once, so TTFT and completion times do not change.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from base.errors import InvalidRequestError
from decode_service.engine_core.request import ServedRequest, StreamDelta
from serving.errors import QueueFullError
from serving.live_calls import LiveCallRegistry

ItemT = TypeVar("ItemT")


class Mailbox(Generic[ItemT]):
    """Items in arrival order, for one reader at a time; used on the event loop only."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list[ItemT] = []
        # The reader's future while it waits for an empty mailbox to get an item.
        self._waiter: asyncio.Future[None] | None = None

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: ItemT) -> None:
        """Add `item`; wakes the reader if it is waiting."""
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # done: the reader was cancelled while it waited
                waiter.set_result(None)

    async def take_all(self) -> list[ItemT]:
        """Every item waiting, oldest first; waits for one when there is none."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        items, self._items = self._items, []
        return items


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

    Called on one thread only (the engine thread, or the one reading the engine core's messages), like
    the `deliver` it wraps. What was sent is tracked here, not read from the request's sequence: with
    the engine core in another process, the front door's copy of a sequence holds only its prompt.
    """

    def __init__(self, interval: int, deliver: Callable[[list[StreamDelta]], None]) -> None:
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
        # Set once every writer the last step woke has built its messages (see `step_built`).
        self._built = asyncio.Event()
        self._built.set()
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
        if self._built.is_set():
            # The writers just woken run before this callback: each builds its messages, then waits.
            self._built = asyncio.Event()
            self._loop.call_soon(self._built.set)

    async def step_built(self) -> None:
        """Wait until every writer the last step woke has built its messages, so that their writes
        leave together.

        A writer that builds and writes in turn spaces the step's writes by its building time, so its
        client receives them one at a time, a wake-up each; written together, several wait for each
        read. Clients spend several times the CPU per message in the first case (bench/README.md, "A
        step's messages built before any is written").
        """
        if not self._built.is_set():
            await self._built.wait()

    def _overflow(self, stream: _LiveStream, request: ServedRequest) -> None:
        self._stop_working(stream)
        self.num_overflowed += 1
        self.abort(request.request_id)
        error = QueueFullError(
            f"the client fell {self.max_buffer} messages behind, this server's limit (--max-stream-buffer); "
            "the request was cancelled"
        )
        stream.mailbox.put(StreamDelta(request, error=error))
