"""A stream's mailbox: the event loop's dispatch puts deltas in, the stream's one writer takes them all out.

Why not `asyncio.Queue`: a stream has exactly one reader, which always wants everything waiting (to merge
it into as few messages as it can), and one engine step puts one delta into each of up to hundreds of
mailboxes. Here a put is a list append, plus a wake-up only when the reader is actually waiting, and a
take hands over the list itself; a Queue pays its bookkeeping (unfinished-task count, getter and putter
deques, one `get_nowait` per item) on every delta, on the event loop every stream shares.
"""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

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
