"""Service-level refusals: why a server does not take a call now. The engine never raises these;
`serving.status` maps them to gRPC status codes at each tier's edge."""

import grpc

from base.errors import TandemError


class QueueFullError(TandemError):
    """Admission refused because a bounded queue is full (maps to RESOURCE_EXHAUSTED)."""


class DrainingError(TandemError):
    """The server is shutting down and takes no new work (maps to UNAVAILABLE)."""


class TierUnavailableError(TandemError):
    """A tier this one depends on cannot do the work right now (maps to UNAVAILABLE: retry later)."""


class StreamStalledError(TandemError):
    """The client read nothing for longer than the server waits (maps to DEADLINE_EXCEEDED)."""


class RelayedStatusError(TandemError):
    """An error another process of this server met and already mapped to a status (the decode engine
    core's, relayed to the front door): it keeps that status and message."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        # The request field at fault, where the error names one (a constraint the core refused).
        self.field = field
