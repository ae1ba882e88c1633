"""The engine thread both tiers run: one thread owns the engine and runs its steps back to back.

Model work never runs on the gRPC event loop. Handlers reach the thread only through a locked inbox
(`_post`), drained at the start of each step, and `wake` (news that waits outside the inbox, such as a
finished remote prefill); the thread reports back through one `deliver` call per step carrying every
call's events, so the event loop wakes once per step, not once per token or block.

A warm-up forward runs before the first step; when it fails, `wait_ready` re-raises its error, so the
server exits naming it instead of holding its port bound while never reporting SERVING.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from engine.engine import Engine
from serving import openmp_pool
from serving.event_log import EventLog

logger = logging.getLogger(__name__)

CommandT = TypeVar("CommandT")
EventT = TypeVar("EventT")
RecordT = TypeVar("RecordT")

Deliver = Callable[[list[EventT]], None]

# After a step raises, the next waits this long, doubled per failure in a row up to the cap: a loop that
# keeps failing logs a traceback a second at most instead of spinning a core.
FIRST_BACKOFF_S = 0.01
MAX_BACKOFF_S = 1.0


def backoff_seconds(failures: int) -> float:
    """The wait after `failures` failed steps in a row."""
    return min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (failures - 1))


class EngineThread(ABC, Generic[CommandT, EventT, RecordT]):
    """Inbox, warm-up, stop and per-step delivery around one engine; a tier adds its step.

    Subclasses implement `step_once` (drain the inbox with `_take_inbox`, schedule, run, deliver;
    False when nothing ran) and `_on_stop` (what becomes of the calls still live when the thread
    exits). `step_once` is public so tests can drive a tier synchronously without starting the thread.
    """

    thread_name = "engine"

    def __init__(self, engine: Engine, deliver: Deliver[EventT], event_log: EventLog[RecordT] | None) -> None:
        self.engine = engine
        self.events = event_log
        self._deliver = deliver
        self._inbox: deque[CommandT] = deque()
        self._wakeup = threading.Condition()
        self._woken = False
        self._stopping = False
        self._ready = threading.Event()
        self._warm_up_error: Exception | None = None
        self._thread: threading.Thread | None = None
        self.num_steps = 0

    # -- thread-safe entry points --------------------------------------------------------------------

    def wake(self) -> None:
        """Run a step soon even if nothing was posted (thread-safe): news waits outside the inbox."""
        with self._wakeup:
            self._woken = True
            self._wakeup.notify()

    def _post(self, command: CommandT) -> None:
        with self._wakeup:
            self._inbox.append(command)
            self._wakeup.notify()

    # -- lifecycle -----------------------------------------------------------------------------------

    def start(self, warm_up: bool = True) -> None:
        """Start the thread; with `warm_up` it first runs one tiny forward (see `wait_ready`).

        The caller built the engine; its idle OpenMP workers are released first (`serving.openmp_pool`).
        """
        openmp_pool.release_caller_pool()
        self._thread = threading.Thread(target=self._run, args=(warm_up,), name=self.thread_name, daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the warm-up forward is done; True when it is. Re-raises a failed warm-up's error."""
        ready = self._ready.wait(timeout)
        if self._warm_up_error is not None:
            raise self._warm_up_error
        return ready

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the thread after its current step; `_on_stop` settles the calls still live."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("%s thread did not stop within %s s", self.thread_name, timeout)

    def warm_up(self) -> None:
        """One single-token forward and sample, so the first real request does not pay for lazy init."""
        self.engine.warm_up()
        logger.info("warm-up forward done")

    def _run(self, warm_up: bool) -> None:
        try:
            if warm_up:
                self.warm_up()
        except Exception as exc:
            # The server must not report SERVING on an engine that cannot run a forward.
            logger.exception("warm-up forward failed")
            self._warm_up_error = exc
            return
        finally:
            self._ready.set()
        ran = False
        failures = 0
        while True:
            self._wait_for_work(ran)
            if self._stopping:
                break
            try:
                ran = self.step_once()
                failures = 0
            except Exception:
                # A bug in scheduling must not silently kill the thread every call waits on, nor spin it:
                # the work that failed is still there, so the next step would fail at once again.
                failures += 1
                logger.exception("%s step failed (%d in a row)", self.thread_name, failures)
                ran = False
                self._back_off(failures)
        self._on_stop()

    def _back_off(self, failures: int) -> None:
        """Wait `backoff_seconds(failures)` before the next step, or until asked to stop."""
        with self._wakeup:
            self._wakeup.wait_for(lambda: self._stopping, backoff_seconds(failures))

    def _wait_for_work(self, ran: bool) -> None:
        with self._wakeup:
            if ran or self._inbox or self._woken or self._stopping or self._has_work():
                return
            self._wakeup.wait(self._idle_timeout())

    # -- what a tier adds ----------------------------------------------------------------------------

    @abstractmethod
    def step_once(self) -> bool:
        """Apply queued commands, then run one step; False when there was nothing to run."""

    @abstractmethod
    def _on_stop(self) -> None:
        """The thread is exiting: end every call still live, and deliver that."""

    def _has_work(self) -> bool:
        """True when a step would run even though nothing was posted (read under the inbox lock)."""
        return False

    def _idle_timeout(self) -> float | None:
        """How long an idle thread sleeps before stepping anyway (None: until posted to)."""
        return None

    # -- helpers for `step_once` ---------------------------------------------------------------------

    def _take_inbox(self) -> list[CommandT]:
        with self._wakeup:
            commands = list(self._inbox)
            self._inbox.clear()
            self._woken = False
        return commands

    def _deliver_safely(self, events: list[EventT]) -> None:
        try:
            self._deliver(events)
        except Exception:
            logger.exception("delivering %d events failed", len(events))
