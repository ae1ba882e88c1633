"""Exceptions raised inside tandem.

Each names one kind of failure; the gRPC edge of each tier maps them to status codes in one
place, so nothing below the edge knows about gRPC.
"""


class TandemError(Exception):
    """Base class for every error tandem raises on purpose."""


class ConfigError(TandemError, ValueError):
    """A server setting is out of range or malformed (the server refuses to start)."""


class InvalidRequestError(TandemError, ValueError):
    """The caller sent something that can never succeed (maps to INVALID_ARGUMENT)."""


class ModelNotFoundError(TandemError, FileNotFoundError):
    """The model directory or name does not resolve to a loadable checkpoint."""


class UnsupportedModelError(TandemError):
    """The checkpoint's architecture or options are not implemented by our forward pass."""


class IncompatibleKVError(TandemError):
    """The caller's compatibility hash differs from this replica's: its KV blocks would be garbage there.

    Maps to FAILED_PRECONDITION: retrying the same replica cannot help, only a compatible one can. Here,
    not in `kv_transfer.errors` (which re-exports it), so that the status mapping (`serving.status`)
    needs no KV transfer code.
    """


class OutOfBlocksError(TandemError):
    """The KV block pool cannot satisfy an allocation; the scheduler decides what to do."""
