"""The engine core process's end of the pipe: `run_core`, the entry the front door spawns.

The core process loads the model and runs `EngineCore` (scheduler, engine loop, remote prefill) with
its own GIL; the server process keeps everything else and talks to it through `core_client`'s
`EngineProcess`. This module is the core's side alone: it reads the server's `Commands` (submissions,
aborts, stop strings, heartbeat pings) and hands them to the engine loop, and answers with one
`StepOut` per engine step, written on `StepWriter`'s thread. Only `engine_core.messages` (and
`config.CoreSpec`, received once at spawn) are shared with the server's end.

Lifecycle: the core ignores SIGINT and SIGTERM (the server drains, then sends `Shutdown`), and dies
with the server (parent-death signal, and end of file on its command pipe). A heartbeat ping is
answered from the engine loop, so the answer proves the loop still steps.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection

from decode_service.engine_core.config import CoreSpec
from decode_service.engine_core.core import EngineCore
from decode_service.engine_core.grammar_gate import GrammarGate
from decode_service.engine_core.messages import (
    Abort,
    CoreStats,
    Delta,
    Failure,
    Ping,
    Pong,
    Ready,
    RequestState,
    StartFailed,
    StepOut,
    StopAt,
    Submit,
    commands_decoder,
)
from decode_service.engine_core.request import ServedRequest, StreamDelta
from decode_service.engine_core.step_writer import Reply, StepWriter
from engine.engine import Engine
from engine.sequence import Sequence
from serving.status import status_for

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
    sender = _StepSender(replies)
    try:
        engine = Engine.from_pretrained(spec.model_dir, spec.engine_config)
        engine.grammar_fill_observer = sender.observe_grammar_fill
        core = EngineCore(engine, spec.config, sender.send, spec.model_fingerprint, record_steps=False)
        sender.stats = core.stats
        grammars = GrammarGate.for_engine(core.loop, engine, spec.config.grammar)
        await core.start_dependencies()
        core.loop.start(warm_up=warm_up)
        await asyncio.to_thread(core.loop.wait_ready)
    except Exception as exc:
        logger.exception("engine core could not start")
        sender.write(StartFailed(f"{type(exc).__name__}: {exc}"))
        await asyncio.to_thread(sender.close)
        return
    sender.write(Ready())
    logger.info("engine core ready (pid %d, %d KV blocks)", os.getpid(), engine.num_blocks)
    await asyncio.to_thread(_apply_commands, commands, core, grammars, sender)
    await asyncio.to_thread(grammars.stop)
    await core.close_dependencies()
    # After the loop stopped: its last deltas (the aborts of `_on_stop`) are queued, and leave now.
    await asyncio.to_thread(sender.close)


def _apply_commands(
    commands: Connection, core: EngineCore, grammars: GrammarGate, sender: _StepSender
) -> None:
    """Read command batches and hand them to the engine loop until `Shutdown` or end of file; requests
    with a constraint go through `grammars`, which compiles it on its own thread, never on this one."""
    loop = core.loop
    while True:
        try:
            batch = commands_decoder.decode(commands.recv_bytes())
        except (EOFError, OSError):
            logger.info("the server is gone; stopping the engine core")
            return
        for command in batch.commands:
            if isinstance(command, Submit):
                try:
                    grammars.submit(_served_request(command))
                except Exception as exc:
                    sender.fail_submission(command, exc)
            elif isinstance(command, Abort):
                grammars.abort(command.request_id)
            elif isinstance(command, StopAt):
                loop.stop_at_string(command.request_id, command.index, command.stop)
            elif isinstance(command, Ping):
                # Answered from the engine loop, not from here: the answer proves the loop steps.
                loop.answer_heartbeat(functools.partial(sender.write, Pong(command.number)))
            else:
                return


def _served_request(command: Submit) -> ServedRequest:
    seq = Sequence(
        command.request_id,
        command.prompt_token_ids,
        command.sampling,
        command.stopping,
        command.arrival_time,
        command.cache_salt,
    )
    return ServedRequest(
        seq,
        priority=command.priority,
        tenant=command.tenant,
        arrival_time=command.arrival_time,
        n=command.n,
        submission=command.submission,
        grammar=command.grammar,
    )


class _StepSender:
    """The engine loop's `deliver` in the core process: each step's deltas and counters, as one message.

    The engine thread only converts the deltas (`_delta` reads request fields the next step changes);
    encoding and writing happen on `StepWriter`'s thread, so a front door that reads slowly holds the
    steps only once `MAX_QUEUED` messages wait."""

    def __init__(self, replies: Connection) -> None:
        self._writer = StepWriter(replies)
        self.stats: Callable[[], CoreStats] = CoreStats
        self.grammar_fill_seconds: list[float] = []

    def observe_grammar_fill(self, seconds: float) -> None:
        """The engine's observer of a step's mask fill; `send` takes them with the step's deltas."""
        self.grammar_fill_seconds.append(seconds)

    def send(self, deltas: list[StreamDelta]) -> None:
        fills, self.grammar_fill_seconds = self.grammar_fill_seconds, []
        self.write(StepOut([_delta(d) for d in deltas], self.stats(), fills))

    def fail_submission(self, command: Submit, error: Exception) -> None:
        code, message = status_for(error)
        state = RequestState(0, None, None, None, None, 0, False)
        self.write(
            StepOut(
                [Delta(command.submission, 0, [], [], None, Failure(code.name, message), state)],
                self.stats(),
                [],
            )
        )

    def write(self, message: Reply) -> None:
        """Queue `message` after every one written before it, from any thread."""
        self._writer.put(message)

    def close(self) -> None:
        """Write what is queued, then end the writer thread (the core is exiting)."""
        self._writer.close()


def _delta(delta: StreamDelta) -> Delta:
    request = delta.request
    seq = request.seq
    error = None
    if delta.error is not None:
        code, message = status_for(delta.error)
        error = Failure(code.name, message)
    state = None
    if delta.is_last or seq.num_output_tokens == len(delta.token_ids):
        state = RequestState(
            seq.num_cached_tokens,
            seq.matched_stop,
            request.admitted_time,
            request.prefill_done_time,
            request.first_token_time,
            request.num_preemptions,
            request.forked,
        )
    return Delta(
        request.stream_owner.submission,
        request.index,
        delta.token_ids,
        [(lp.token_id, lp.logprob, lp.top) for lp in delta.logprobs] if delta.logprobs else [],
        delta.finish_reason.value if delta.finish_reason is not None else None,
        error,
        state,
    )
