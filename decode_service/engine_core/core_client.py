"""The front door's end of the pipe to an engine core in a process of its own: `CoreProcess`.

The server process keeps gRPC, HTTP, validation, tokenization, the streams and their text; the core
process (`core.run_core`) loads the model and runs `EngineCore` (scheduler, engine loop, remote prefill)
with its own GIL. Between them, two pipes carrying `engine_core.messages`: one `Commands` per batch of
submissions and aborts, one `StepOut` per engine step with every request's new tokens. This module is
the server's side alone: nothing in it runs in the core process, and the core's code runs here only to
be named as the spawn target (`core.run_core`, imported when the core is started).

`CoreProcess` is a `messages.CoreClient` (`submit`, `abort`, `stop_at_string`; and `start`,
`wait_ready`, `stop`), as `in_process.InProcessCore` is, so the front door and the server shell use
either alike. Its commands and
replies run on the server's event loop: commands gathered during one loop iteration leave in one
message, and the step messages are read as the pipe becomes readable. Neither ever blocks the loop
(the frames, below): a core that stops reading leaves the commands buffered here, not the loop waiting.

Lifecycle, from this side: the server drains, then sends `Shutdown`. If the core dies first, or leaves
a heartbeat ping unanswered for `engine_heartbeat_timeout_s` (stopped, wedged: see below; it is
then killed), `on_exit` tells the server, which ends every live request at once with UNAVAILABLE
(`lost_failure`), turns NOT_SERVING and exits non-zero. The process is started with `spawn`: forking a
process whose gRPC threads run is unsafe.

The heartbeat (`CoreHeartbeat`): ping the core, and call it dead when no answer comes.

A core process that dies closes its pipes, and the end of file tells the front door at once. A core
that is stopped (SIGSTOP, a debugger, a frozen cgroup), wedged in a step or deadlocked keeps its pipes
open: without a heartbeat, health stayed SERVING while every stream went silent and every new request
waited for its deadline. The core's engine loop answers each ping on its next iteration
(`EngineLoop.answer_heartbeat`), so an answer proves the loop still steps, not only that a thread reads
commands; a ping left unanswered for `timeout` seconds makes `on_silence` run, once.

One ping is out at a time; a tick every `interval` seconds sends the next once the last was answered,
and checks how long the one out has waited. The timeout covers the longest step the core may
legitimately run (a long prefill on a slow CPU) plus the ping's wait behind it, which is why its
default is generous.

The frames (`FrameWriter`, `FrameReader`): length-prefixed, written and read on the event loop
without ever blocking it. A blocking write into a full pipe (64 KiB on Linux) froze the whole event
loop, health included, as soon as the core stopped reading, and a blocking read of a message the core
stopped writing halfway would do the same. Here the descriptors are non-blocking: `FrameWriter` keeps
what the pipe cannot take yet and writes it as the pipe drains (`loop.add_writer`), and `FrameReader`
keeps a partial frame until the rest arrives. The framing is `multiprocessing.connection.Connection`'s
(a 4-byte big-endian signed length, or -1 then an 8-byte length past 2 GiB, then the payload), so the
core process keeps `recv_bytes` and `send_bytes` on its own threads, where blocking is harmless.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import struct
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

import grpc

from base.logs import log_event
from decode_service.engine_core.config import CoreSpec
from decode_service.engine_core.messages import (
    Abort,
    Commands,
    CoreStats,
    Delta,
    Failure,
    Ping,
    Pong,
    Ready,
    Shutdown,
    StartFailed,
    StepOut,
    StopAt,
    Submit,
    command_encoder,
    core_message_decoder,
)
from serving.errors import RelayedStatusError

logger = logging.getLogger(__name__)

# Pings leave at most this far apart (more often when the timeout is short), so a silent core is found
# within about `timeout + interval` seconds.
MAX_INTERVAL_S = 1.0


class CoreProcess:
    """The front door's handle on an engine core process; use it on the server's event loop.

    `on_step` gets each step's `StepOut` (on the event loop); `on_exit` a reason when the core dies while
    the server runs, after which the front door ends every live stream (see `_lose`).
    """

    def __init__(
        self,
        spec: CoreSpec,
        on_step: Callable[[StepOut], None],
        on_exit: Callable[[str], None],
    ) -> None:
        self.spec = spec
        self._on_step = on_step
        self._on_exit = on_exit
        self._loop: asyncio.AbstractEventLoop | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._commands: Connection | None = None
        self._replies: Connection | None = None
        self._writer: FrameWriter | None = None
        self._reader: FrameReader | None = None
        self._heartbeat: CoreHeartbeat | None = None
        self._pending: list[Submit | Abort | StopAt | Shutdown | Ping] = []
        self._ready = threading.Event()
        self._start_error: str | None = None
        self._stopping = False
        self._exited = False
        # Why the core is gone, once it is: what requests submitted after that are told.
        self._lost: str | None = None
        self.stats = CoreStats()

    # -- the engine loop's interface ---------------------------------------------------------------

    def submit(self, request: Submit) -> None:
        if self._lost is not None and self._loop is not None:
            delta = Delta(request.submission, 0, [], [], None, lost_failure(self._lost), None)
            self._loop.call_soon(self._on_step, StepOut([delta], self.stats, []))
            return
        self._send(request)

    def abort(self, request_id: str) -> None:
        self._send(Abort(request_id))

    def stop_at_string(self, request_id: str, index: int, stop: str) -> None:
        self._send(StopAt(request_id, index, stop))

    def start(self, warm_up: bool = True) -> None:
        """Spawn the core; it loads the model, warms up, then says it is ready (see `wait_ready`)."""
        # The core's module, imported here only to name its entry for the spawned process to import.
        from decode_service.engine_core.core import run_core

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
            self._on_step(message)
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
        """The core is gone: tell the server (which ends every live stream with UNAVAILABLE and exits), in
        one log line."""
        self._close_pipes()
        self._lost = reason
        if self._stopping:
            return
        log_event(logger, logging.ERROR, "engine core lost", reason=reason, **fields)
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


def lost_failure(reason: str) -> Failure:
    """What every request the lost core held, or is sent after, ends with."""
    return Failure(grpc.StatusCode.UNAVAILABLE.name, f"{reason}; retry on another replica")


class CoreHeartbeat:
    """Pings through `ping(number)`, is told of answers through `answered(number)`; use it on `loop`.

    Before it gives up it calls `read_answers`, which handles the answers already waiting in the pipe:
    when the event loop itself was held up (a long callback, a paused process), the answer may have
    arrived in time and only been read late.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        timeout: float,
        ping: Callable[[int], None],
        read_answers: Callable[[], None],
        on_silence: Callable[[float], None],
    ) -> None:
        self.timeout = timeout
        self.interval = min(MAX_INTERVAL_S, timeout / 4)
        self._loop = loop
        self._ping = ping
        self._read_answers = read_answers
        self._on_silence = on_silence
        self._number = 0
        self._outstanding: int | None = None
        self._sent_at = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._stopped = False

    def start(self) -> None:
        """Send the first ping now."""
        if not self._stopped and self._timer is None:
            self._tick()

    def stop(self) -> None:
        """No more pings, and no verdict."""
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()

    def answered(self, number: int) -> None:
        """The core answered ping `number`."""
        if number == self._outstanding:
            self._outstanding = None

    def _tick(self) -> None:
        if self._stopped:
            return
        if self._outstanding is not None and self._loop.time() - self._sent_at >= self.timeout:
            self._read_answers()
            if self._outstanding is not None and not self._stopped:
                self._stopped = True
                self._on_silence(self._loop.time() - self._sent_at)
            if self._stopped:
                return
        if self._outstanding is None:
            self._number += 1
            self._outstanding = self._number
            self._sent_at = self._loop.time()
            self._ping(self._number)
        self._timer = self._loop.call_later(self.interval, self._tick)


# ---- the frames ----------------------------------------------------------------------------------

_SHORT = struct.Struct("!i")
_LONG = struct.Struct("!Q")
_LARGEST_SHORT = 0x7FFFFFFF
# One read takes what a default Linux pipe holds; a callback reads at most this many times, so a core
# that writes without pause cannot keep the event loop in one callback.
READ_SIZE = 64 * 1024
READS_PER_CALL = 16


def frame_header(size: int) -> bytes:
    """The header `Connection.recv_bytes` reads before a payload of `size` bytes."""
    if size > _LARGEST_SHORT:
        return _SHORT.pack(-1) + _LONG.pack(size)
    return _SHORT.pack(size)


class FrameWriter:
    """Frames to a non-blocking pipe, in order, as fast as its reader takes them; use it on `loop`.

    `on_broken` is called once when the reader's end is gone (a write fails with anything but "would
    block"); what was still buffered is dropped.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, on_broken: Callable[[], None]) -> None:
        os.set_blocking(fd, False)
        self._loop = loop
        self._fd = fd
        self._on_broken = on_broken
        self._buffer = bytearray()
        self._waiting = False
        self._closed = False

    @property
    def pending_bytes(self) -> int:
        """Bytes the pipe has not taken yet."""
        return len(self._buffer)

    def send(self, payload: bytes) -> None:
        """Queue one frame and write what the pipe takes now; the rest leaves as it drains."""
        if self._closed:
            return
        self._buffer += frame_header(len(payload))
        self._buffer += payload
        if not self._waiting:
            self._write()

    def close(self) -> None:
        """Stop writing (the descriptor stays its owner's to close)."""
        self._closed = True
        self._buffer.clear()
        self._watch(False)

    def _write(self) -> None:
        try:
            while self._buffer:
                written = os.write(self._fd, self._buffer)
                # Deleting from the front of a bytearray moves its start, not its bytes.
                del self._buffer[:written]
        except BlockingIOError:
            pass
        except OSError:
            self.close()
            self._on_broken()
            return
        self._watch(bool(self._buffer))

    def _watch(self, waiting: bool) -> None:
        if waiting == self._waiting:
            return
        self._waiting = waiting
        if waiting:
            self._loop.add_writer(self._fd, self._write)
        else:
            self._loop.remove_writer(self._fd)


class FrameReader:
    """Whole frames from a non-blocking pipe, as they arrive; call `read` when the pipe is readable."""

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self._fd = fd
        self._buffer = bytearray()

    def read(self) -> list[bytes]:
        """The frames completed by what the pipe holds now (maybe none); raises EOFError once the writer
        is gone and nothing more arrived."""
        arrived = False
        for _ in range(READS_PER_CALL):
            try:
                data = os.read(self._fd, READ_SIZE)
            except BlockingIOError:
                break
            if not data:
                if not arrived:
                    raise EOFError("the pipe's writer is gone")
                break  # the frames that came first are handled; the end of file is seen next call
            arrived = True
            self._buffer += data
            if len(data) < READ_SIZE:
                break
        return self._frames()

    def _frames(self) -> list[bytes]:
        frames: list[bytes] = []
        start, length = 0, len(self._buffer)
        with memoryview(self._buffer) as view:
            while length - start >= _SHORT.size:
                (size,) = _SHORT.unpack_from(view, start)
                header = _SHORT.size
                if size == -1:
                    if length - start < _SHORT.size + _LONG.size:
                        break
                    (size,) = _LONG.unpack_from(view, start + _SHORT.size)
                    header += _LONG.size
                end = start + header + size
                if end > length:
                    break
                frames.append(bytes(view[start + header : end]))
                start = end
        del self._buffer[:start]
        return frames
