"""Typed exceptions for gRPC status codes, so callers catch `ResourceExhausted` rather than parse codes.

Every failed call surfaces as exactly one `TandemError` subclass carrying the status code, its name
and the server's message; the raw `grpc.RpcError` is kept as `__cause__` for debugging.
"""

from __future__ import annotations

import grpc


class TandemError(Exception):
    """A call to a tandem server failed with a gRPC status; base of every client error."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        if code is not None:
            self.code = code
        self.message = message
        super().__init__(f"{self.code_name}: {message}" if message else self.code_name)

    @property
    def code_name(self) -> str:
        """The status code's canonical name, e.g. 'INVALID_ARGUMENT'."""
        return self.code.name


class Cancelled(TandemError):
    code = grpc.StatusCode.CANCELLED


class Unknown(TandemError):
    code = grpc.StatusCode.UNKNOWN


class InvalidArgument(TandemError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(TandemError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(TandemError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(TandemError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(TandemError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(TandemError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(TandemError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(TandemError):
    code = grpc.StatusCode.ABORTED


class OutOfRange(TandemError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(TandemError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(TandemError):
    code = grpc.StatusCode.INTERNAL


class Unavailable(TandemError):
    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(TandemError):
    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(TandemError):
    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE: dict[grpc.StatusCode, type[TandemError]] = {
    cls.code: cls
    for cls in (
        Cancelled,
        Unknown,
        InvalidArgument,
        DeadlineExceeded,
        NotFound,
        AlreadyExists,
        PermissionDenied,
        ResourceExhausted,
        FailedPrecondition,
        Aborted,
        OutOfRange,
        Unimplemented,
        Internal,
        Unavailable,
        DataLoss,
        Unauthenticated,
    )
}


def error_for_status(code: grpc.StatusCode, message: str) -> TandemError:
    """The typed exception for one status; unknown codes (a newer grpc) fall back to the base class."""
    cls = _BY_CODE.get(code)
    return cls(message) if cls is not None else TandemError(message, code)


def error_from_rpc(error: grpc.RpcError) -> TandemError:
    """Translate what grpc raised (sync `grpc.Call` or `grpc.aio.AioRpcError`) into a `TandemError`."""
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else None
    return error_for_status(code or grpc.StatusCode.UNKNOWN, details or "")
