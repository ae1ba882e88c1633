"""The engine core process's end of the pipe: `run_core`, the entry the front door spawns.

The core process loads the model and runs `EngineCore` (scheduler, engine loop, remote prefill,
grammar gate) with its own GIL; the server process keeps everything else and talks to it through
`core_client`'s `CoreProcess`. This module is the core's side alone: it reads the server's `Commands`
(submissions, aborts, stop strings, heartbeat pings) and applies them through `EngineCore.apply`,
whose one `StepOut` per engine step is written on `StepWriter`'s thread. Only `engine_core.messages`
(and `config.CoreSpec`, received once at spawn) are shared with the server's end (`core_client`).

Lifecycle: the core ignores SIGINT and SIGTERM (the server drains, then sends `Shutdown`), and dies
with the server (parent-death signal, and end of file on its command pipe). A heartbeat ping is
answered from the engine loop, so the answer proves the loop still steps.

Replies, encoded and written on a thread of their own, in order (`StepWriter`).

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

import asyncio
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from base.heap import freeze_startup_objects
from base.logs import log_event
from decode_service.engine_core.config import CoreSpec
from decode_service.engine_core.core import EngineCore
from decode_service.engine_core.messages import (
    Pong,
    Ready,
    StartFailed,
    StepOut,
    command_encoder,
    commands_decoder,
)
from engine.engine import Engine

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
MAX_QUEUED = 256

Reply = StepOut | Ready | StartFailed | Pong


def run_core(spec: CoreSpec, warm_up: bool, commands: Connection, replies: Connection) -> None:
    """The core process's entry: serve commands until `Shutdown` or the server's end, then exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    from base.logs import use_log_format

    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    use_log_format(spec.log_format)
    if spec.threads is not None:
        import torch

        torch.set_num_threads(spec.threads)
    asyncio.run(_serve_core(spec, warm_up, commands, replies))


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # elsewhere than Linux: the end of file on the command pipe still ends the core


async def _serve_core(spec: CoreSpec, warm_up: bool, commands: Connection, replies: Connection) -> None:
    writer = StepWriter(replies)
    try:
        engine = Engine.from_pretrained(spec.model_dir, spec.engine_config)
        core = EngineCore(engine, spec.config, writer.put, spec.model_fingerprint, record_steps=False)
        await core.start_dependencies()
        core.grammars.start(warm_up=warm_up)
        await asyncio.to_thread(core.grammars.wait_ready)
    except Exception as exc:
        logger.exception("engine core could not start")
        writer.put(StartFailed(f"{type(exc).__name__}: {exc}"))
        await asyncio.to_thread(writer.close)
        return
    freeze_startup_objects()
    writer.put(Ready())
    logger.info("engine core ready (pid %d, %d KV blocks)", os.getpid(), engine.num_blocks)
    await asyncio.to_thread(_apply_commands, commands, core)
    await asyncio.to_thread(core.grammars.stop)
    await core.close_dependencies()
    # After the loop stopped: its last deltas (the aborts of `_on_stop`) are queued, and leave now.
    await asyncio.to_thread(writer.close)


def _apply_commands(commands: Connection, core: EngineCore) -> None:
    """Read command batches and apply them until `Shutdown` or end of file."""
    while True:
        try:
            batch = commands_decoder.decode(commands.recv_bytes())
        except (EOFError, OSError):
            logger.info("the server is gone; stopping the engine core")
            return
        for command in batch.commands:
            if not core.apply(command):
                return


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
