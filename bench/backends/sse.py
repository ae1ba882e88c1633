"""A minimal asyncio HTTP/1.1 client for JSON requests and server-sent-event streams (stdlib only).

The load generator needs first-byte timing of every streamed event, not a full HTTP stack, and the
benchmark must run with nothing beyond the standard library; so this speaks just enough HTTP/1.1: one
request per connection (`Connection: close`), chunked or close-delimited bodies, `data:` events.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


class HttpError(RuntimeError):
    """The server answered with a non-2xx status or an unreadable response."""


async def _request(
    url: str, method: str, payload: dict | None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    reader, writer = await asyncio.open_connection(host, port)
    body = b"" if payload is None else json.dumps(payload).encode()
    head = (
        f"{method} {parts.path or '/'} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n"
        f"Accept: text/event-stream, application/json\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode() + body)
    await writer.drain()
    status_line = await reader.readline()
    fields = status_line.decode("latin-1").split(" ", 2)
    if len(fields) < 2 or not fields[1].isdigit():
        writer.close()
        raise HttpError(f"{method} {url}: malformed status line {status_line!r}")
    chunked = False
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        if name.strip().lower() == "transfer-encoding" and "chunked" in value.lower():
            chunked = True
    status = int(fields[1])
    if not 200 <= status < 300:
        detail = (await _read_body(reader, chunked))[:500]
        writer.close()
        raise HttpError(f"{method} {url}: HTTP {status}: {detail!r}")
    return reader, writer, chunked


async def _body_pieces(reader: asyncio.StreamReader, chunked: bool) -> AsyncIterator[bytes]:
    if not chunked:
        while piece := await reader.read(65536):
            yield piece
        return
    while True:
        size_line = await reader.readline()
        if not size_line:
            return
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return
        yield await reader.readexactly(size)
        await reader.readline()


async def _read_body(reader: asyncio.StreamReader, chunked: bool) -> bytes:
    return b"".join([piece async for piece in _body_pieces(reader, chunked)])


async def get_json(url: str) -> dict:
    reader, writer, chunked = await _request(url, "GET", None)
    try:
        return json.loads(await _read_body(reader, chunked))
    finally:
        writer.close()


async def post_sse(url: str, payload: dict) -> AsyncIterator[dict]:
    """POST `payload` and yield each `data:` event as parsed JSON, as soon as its line is complete;
    stops at `data: [DONE]` or the end of the body."""
    reader, writer, chunked = await _request(url, "POST", payload)
    buffer = b""
    try:
        async for piece in _body_pieces(reader, chunked):
            buffer += piece
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                yield json.loads(data)
    finally:
        writer.close()
