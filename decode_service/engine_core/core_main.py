"""The engine core process's end of the pipe: `run_core`, the entry the front door spawns.

The core process loads the model and runs `EngineCore` (scheduler, engine loop, remote prefill) with
its own GIL; the server process keeps everything else and talks to it through `core_client`'s
`CoreProcess`. This module is the core's side alone: it reads the server's `Commands` (submissions,
aborts, stop strings, heartbeat pings) and applies them through `CoreBoundary`, whose one `StepOut` per
engine step is written on `StepWriter`'s thread. Only `engine_core.messages` (and `config.CoreSpec`,
received once at spawn) are shared with the server's end.

Lifecycle: the core ignores SIGINT and SIGTERM (the server drains, then sends `Shutdown`), and dies
with the server (parent-death signal, and end of file on its command pipe). A heartbeat ping is
answered from the engine loop, so the answer proves the loop still steps.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from multiprocessing.connection import Connection

from base.heap import freeze_startup_objects
from decode_service.engine_core.config import CoreSpec
from decode_service.engine_core.core_boundary import CoreBoundary
from decode_service.engine_core.messages import Ready, StartFailed, commands_decoder
from decode_service.engine_core.step_writer import StepWriter
from engine.engine import Engine

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


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
        boundary = CoreBoundary(engine, spec.config, writer.put, spec.model_fingerprint, record_steps=False)
        await boundary.core.start_dependencies()
        boundary.grammars.start(warm_up=warm_up)
        await asyncio.to_thread(boundary.grammars.wait_ready)
    except Exception as exc:
        logger.exception("engine core could not start")
        writer.put(StartFailed(f"{type(exc).__name__}: {exc}"))
        await asyncio.to_thread(writer.close)
        return
    freeze_startup_objects()
    writer.put(Ready())
    logger.info("engine core ready (pid %d, %d KV blocks)", os.getpid(), engine.num_blocks)
    await asyncio.to_thread(_apply_commands, commands, boundary)
    await asyncio.to_thread(boundary.grammars.stop)
    await boundary.core.close_dependencies()
    # After the loop stopped: its last deltas (the aborts of `_on_stop`) are queued, and leave now.
    await asyncio.to_thread(writer.close)


def _apply_commands(commands: Connection, boundary: CoreBoundary) -> None:
    """Read command batches and apply them until `Shutdown` or end of file."""
    while True:
        try:
            batch = commands_decoder.decode(commands.recv_bytes())
        except (EOFError, OSError):
            logger.info("the server is gone; stopping the engine core")
            return
        for command in batch.commands:
            if not boundary.apply(command):
                return
