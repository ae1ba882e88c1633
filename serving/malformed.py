"""Requests that do not parse get INVALID_ARGUMENT with one line, not UNKNOWN and a stack trace.

gRPC parses a request before any handler runs, so a `prompt` that is not UTF-8 (protobuf `string`
fields must be) fails inside the framework, which answers UNKNOWN and logs a traceback. This
interceptor swaps each method's parser for one that hands the handler a `MalformedRequest` instead of
raising, and ends such calls with INVALID_ARGUMENT before the handler sees them.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from base.logs import log_event

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MalformedRequest:
    """Stands in for a request whose bytes did not parse; `reason` is the parser's one-line message."""

    method: str
    reason: str


def _safe_parser(method: str, parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse_or_flag(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:
            return MalformedRequest(method, " ".join(str(exc).split()))

    return parse_or_flag


async def _refuse(request: MalformedRequest, context: grpc.aio.ServicerContext) -> None:
    log_event(logger, logging.INFO, "request refused", code="INVALID_ARGUMENT", reason=request.reason)
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"the {request.method} request does not parse (string fields must be UTF-8): {request.reason}",
    )


def _guard_unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, MalformedRequest):
            await _refuse(request, context)
        return await behavior(request, context)

    return guarded


def _guard_stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
    if not inspect.isasyncgenfunction(behavior):
        return _guard_unary(behavior)  # a handler that streams with `context.write`

    # An async generator function itself: gRPC tells streaming handlers apart by their function type.
    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, MalformedRequest):
            await _refuse(request, context)
        async for response in behavior(request, context):
            yield response

    return guarded


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Wraps unary-request methods (all of tandem's) so a request that does not parse is refused cleanly."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        parse = _safe_parser(method, handler.request_deserializer)
        if handler.response_streaming:
            return handler._replace(
                request_deserializer=parse, unary_stream=_guard_stream(handler.unary_stream)
            )
        return handler._replace(request_deserializer=parse, unary_unary=_guard_unary(handler.unary_unary))
