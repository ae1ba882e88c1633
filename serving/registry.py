"""The event-loop side of live calls: who may join (capacity, drain), fan-out of the engine thread's
events, and waiting until every call is over.

Everything except `deliver_threadsafe` runs on the asyncio loop, so no lock is needed: the draining and
capacity checks and the insertion are one step between awaits.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from typing import Generic, TypeVar

from serving.errors import DrainingError

logger = logging.getLogger(__name__)

KeyT = TypeVar("KeyT")
CallT = TypeVar("CallT")
EventT = TypeVar("EventT")


class LiveCallRegistry(ABC, Generic[KeyT, CallT, EventT]):
    """Live calls by key, at most `capacity` of them by the tier's count (`_check_capacity`).

    A tier adds how a call is opened (its checks, its mailbox) and `_dispatch`: handing one step's
    events to the calls they belong to.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, capacity: int) -> None:
        self._loop = loop
        self.capacity = capacity
        self._calls: dict[KeyT, CallT] = {}
        self._draining = False
        self._empty = asyncio.Event()
        self._empty.set()

    def __len__(self) -> int:
        return len(self._calls)

    def __contains__(self, key: object) -> bool:
        return key in self._calls

    def check_accepting(self) -> None:
        """Raise DrainingError once the server drains: new calls go to another replica."""
        if self._draining:
            raise DrainingError(
                "the server is draining and accepts no new requests; retry on another replica"
            )

    def begin_drain(self) -> None:
        self._draining = True

    async def wait_empty(self, timeout: float) -> bool:
        """Wait until no call is live; False if `timeout` seconds passed first."""
        try:
            await asyncio.wait_for(self._empty.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def deliver_threadsafe(self, events: list[EventT]) -> None:
        """Called by the engine thread once per step: hand its events to the event loop in one wake-up."""
        try:
            self._loop.call_soon_threadsafe(self._dispatch, events)
        except RuntimeError:
            logger.debug("event loop closed; dropped %d events", len(events))

    def _add(self, key: KeyT, call: CallT) -> None:
        """Register a call after the capacity check (the tier's `open` checks `check_accepting` first)."""
        self._check_capacity()
        self._calls[key] = call
        self._empty.clear()

    def _remove(self, key: KeyT, call: CallT) -> None:
        """Forget `call` (not a newer call that reuses its key)."""
        if self._calls.get(key) is call:
            del self._calls[key]
        if not self._calls:
            self._empty.set()

    @abstractmethod
    def _check_capacity(self) -> None:
        """Raise QueueFullError when one more call would exceed what the tier holds."""

    @abstractmethod
    def _dispatch(self, events: list[EventT]) -> None:
        """On the event loop: route one step's events to their live calls; drop those of calls gone."""
