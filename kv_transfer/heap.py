"""Keeping freed megabyte buffers in the process heap, so KV messages do not fault their pages in again.

Every KV message passes through several short-lived buffers of megabytes: gRPC's socket read buffers
and its copy of the message, the bytes objects on both sides. glibc's malloc serves buffers that large
from fresh mmaps, or trims them off the heap once freed, so every page of every message is faulted in
and zeroed by the kernel again, a large share of the receiving process's CPU time (bench/README.md,
"KV transfer"). Raising the mmap threshold (glibc's maximum, 32 MiB) and the trim threshold keeps freed
buffers in the heap for the next message. The cost is that up to `TRIM_THRESHOLD_BYTES` of free memory
per malloc arena may stay mapped.
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 64 << 20

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_message_buffers_in_heap() -> bool:
    """Set glibc's malloc thresholds for this whole process; False where there is no glibc `mallopt`.

    Idempotent; call it once when a server that moves KV starts.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    if applied:
        logger.info(
            "malloc keeps freed buffers: mmap threshold %d MiB, trim threshold %d MiB",
            MMAP_THRESHOLD_BYTES >> 20,
            TRIM_THRESHOLD_BYTES >> 20,
        )
    return applied
