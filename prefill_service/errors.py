"""Exceptions only the prefill tier raises; the service edge maps them to status codes (status.py)."""

from engine.errors import TandemError


class IncompatibleKVError(TandemError):
    """The caller's compatibility hash differs from this replica's: its KV blocks would be garbage there.

    Maps to FAILED_PRECONDITION: retrying the same replica cannot help, only a compatible one can.
    """
