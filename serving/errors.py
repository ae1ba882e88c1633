"""Service-level refusals: why a server does not take a call now. The engine never raises these;
`serving.status` maps them to gRPC status codes at each tier's edge."""

from base.errors import TandemError


class QueueFullError(TandemError):
    """Admission refused because a bounded queue is full (maps to RESOURCE_EXHAUSTED)."""


class DrainingError(TandemError):
    """The server is shutting down and takes no new work (maps to UNAVAILABLE)."""


class TierUnavailableError(TandemError):
    """A tier this one depends on cannot do the work right now (maps to UNAVAILABLE: retry later)."""


class StreamStalledError(TandemError):
    """The client read nothing for longer than the server waits (maps to DEADLINE_EXCEEDED)."""
