"""The one mapping from tandem's exceptions to gRPC status codes, used only at each tier's service edge."""

from __future__ import annotations

import grpc

from base.errors import IncompatibleKVError, InvalidRequestError, OutOfBlocksError
from serving.errors import (
    DrainingError,
    QueueFullError,
    RelayedStatusError,
    StreamStalledError,
    TierUnavailableError,
)

# First match wins, so more specific classes go first.
_STATUS_BY_ERROR: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (IncompatibleKVError, grpc.StatusCode.FAILED_PRECONDITION),
    (QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (OutOfBlocksError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DrainingError, grpc.StatusCode.UNAVAILABLE),
    (TierUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (StreamStalledError, grpc.StatusCode.DEADLINE_EXCEEDED),
)


def status_for(error: Exception) -> tuple[grpc.StatusCode, str]:
    """The status code and caller-facing message for an error raised below the edge.

    Errors raised on purpose carry messages written for the caller; anything else is a bug, reported
    as INTERNAL without internals (the server log has the traceback).
    """
    if isinstance(error, RelayedStatusError):
        return error.code, str(error)
    for error_type, code in _STATUS_BY_ERROR:
        if isinstance(error, error_type):
            return code, str(error)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(error).__name__}); see the server log"
