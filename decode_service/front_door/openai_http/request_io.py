"""What every HTTP route of the front door does with a request before its protocol's own work: check the
API key, read the JSON body within the size and object limits, and notice a client that left.

Every API the front door speaks (OpenAI's, Anthropic's, vLLM's tokenizer routes) goes through these, so
one body or key is refused the same way whichever route it was sent to.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request

from base.auth import AUTHORIZATION_HEADER, BearerTokens
from base.errors import InvalidRequestError
from decode_service.front_door import json_text
from decode_service.front_door.admission import RequestLimits
from decode_service.front_door.openai_http.errors import (
    BodyTooLargeError,
    FieldError,
    ModelNotServedError,
    UnauthorizedError,
)

T = TypeVar("T")

# Sets the request's id (the one `Abort` and the logs use), on every generation route.
REQUEST_ID_HEADER = "x-request-id"
# Where Anthropic's SDKs send the key (OpenAI's send `Authorization: Bearer`).
API_KEY_HEADER = "x-api-key"


class ApiKeys:
    """The server's bearer token(s), presented as `Authorization: Bearer <key>` or as `x-api-key: <key>`
    (the header Anthropic's clients send), on every route."""

    def __init__(self, token: str | None) -> None:
        """`token`: None when the server takes requests without one."""
        self._tokens = BearerTokens(token) if token else None

    def authorize(self, request: Request) -> None:
        """Raise `UnauthorizedError` unless `request` carries an accepted key."""
        if self._tokens is None:
            return
        headers = request.headers
        presented = headers.items()
        if AUTHORIZATION_HEADER not in headers and API_KEY_HEADER in headers:
            presented = [(AUTHORIZATION_HEADER, f"Bearer {headers[API_KEY_HEADER]}")]
        reason = self._tokens.rejection(presented)
        if reason is not None:
            raise UnauthorizedError(reason)


async def read_json(request: Request, max_bytes: int, limits: RequestLimits) -> object:
    """The body as JSON, refusing one larger than `max_bytes` before reading it all, and one with more
    objects than `limits` allow as soon as the parser has built that many."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLargeError(
            f"the request body has {declared} bytes; this server takes at most {max_bytes}"
        )
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > max_bytes:
            raise BodyTooLargeError(f"the request body exceeds this server's limit of {max_bytes} bytes")
    # Braces inside strings count here too, so only then are the parsed objects counted, one by one.
    counted = _counted_objects(limits) if body.count(b"{") > limits.max_json_objects else None
    try:
        return json_text.loads(body, parse_constant=_refuse_constant, object_pairs_hook=counted)
    except _TooManyObjects as exc:
        raise FieldError("body", str(exc.__cause__)) from None
    except json_text.LoneSurrogateError as exc:  # valid JSON but no text: it could never be encoded
        where = exc.path or "body"
        raise FieldError(where, f"{where} holds a lone UTF-16 surrogate") from None
    except json_text.JsonTextError as exc:
        raise FieldError("body", f"the request body {exc}") from None


class _TooManyObjects(Exception):
    """Raised out of the parser (which would wrap a ValueError as bad JSON); the refusal is its cause."""


def _counted_objects(limits: RequestLimits) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    count = 0

    def build(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal count
        count += 1
        try:
            limits.check_json_objects(count)
        except InvalidRequestError as refused:
            raise _TooManyObjects from refused
        return dict(pairs)

    return build


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


async def _wait_for_disconnect(request: Request) -> None:
    """Return once the client has gone (the body is already read, so only a disconnect can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> asyncio.Future[T] | None:
    """`work` run to its end, as a done future (its result or its error), or None when the client left
    first (`work` is then cancelled)."""
    task = asyncio.ensure_future(work)
    disconnected = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait((task, disconnected), return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnected.cancel()
        if not task.done():
            task.cancel()
    return None if task.cancelled() else task


def check_model(asked: str | None, served: str) -> None:
    """Refuse a request that names a model this server does not serve (None: the client named none)."""
    if asked is not None and asked != served:
        raise ModelNotServedError(f"the model {asked!r} does not exist; this server serves {served!r}")
