"""The process lifecycle both tiers share: start a server, wait for SIGTERM or SIGINT, then drain."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from typing import Protocol

logger = logging.getLogger(__name__)


class DrainableServer(Protocol):
    async def start(self) -> int: ...

    async def drain(self, grace_seconds: float | None = None) -> bool: ...


async def serve_until_signalled(server: DrainableServer) -> int:
    """Run `server` until the first SIGTERM or SIGINT, drain it, and return the exit status (0).

    Draining rather than stopping is what lets Kubernetes roll a tier without failing requests:
    health turns NOT_SERVING, new calls get UNAVAILABLE, running ones finish within the grace.
    """
    await server.start()
    # The model, tokenizer and server objects live as long as the process: moved out of the
    # collector's generations, they are not rescanned by every full collection while serving.
    gc.freeze()
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if not stop_requested.is_set():
            logger.info("received %s", signal.Signals(signum).name)
            stop_requested.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    await stop_requested.wait()
    await server.drain()
    return 0
