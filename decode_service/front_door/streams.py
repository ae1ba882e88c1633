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

import msgspec

from base.errors import InvalidRequestError
from decode_service.engine_core.messages import Delta, Failure, Submit
from serving.errors import QueueFullError
from serving.live_calls import LiveCallRegistry
from serving.status import status_for

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


ChoiceKey = tuple[int, int]


def choice_key(delta: Delta) -> ChoiceKey:
    """Which choice of which submission `delta` belongs to (the choices of an `n` request share an id)."""
    return delta.submission, delta.index


def is_last(delta: Delta) -> bool:
    """Whether `delta` ends its choice (finished, or failed)."""
    return delta.finish_reason is not None or delta.error is not None


def merge(earlier: Delta, later: Delta) -> Delta:
    """One delta carrying both, in order; the later one's end (finish or error) wins, and its state
    where it carries one."""
    return msgspec.structs.replace(
        later,
        token_ids=earlier.token_ids + later.token_ids,
        logprobs=earlier.logprobs + later.logprobs,
        state=later.state if later.state is not None else earlier.state,
    )


def coalesce(deltas: list[Delta]) -> list[Delta]:
    """`deltas` in arrival order with each choice's consecutive run merged into one delta.

    Costs no latency: only deltas that are already waiting merge. An error is never merged into the
    tokens before it, so those tokens still reach the client before the stream fails.
    """
    if len(deltas) < 2:
        return deltas
    merged: list[Delta] = []
    open_at: dict[ChoiceKey, int] = {}  # choice -> index in `merged` of its delta still taking tokens
    for delta in deltas:
        key = choice_key(delta)
        at = open_at.get(key)
        if at is not None and delta.error is None:
            merged[at] = merge(merged[at], delta)
        else:
            open_at[key] = len(merged)
            merged.append(delta)
        if is_last(merged[open_at[key]]):
            del open_at[key]
    return merged


class StreamIntervalBuffer:
    """Wraps the streams' `deliver`: holds each choice's deltas until `interval` tokens are due.

    Called on the event loop, with each step's deltas in the order the core made them.
    """

    def __init__(self, interval: int, deliver: Callable[[list[Delta]], None]) -> None:
        self.interval = interval
        self._deliver = deliver
        self._held: dict[ChoiceKey, Delta] = {}
        # Choices that got their first tokens and have not ended.
        self._started: set[ChoiceKey] = set()

    def __call__(self, deltas: list[Delta]) -> None:
        if self.interval == 1:
            self._deliver(deltas)
            return
        ready = []
        for delta in deltas:
            key = choice_key(delta)
            held = self._held.pop(key, None)
            if held is not None:
                delta = merge(held, delta)
            if is_last(delta):
                self._started.discard(key)
                ready.append(delta)
            elif (delta.token_ids and key not in self._started) or len(delta.token_ids) >= self.interval:
                self._started.add(key)
                ready.append(delta)
            else:
                self._held[key] = delta
        if ready:
            self._deliver(ready)


@dataclass(eq=False)
class _LiveStream:
    """A reserved slot (`request` None until validated) or a live stream; `working` while it holds a slot."""

    request: Submit | None
    mailbox: Mailbox[Delta] = field(default_factory=Mailbox)
    working: bool = True
    # Choices whose last delta has not arrived yet (a request with n > 1 holds its slot until all end).
    choices_left: int = 1
    # Whether the core forked choices 1..n-1 (as its deltas' state last said).
    forked: bool = False


def choices_left_after(choices_left: int, delta: Delta, forked: bool) -> int:
    """Choices still to end once `delta`, a last delta, ended one: an error ends the stream, and a request
    aborted before its prompt was prefilled never forked its other choices."""
    return choices_left - 1 if forked and delta.error is None else 0


class StreamHub(LiveCallRegistry[str, _LiveStream, Delta]):
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
        self._by_submission: dict[int, _LiveStream] = {}

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

    def open(self, request: Submit) -> Mailbox[Delta]:
        """Turn the request's reservation into a live stream; returns the mailbox its deltas arrive in."""
        stream = self._calls[request.request_id]
        stream.request = request
        stream.choices_left = request.n
        self._by_submission[request.submission] = stream
        return stream.mailbox

    def close(self, request: Submit) -> None:
        stream = self._calls.get(request.request_id)
        if stream is not None and stream.request is request:
            self._forget(request.request_id, stream)

    def request_of(self, submission: int) -> Submit | None:
        """The request of submission number `submission` while the core still owes it deltas (its stream
        may be closed already); None after its last."""
        stream = self._by_submission.get(submission)
        return stream.request if stream is not None else None

    def fail_all(self, failure: Failure) -> None:
        """End every request the core still owes deltas with `failure` (the core is gone)."""
        self._dispatch(
            [Delta(submission, 0, [], [], None, failure, None) for submission in self._by_submission]
        )

    def _forget(self, request_id: str, stream: _LiveStream) -> None:
        """The stream is closed; its submission stays known until the core's last delta for it."""
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

    def deliver(self, deltas: list[Delta]) -> None:
        """Hand a step's deltas to their streams (on the event loop)."""
        self._dispatch(deltas)

    def _dispatch(self, deltas: list[Delta]) -> None:
        for delta in deltas:
            stream = self._by_submission.get(delta.submission)
            if stream is None or stream.request is None:
                continue
            # A stream whose client left, or that overflowed, still counts its choices down to the end.
            wanted = stream.working
            if delta.state is not None and delta.state.forked:
                stream.forked = True
            if is_last(delta):
                stream.choices_left = choices_left_after(stream.choices_left, delta, stream.forked)
                if stream.choices_left == 0:
                    del self._by_submission[delta.submission]
                    self._stop_working(stream)
            elif wanted and len(stream.mailbox) >= self.max_buffer:
                self._overflow(stream, stream.request)
                continue
            if wanted:
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

    def _overflow(self, stream: _LiveStream, request: Submit) -> None:
        self._stop_working(stream)
        self.num_overflowed += 1
        self.abort(request.request_id)
        error = QueueFullError(
            f"the client fell {self.max_buffer} messages behind, this server's limit (--max-stream-buffer); "
            "the request was cancelled"
        )
        code, message = status_for(error)
        stream.mailbox.put(Delta(request.submission, 0, [], [], None, Failure(code.name, message), None))
