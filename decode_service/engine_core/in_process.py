"""The front door's client for an engine core on a thread of its own process: `InProcessCore`.

`--engine-in-process`, tests and in-process benchmarks run the core here; `tandem serve decode` runs it
in a process of its own (`core_client.CoreProcess`). Both take the same `Submit`, `Abort` and `StopAt`
and answer with the same `StepOut`s on the server's event loop, through the same `EngineCore.apply`: here the
messages are handed over as objects instead of being encoded onto a pipe, so the two shapes differ only
in where the core runs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from decode_service.engine_core.config import CoreConfig
from decode_service.engine_core.core import EngineCore
from decode_service.engine_core.messages import Abort, CoreStats, Pong, StepOut, StopAt, Submit
from engine.engine import Engine

logger = logging.getLogger(__name__)


class InProcessCore:
    """An engine core on this process's engine thread; create it inside the server's running loop.

    `on_step` gets each step's `StepOut` on that loop. Observers in this process (tests, benchmarks) may
    read `core` (its scheduler, step records and remote prefill).
    """

    def __init__(
        self,
        engine: Engine,
        config: CoreConfig,
        on_step: Callable[[StepOut], None],
        model_fingerprint: str | None = None,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._on_step = on_step
        self.core = EngineCore(engine, config, self._hand_over, model_fingerprint)
        self.grammars = self.core.grammars

    @property
    def stats(self) -> CoreStats:
        return self.core.stats()

    def submit(self, request: Submit) -> None:
        self.core.apply(request)

    def abort(self, request_id: str) -> None:
        self.core.apply(Abort(request_id))

    def stop_at_string(self, request_id: str, index: int, stop: str) -> None:
        self.core.apply(StopAt(request_id, index, stop))

    def start(self, warm_up: bool = True) -> None:
        self.grammars.start(warm_up)

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self.grammars.wait_ready(timeout)

    def stop(self, timeout: float | None = 10.0) -> None:
        self.grammars.stop(timeout)

    def _hand_over(self, message: StepOut | Pong) -> None:
        """From the engine thread (or the grammar gate's): to the event loop, in one wake-up per step."""
        if not isinstance(message, StepOut):
            return  # a Pong: nothing pings a core in this process
        try:
            self._loop.call_soon_threadsafe(self._on_step, message)
        except RuntimeError:
            logger.debug("event loop closed; dropped a step's message")
