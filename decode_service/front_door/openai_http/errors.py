"""Failures of HTTP requests → OpenAI error bodies, `{"error": {message, type, param, code}}`, and statuses.

Errors shared with gRPC go through `serving.status.status_for` first, so a request refused over HTTP is
refused for the same reason, with the same message, as over gRPC; only the gRPC code is translated, and
an error naming a gRPC field (`field`, e.g. "tools[1].parameters_json") names the HTTP parameter the
client sent instead (e.g. "tools[1].function.parameters").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpc

from base.errors import InvalidRequestError, TandemError
from serving.status import status_for

logger = logging.getLogger(__name__)


class ModelNotServedError(TandemError):
    """The request names a model this server does not serve (404, as OpenAI answers)."""


class UnauthorizedError(TandemError):
    """The bearer token is missing or wrong (401)."""


class BodyTooLargeError(TandemError):
    """The request body exceeds the server's message size limit (413)."""


class ResponseNotFoundError(TandemError):
    """No stored response has the id the request names, for this tenant (404, as OpenAI answers); `param`
    names the field that gave the id (None: the URL's path)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


class FieldError(InvalidRequestError):
    """A request field of the wrong JSON type or shape; `param` names it for the error body, and the
    message starts with it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param

    def under(self, parent: str) -> FieldError:
        """This error for the same field inside `parent` (e.g. `content` inside `messages[2]`)."""
        if not parent:
            return self
        joined = f"{parent}{self.param}" if self.param.startswith("[") else f"{parent}.{self.param}"
        return type(self)(joined, joined + str(self)[len(self.param) :])


class UnsupportedFieldError(FieldError):
    """A request field tandem does not implement (a 400 naming it, as OpenAI clients expect)."""

    @classmethod
    def of(cls, param: str, detail: str = "is not supported by this server") -> UnsupportedFieldError:
        return cls(param, f"{param} {detail}")


# HTTP status, OpenAI error type and code for each gRPC status the servers use.
_BY_GRPC_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (500, "server_error"),
    grpc.StatusCode.INTERNAL: (500, "server_error"),
}
_HTTP_ONLY: tuple[tuple[type[TandemError], int, str, str], ...] = (
    (ModelNotServedError, 404, "not_found_error", "model_not_found"),
    (UnauthorizedError, 401, "authentication_error", "invalid_api_key"),
    (BodyTooLargeError, 413, "invalid_request_error", "request_too_large"),
    (ResponseNotFoundError, 404, "invalid_request_error", "response_not_found"),
)


def error_body(message: str, error_type: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def http_error(error: Exception, param_for: Callable[[str], str] | None = None) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error body for an error raised while serving a request; `param_for`
    maps a gRPC field path to the request's HTTP parameter (`OpenAIRequest.param_for`)."""
    for error_type, status, kind, code in _HTTP_ONLY:
        if isinstance(error, error_type):
            return status, error_body(str(error), kind, code, getattr(error, "param", None))
    grpc_code, message = status_for(error)
    status, kind = _BY_GRPC_STATUS.get(grpc_code, (500, "server_error"))
    if status == 500:
        logger.error("request failed: %r", error, exc_info=error)
    param = getattr(error, "param", None)
    field = getattr(error, "field", None)
    if isinstance(field, str):
        param = param_for(field) if param_for is not None else field
        if message.startswith(field):
            message = param + message[len(field) :]
    return status, error_body(message, kind, grpc_code.name.lower(), param)


# Anthropic's error type for each HTTP status tandem answers with (anything else: api_error).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error(
    error: Exception, param_for: Callable[[str], str] | None = None
) -> tuple[int, dict[str, Any]]:
    """The HTTP status and Anthropic error body, `{"type": "error", "error": {"type", "message"}}`, for an
    error raised while serving an Anthropic route: the status and message the OpenAI routes give."""
    status, body = http_error(error, param_for)
    kind = _ANTHROPIC_TYPES.get(status, "api_error")
    return status, {"type": "error", "error": {"type": kind, "message": body["error"]["message"]}}
