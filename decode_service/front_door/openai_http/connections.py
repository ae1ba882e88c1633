"""HTTP connections held to deadlines and a count: what uvicorn alone does not bound.

uvicorn waits forever for a request that never finishes arriving, accepts any number of connections,
and waits forever on a client that stops reading its answer. Half-sent requests then pile up until the
process runs out of file descriptors, and the gRPC port, in the same process, stops accepting too. So
each connection here must send a whole request (headers and body) within `read_timeout` seconds (408,
then closed); connections past `max_connections` get 503 and are closed at once; and a response whose
writes stay blocked on a full socket for `stall_timeout` seconds (the gRPC port's
`--stream-stall-timeout`) is dropped, which aborts its generation and frees what it buffered. The
kernel may hold at most `UNSENT_BYTES` of a response unsent (TCP_NOTSENT_LOWAT, Linux): without it,
loopback autotuning let a client that never reads park 4 MiB per connection in the kernel, and the
stall was never seen.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from decode_service.front_door.openai_http.errors import error_body

logger = logging.getLogger(__name__)

# Refusals are logged at most this often: a flood must not turn into a flood of log lines.
_LOG_INTERVAL_S = 10.0
UNSENT_BYTES = 64 * 1024


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    read_timeout: float
    stall_timeout: float


def _response(status: int, reason: str, message: str, error_type: str, code: str) -> bytes:
    body = json.dumps(error_body(message, error_type, code)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class _RefusalLog:
    """Counts refusals of one kind and logs them at most every `_LOG_INTERVAL_S`."""

    def __init__(self, event: str) -> None:
        self.event = event
        self.count = 0
        self._logged_at = 0.0

    def add(self, detail: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self._logged_at >= _LOG_INTERVAL_S:
            self._logged_at = now
            logger.warning("%s (%d so far): %s", self.event, self.count, detail)


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a read deadline, a connection cap and a write-stall deadline."""

    refused = _RefusalLog("HTTP connection refused: too many open")
    timed_out = _RefusalLog("HTTP request not received in time")
    stalled = _RefusalLog("HTTP response dropped: the client stopped reading")

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limits = limits
        self._read_deadline: asyncio.TimerHandle | None = None
        self._stall_deadline: asyncio.TimerHandle | None = None
        self._counted = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self._limits.max_connections:
            self.transport = transport
            transport.write(
                _response(
                    503,
                    "Service Unavailable",
                    f"this server holds {len(self.connections)} HTTP connections, its limit "
                    "(--http-max-connections); retry later",
                    "server_error",
                    "too_many_connections",
                )
            )
            transport.close()
            self.refused.add(f"limit {self._limits.max_connections}")
            return
        self._counted = True
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and hasattr(socket, "TCP_NOTSENT_LOWAT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, UNSENT_BYTES)
        self._arm_read_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._counted:
            return
        self._cancel_read_deadline()
        if self._stall_deadline is not None:
            self._stall_deadline.cancel()
            self._stall_deadline = None
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._read_deadline is None:
            self._arm_read_deadline()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._cancel_read_deadline()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_deadline is None:
            self._stall_deadline = self.loop.call_later(self._limits.stall_timeout, self._on_stall)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall_deadline is not None:
            self._stall_deadline.cancel()
            self._stall_deadline = None

    def _arm_read_deadline(self) -> None:
        self._read_deadline = self.loop.call_later(self._limits.read_timeout, self._on_read_timeout)

    def _cancel_read_deadline(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _on_read_timeout(self) -> None:
        self._read_deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete or not self.cycle.response_started:
            self.transport.write(
                _response(
                    408,
                    "Request Timeout",
                    f"the request did not arrive whole within {self._limits.read_timeout:g} s "
                    "(--http-read-timeout)",
                    "invalid_request_error",
                    "request_timeout",
                )
            )
        self.transport.close()
        self.timed_out.add(f"{self._limits.read_timeout:g} s")

    def _on_stall(self) -> None:
        self._stall_deadline = None
        # abort, not close: close would wait to flush the very buffer the client is not reading.
        self.transport.abort()
        self.stalled.add(f"writes blocked for {self._limits.stall_timeout:g} s (--stream-stall-timeout)")
