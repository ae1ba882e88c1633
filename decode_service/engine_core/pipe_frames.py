"""Length-prefixed frames over a pipe, written and read on an event loop without ever blocking it.

The front door's end of each pipe to the engine core: a blocking write into a full pipe (64 KiB on
Linux) froze the whole event loop, health included, as soon as the core stopped reading, and a blocking
read of a message the core stopped writing halfway would do the same. Here the descriptors are
non-blocking: `FrameWriter` keeps what the pipe cannot take yet and writes it as the pipe drains
(`loop.add_writer`), and `FrameReader` keeps a partial frame until the rest arrives.

The framing is `multiprocessing.connection.Connection`'s (a 4-byte big-endian signed length, or -1 then
an 8-byte length past 2 GiB, then the payload), so the core process keeps `recv_bytes` and `send_bytes`
on its own threads, where blocking is harmless.
"""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import Callable

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
