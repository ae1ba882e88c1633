"""Where requests are validated: off the event loop, with cheap requests never queued behind costly ones.

Building a sequence tokenizes text prompts, which for a large prompt costs seconds and hundreds of MB.
So prompts are split by their byte size (known before tokenizing): token-id and short-text requests go
to one thread, large texts to another, and at most `max_long_queue` large ones may wait or run at once
(more get RESOURCE_EXHAUSTED). A flood of huge prompts then delays only other huge prompts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from serving.errors import QueueFullError

T = TypeVar("T")

# Text prompts above this many bytes tokenize on the long-prompt thread (a few ms of work at most below).
SHORT_PROMPT_BYTES = 16 * 1024


class ValidationPool:
    """Two one-thread executors, short and long; the long one's backlog is bounded."""

    def __init__(self, max_long_queue: int) -> None:
        self.max_long_queue = max_long_queue
        self._short = ThreadPoolExecutor(max_workers=1, thread_name_prefix="validate")
        self._long = ThreadPoolExecutor(max_workers=1, thread_name_prefix="validate-long")
        self.num_long = 0

    async def run(self, prompt_bytes: int, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on the executor for a prompt of `prompt_bytes` (0 for token ids)."""
        if prompt_bytes <= SHORT_PROMPT_BYTES:
            return await asyncio.wrap_future(self._short.submit(fn, *args))
        if self.num_long >= self.max_long_queue:
            raise QueueFullError(
                f"{self.num_long} large prompts are already waiting to be tokenized, this server's limit "
                f"(--max-validation-queue); retry later"
            )
        loop = asyncio.get_running_loop()
        self.num_long += 1
        future = self._long.submit(fn, *args)
        # Counted until the work itself ends, not when a cancelled caller stops waiting for it.
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._long_done))
        return await asyncio.wrap_future(future)

    def _long_done(self) -> None:
        self.num_long -= 1

    def shutdown(self) -> None:
        for executor in (self._short, self._long):
            executor.shutdown(wait=False, cancel_futures=True)
