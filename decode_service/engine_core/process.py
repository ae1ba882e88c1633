"""The engine core in a process of its own, and the front door's handle on it.

The server process keeps gRPC, HTTP, validation, tokenization, the streams and their text; the core
process loads the model and runs `EngineCore` (scheduler, engine loop, remote prefill) with its own
GIL. Between them, two pipes carrying `engine_core.messages`: one `Commands` per batch of submissions
and aborts, one `StepOut` per engine step with every request's new tokens.

`EngineProcess` has the engine loop's interface (`submit`, `abort`, `stop_at_string`; `start`,
`wait_ready`, `stop`), so the front door and the server shell use either alike. Its commands and
replies run on the server's event loop: commands gathered during one loop iteration leave in one
message, and the step messages are read as the pipe becomes readable. Neither ever blocks the loop
(`pipe_frames`): a core that stops reading leaves the commands buffered here, not the loop waiting.

Lifecycle: the core ignores SIGINT and SIGTERM (the server drains, then sends `Shutdown`), and dies
with the server (parent-death signal, and end of file on its command pipe). If the core dies first,
or leaves a heartbeat ping unanswered for `engine_heartbeat_timeout_s` (stopped, wedged: see
`heartbeat`; it is then killed), every live request ends at once with UNAVAILABLE and `on_exit` tells
the server, which turns NOT_SERVING and exits non-zero. The process is started with `spawn`: forking a
process whose gRPC threads run is unsafe.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing
import os
import signal
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path

import grpc

from base.logs import log_event
from decode_service.engine_core.config import CoreConfig
from decode_service.engine_core.core import EngineCore
from decode_service.engine_core.grammar_gate import GrammarGate
from decode_service.engine_core.heartbeat import CoreHeartbeat
from decode_service.engine_core.messages import (
    Abort,
    Commands,
    CoreStats,
    Delta,
    Failure,
    Ping,
    Pong,
    Ready,
    RequestState,
    Shutdown,
    StartFailed,
    StepOut,
    StopAt,
    Submit,
    command_encoder,
    commands_decoder,
    core_message_decoder,
)
from decode_service.engine_core.pipe_frames import FrameReader, FrameWriter
from decode_service.engine_core.request import ServedRequest, StreamDelta, TokenLogprobs
from decode_service.engine_core.step_writer import Reply, StepWriter
from engine.config import EngineConfig
from engine.engine import Engine
from engine.sequence import FinishReason, Sequence
from serving.engine_thread import Deliver
from serving.errors import RelayedStatusError, TierUnavailableError
from serving.status import status_for

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
_FINISH_REASONS = {reason.value: reason for reason in FinishReason}


@dataclass(frozen=True)
class CoreSpec:
    """What the core process needs to build its engine and core; handed over once, at spawn."""

    model_dir: Path
    engine_config: EngineConfig
    # The core's part of the decode config alone (not the front door's: HTTP limits, the auth token).
    config: CoreConfig
    model_fingerprint: str | None = None
    threads: int | None = None
    log_level: int = logging.INFO
    log_format: str = "text"


class EngineProcess:
    """The front door's handle on an engine core process; use it on the server's event loop.

    `deliver` gets each step's deltas (on the event loop), `observe_grammar_fill` the seconds each step
    spent filling grammar masks, `on_exit` a reason when the core dies while the server runs.
    """

    def __init__(
        self,
        spec: CoreSpec,
        deliver: Deliver[StreamDelta],
        on_exit: Callable[[str], None],
        observe_grammar_fill: Callable[[float], None] | None = None,
    ) -> None:
        self.spec = spec
        self._deliver = deliver
        self._on_exit = on_exit
        self._observe_fill = observe_grammar_fill
        self._loop: asyncio.AbstractEventLoop | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._commands: Connection | None = None
        self._replies: Connection | None = None
        self._writer: FrameWriter | None = None
        self._reader: FrameReader | None = None
        self._heartbeat: CoreHeartbeat | None = None
        self._pending: list[Submit | Abort | StopAt | Shutdown | Ping] = []
        self._live: weakref.WeakValueDictionary[int, ServedRequest] = weakref.WeakValueDictionary()
        self._choices: weakref.WeakKeyDictionary[ServedRequest, dict[int, ServedRequest]] = (
            weakref.WeakKeyDictionary()
        )
        self._next_submission = 0
        self._ready = threading.Event()
        self._start_error: str | None = None
        self._stopping = False
        self._exited = False
        # Why the core is gone, once it is: what requests submitted after that are told.
        self._lost: str | None = None
        self.stats = CoreStats()

    # -- the engine loop's interface ---------------------------------------------------------------

    def submit(self, request: ServedRequest) -> None:
        if self._lost is not None and self._loop is not None:
            error = TierUnavailableError(f"{self._lost}; retry on another replica")
            self._loop.call_soon(self._deliver, [StreamDelta(request, error=error)])
            return
        self._next_submission += 1
        seq = request.seq
        self._live[self._next_submission] = request
        self._send(
            Submit(
                self._next_submission,
                seq.request_id,
                seq.token_ids[: seq.num_prompt_tokens],
                seq.sampling,
                seq.stopping,
                seq.cache_salt,
                request.grammar,
                request.priority,
                request.tenant,
                request.arrival_time,
                request.n,
            )
        )

    def abort(self, request_id: str) -> None:
        self._send(Abort(request_id))

    def stop_at_string(self, request_id: str, index: int, stop: str) -> None:
        self._send(StopAt(request_id, index, stop))

    def start(self, warm_up: bool = True) -> None:
        """Spawn the core; it loads the model, warms up, then says it is ready (see `wait_ready`)."""
        self._loop = asyncio.get_running_loop()
        context = multiprocessing.get_context("spawn")
        commands_in, commands_out = context.Pipe(duplex=False)
        replies_in, replies_out = context.Pipe(duplex=False)
        self._process = context.Process(
            target=run_core,
            args=(self.spec, warm_up, commands_in, replies_out),
            name="tandem-engine-core",
            daemon=True,
        )
        self._process.start()
        # Our copies of the child's ends go, so that its death is an end of file here.
        commands_in.close()
        replies_out.close()
        self._commands, self._replies = commands_out, replies_in
        self._writer = FrameWriter(self._loop, commands_out.fileno(), self._core_exited)
        self._reader = FrameReader(replies_in.fileno())
        self._loop.add_reader(replies_in.fileno(), self._read)
        self._heartbeat = CoreHeartbeat(
            self._loop,
            self.spec.config.engine_heartbeat_timeout_s,
            lambda number: self._send(Ping(number)),
            self._read,
            self._core_silent,
        )
        logger.info("engine core process started (pid %d)", self._process.pid)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the core is ready; raises why it could not start (model load, warm-up)."""
        ready = self._ready.wait(timeout)
        if self._start_error is not None:
            raise RelayedStatusError(grpc.StatusCode.UNAVAILABLE, self._start_error)
        return ready

    def stop(self, timeout: float | None = 10.0) -> None:
        """Ask the core to end every live request and exit; kill it if it has not within `timeout`.

        Called off the event loop (the server awaits it in a thread): the loop keeps reading the final
        ABORT deltas meanwhile."""
        self._stopping = True
        process = self._process
        if process is None:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._send, Shutdown())
        process.join(timeout)
        if process.is_alive():
            logger.warning("engine core did not stop within %s s; killing it", timeout)
            process.kill()
            process.join(5.0)

    # -- commands ------------------------------------------------------------------------------------

    def _send(self, command: Submit | Abort | StopAt | Shutdown | Ping) -> None:
        """Queue a command; the commands of one loop iteration leave together."""
        if not self._pending and self._loop is not None:
            self._loop.call_soon(self._flush)
        self._pending.append(command)

    def _flush(self) -> None:
        commands, self._pending = self._pending, []
        if not commands or self._writer is None or self._exited:
            return
        self._writer.send(command_encoder.encode(Commands(commands)))

    # -- replies -------------------------------------------------------------------------------------

    def _read(self) -> None:
        if self._reader is None or self._exited:
            return
        try:
            frames = self._reader.read()
        except (EOFError, OSError):
            self._core_exited()
            return
        for frame in frames:
            self._handle(core_message_decoder.decode(frame))

    def _handle(self, message: StepOut | Ready | StartFailed | Pong) -> None:
        if isinstance(message, StepOut):
            self.stats = message.stats
            if self._observe_fill is not None:
                for seconds in message.grammar_fill_seconds:
                    self._observe_fill(seconds)
            deltas = [delta for delta in map(self._stream_delta, message.deltas) if delta is not None]
            if deltas:
                self._deliver(deltas)
        elif isinstance(message, Pong):
            if self._heartbeat is not None:
                self._heartbeat.answered(message.number)
        elif isinstance(message, Ready):
            self._ready.set()
            if self._heartbeat is not None:
                self._heartbeat.start()
        else:
            self._start_error = message.message
            self._ready.set()

    def _stream_delta(self, delta: Delta) -> StreamDelta | None:
        """The delta as the front door's streams know it, on its own copy of the request (None: the
        stream is gone)."""
        owner = self._live.get(delta.submission)
        if owner is None:
            return None
        request = owner if delta.index == 0 else self._choice(owner, delta.index)
        state = delta.state
        if state is not None:
            seq = request.seq
            seq.num_cached_tokens = state.num_cached_tokens
            seq.matched_stop = state.matched_stop
            request.admitted_time = state.admitted_time
            request.prefill_done_time = state.prefill_done_time
            request.first_token_time = state.first_token_time
            request.num_preemptions = state.num_preemptions
            request.forked = state.forked
        error = None
        if delta.error is not None:
            error = RelayedStatusError(grpc.StatusCode[delta.error.code], delta.error.message)
        return StreamDelta(
            request,
            delta.token_ids,
            [TokenLogprobs(token_id, logprob, top) for token_id, logprob, top in delta.logprobs]
            if delta.logprobs
            else [],
            _FINISH_REASONS[delta.finish_reason] if delta.finish_reason is not None else None,
            error,
        )

    def _choice(self, owner: ServedRequest, index: int) -> ServedRequest:
        """Choice `index` of `owner`'s request (n > 1), made on its first delta."""
        choices = self._choices.setdefault(owner, {})
        choice = choices.get(index)
        if choice is None:
            seq = owner.seq
            copy = Sequence(
                seq.request_id,
                seq.token_ids[: seq.num_prompt_tokens],
                seq.sampling,
                seq.stopping,
                seq.arrival_time,
                seq.cache_salt,
                seq.grammar,
            )
            choice = choices[index] = replace(owner, seq=copy, index=index, parent=owner, n=owner.n)
        return choice

    def _core_exited(self) -> None:
        """A pipe to the core ended: the core died (or was killed)."""
        if self._exited:
            return
        process = self._process
        if process is not None:
            process.join(1.0)
        code = process.exitcode if process is not None else None
        if not self._ready.is_set():
            self._close_pipes()
            self._start_error = f"the engine core process exited (code {code}) before it was ready"
            self._ready.set()
            return
        self._lose(f"the engine core process exited (code {code})")

    def _core_silent(self, waited: float) -> None:
        """The heartbeat went unanswered: the core is stopped or wedged. Kill it, and go on as if it died
        (while stopping, `stop` has a timeout of its own)."""
        if self._exited or self._stopping or self._process is None:
            return
        self._process.kill()
        timeout = self.spec.config.engine_heartbeat_timeout_s
        self._lose(
            f"the engine core process (pid {self._process.pid}) did not answer a heartbeat within "
            f"{timeout:g} s (--engine-heartbeat-timeout) and was killed",
            waited_s=round(waited, 3),
        )

    def _lose(self, reason: str, **fields: object) -> None:
        """The core is gone: end every live request with UNAVAILABLE and tell the server, in one log line."""
        self._close_pipes()
        self._lost = reason
        if self._stopping:
            return
        live = list(self._live.values())
        log_event(logger, logging.ERROR, "engine core lost", reason=reason, live_requests=len(live), **fields)
        error = TierUnavailableError(f"{reason}; retry on another replica")
        deltas = [StreamDelta(owner, error=error) for owner in live]
        if deltas:
            self._deliver(deltas)
        self._on_exit(reason)

    def _close_pipes(self) -> None:
        """Stop reading, writing and pinging: nothing more comes from or goes to this core."""
        self._exited = True
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self._writer is not None:
            self._writer.close()
        if self._loop is not None and self._replies is not None:
            self._loop.remove_reader(self._replies.fileno())


# -- the core process --------------------------------------------------------------------------------


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
