"""The core process's replies (`core_main`), encoded and written on a thread of their own, in order.

The engine thread used to encode each step's message and write it to the replies pipe itself, with a
blocking `send_bytes`: a front door that stopped reading for a while (its event loop busy) filled the
pipe (64 KiB on Linux) and then held the engine's steps, for every stream, until it read again. Now the
engine thread hands the finished message to a bounded queue and goes on stepping; one writer thread
encodes the messages and writes them, in the order they were put. Every reply goes through the same
queue (`Ready`, `StartFailed`, `Pong`, a failed submission's `StepOut`), so none overtakes a step.

The bound is a count of messages, `MAX_QUEUED` = 256: a count, not bytes, because a message is only
encoded (and sized) on the writer thread. 256 steps is 2.5 s of 10 ms steps, so a front door that
pauses 2 s costs no step (`bench/slow_front_door.py`); memory stays bounded (a step message carries
one or a few tokens per running stream: about 5 KiB for 64 streams with 5 top logprobs, so 1.3 MiB
queued then). When the queue is full, `put` blocks: backpressure on the engine thread, never a dropped
token.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from base.logs import log_event
from decode_service.engine_core.messages import Pong, Ready, StartFailed, StepOut, command_encoder

logger = logging.getLogger(__name__)

MAX_QUEUED = 256

Reply = StepOut | Ready | StartFailed | Pong


class StepWriter:
    """Encodes and writes `put` messages to `replies` on its own thread; `close` flushes and ends it.

    A broken pipe (the server is gone) is logged once; the messages after it are dropped unwritten, and
    the queue keeps draining so that `put` never waits on a reader that is gone.
    """

    def __init__(
        self,
        replies: Connection,
        max_queued: int = MAX_QUEUED,
        encode: Callable[[Reply], bytes] = command_encoder.encode,
    ) -> None:
        self._replies = replies
        self._encode = encode
        self._max_queued = max_queued
        # None: the end (`close`), put after every message to write. A SimpleQueue's put and get are
        # single C calls, where `queue.Queue`'s take its Python condition on both sides: on the engine
        # thread, once per step.
        self._queue: queue.SimpleQueue[Reply | None] = queue.SimpleQueue()
        # Messages put and taken. `_put` is counted under `_putting` (the engine thread puts steps, the
        # command reader pongs); `_taken` only by the writer thread. `_room` is waited on only by a
        # producer that found the queue full; the writer notifies it as it takes a message.
        self._put = 0
        self._taken = 0
        self._putting = threading.Lock()
        self._room = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="tandem-core-writer", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        """Messages put and not yet taken by the writer thread."""
        return self._put - self._taken

    def put(self, message: Reply) -> None:
        """Queue `message` after those put before; blocks while the queue is full."""
        with self._putting:
            # Under the lock, so that two producers cannot both take the last free place.
            self._wait_for_room(None)
            self._put += 1
            self._queue.put(message)

    def _wait_for_room(self, timeout: float | None) -> bool:
        """True once fewer than `max_queued` messages wait; False if `timeout` passed first. A stale read
        of `_taken` can only make the queue look fuller, which the locked check below then corrects."""
        if self._put - self._taken < self._max_queued:
            return True
        with self._room:
            return self._room.wait_for(lambda: self._put - self._taken < self._max_queued, timeout)

    def close(self, timeout: float = 10.0) -> bool:
        """Write every message put before, then end the thread; True when it ended within `timeout`.

        A front door that never reads again must not keep the core from exiting: after `timeout` this
        returns anyway (the thread is a daemon)."""
        deadline = time.monotonic() + timeout
        if self._wait_for_room(timeout):
            self._queue.put(None)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            log_event(logger, logging.WARNING, "core replies unflushed", queued=self.queued, waited_s=timeout)
            return False
        return True

    def _take(self) -> Reply | None:
        message = self._queue.get()
        with self._room:
            self._taken += 1
            self._room.notify()
        return message

    def _run(self) -> None:
        broken = False
        while (message := self._take()) is not None:
            if broken:
                continue
            try:
                self._replies.send_bytes(self._encode(message))
            except OSError as exc:
                broken = True
                log_event(logger, logging.INFO, "core replies pipe closed", error=type(exc).__name__)
            except Exception:
                # As the engine loop does with a failed delivery: logged, and the thread lives on (a dead
                # writer would leave the engine thread blocked on a full queue).
                logger.exception("encoding a %s failed", type(message).__name__)
