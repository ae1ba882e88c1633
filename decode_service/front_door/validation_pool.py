"""Where requests are validated: off the event loop, with cheap requests never queued behind costly ones.

Building a sequence tokenizes text prompts, which for a large prompt costs seconds and hundreds of MB,
and compiles constraints (JSON schemas, regexes, grammars), which may take up to the server's compile
timeout. So each kind of cost has its own thread: token-id and short-text requests go to one, large
texts to another, constrained requests with short prompts whose constraint has not compiled lately to a
third; at most a bounded number of large or constrained ones may wait or run at once on their thread
(more get RESOURCE_EXHAUSTED). A flood of huge prompts or slow schemas then delays only its own kind.
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


class _BoundedLane:
    """One thread whose backlog (waiting plus running) is bounded."""

    def __init__(self, name: str, what: str, max_queue: int) -> None:
        self.what = what
        self.max_queue = max_queue
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.count = 0

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        if self.count >= self.max_queue:
            raise QueueFullError(
                f"{self.count} {self.what} are already waiting to be validated, this server's limit "
                f"(--max-validation-queue); retry later"
            )
        loop = asyncio.get_running_loop()
        self.count += 1
        future = self.executor.submit(fn, *args)
        # Counted until the work itself ends, not when a cancelled caller stops waiting for it.
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._done))
        return await asyncio.wrap_future(future)

    def _done(self) -> None:
        self.count -= 1


class ValidationPool:
    """Three one-thread executors: short, long prompts and constrained; the last two bounded."""

    def __init__(self, max_long_queue: int, max_constrained_queue: int | None = None) -> None:
        self._short = ThreadPoolExecutor(max_workers=1, thread_name_prefix="validate")
        self._long = _BoundedLane("validate-long", "large prompts", max_long_queue)
        self._constrained = _BoundedLane(
            "validate-grammar", "constrained requests", max_constrained_queue or max_long_queue
        )

    async def run(
        self, prompt_bytes: int, fn: Callable[..., T], *args: object, constrained: bool = False
    ) -> T:
        """`fn(*args)` on the executor for a prompt of `prompt_bytes` (0 for token ids); `constrained`
        requests (which may compile a grammar) never wait behind or hold up unconstrained short ones."""
        if prompt_bytes > SHORT_PROMPT_BYTES:
            return await self._long.run(fn, *args)
        if constrained:
            return await self._constrained.run(fn, *args)
        return await asyncio.wrap_future(self._short.submit(fn, *args))

    def shutdown(self) -> None:
        for executor in (self._short, self._long.executor, self._constrained.executor):
            executor.shutdown(wait=False, cancel_futures=True)
