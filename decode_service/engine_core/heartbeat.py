"""The front door's heartbeat on the engine core: ping it, and call it dead when no answer comes.

A core process that dies closes its pipes, and the end of file tells the front door at once. A core
that is stopped (SIGSTOP, a debugger, a frozen cgroup), wedged in a step or deadlocked keeps its pipes
open: without a heartbeat, health stayed SERVING while every stream went silent and every new request
waited for its deadline. The core's engine loop answers each ping on its next iteration
(`EngineLoop.answer_heartbeat`), so an answer proves the loop still steps, not only that a thread reads
commands; a ping left unanswered for `timeout` seconds makes `on_silence` run, once.

One ping is out at a time; a tick every `interval` seconds sends the next once the last was answered,
and checks how long the one out has waited. The timeout
covers the longest step the core may legitimately run (a long prefill on a slow CPU) plus the ping's
wait behind it, which is why its default is generous.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

# Pings leave at most this far apart (more often when the timeout is short), so a silent core is found
# within about `timeout + interval` seconds.
MAX_INTERVAL_S = 1.0


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
