"""What this process holds resident, and a way to hand the allocator's free memory back to the system.

Grammar memory is bounded in resident bytes, not in xgrammar's estimate of them: a compiled grammar
holds about 1.3x its `memory_size_bytes` resident (a 20,000-word enum on a 49k-token vocabulary: 72 MiB
for 56 MiB estimated), and glibc keeps what a compile or an evicted grammar freed in its heap, where
the process's RSS still counts it (three such grammars freed: 496 MiB resident, 354 MiB after
`malloc_trim`). So the compile worker measures each grammar's RSS growth, and the processes that
compile or drop grammars trim their heap afterwards.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

_STATUS = "/proc/self/status"


def resident_bytes() -> int | None:
    """This process's resident set (VmRSS) in bytes; None where /proc does not say (not Linux)."""
    try:
        with open(_STATUS, encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@functools.cache
def _malloc_trim() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """glibc's `malloc_trim`, or None under another C library (musl, macOS), which has none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_free_memory() -> None:
    """Return the heap's free pages to the system (glibc's `malloc_trim(0)`; nothing elsewhere).

    Thread-safe: glibc locks each arena while it trims it.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
