"""Hand the engine thread an OpenMP runtime that lets its workers spin between parallel regions.

libgomp keeps one pool of worker threads per thread that starts parallel regions. Building the engine on
the main thread leaves a pool there; once the engine thread starts its own, the process holds more
OpenMP threads than CPUs (4 on 2 cores) and libgomp "throttles": a worker that finishes a region sleeps
on a futex after ~100 spins instead of ~300,000. A decode step runs ~200 small regions (the GEMVs and
the attention of every layer), so the engine thread's worker slept and was woken about once per region.
Releasing the main thread's idle pool before the engine thread starts keeps the count at the CPUs, and
the worker spins between regions as it does when the main thread runs the model, which shortens every
decode step (`bench/README.md`, "Serving path", has the served single-stream figures).
"""

from __future__ import annotations

import ctypes
import logging

import torch

logger = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: release threads, keep what a later region needs to restart


def release_caller_pool() -> bool:
    """Release the OpenMP worker threads parallel regions of the calling thread started; True if released.

    A later region on this thread starts a new pool, so call it once the thread is done with model work.
    A no-op (False) where torch does not run on OpenMP or the runtime predates OpenMP 5.0.
    """
    if "OpenMP" not in torch.__config__.parallel_info():
        return False
    try:
        runtime = ctypes.CDLL("libgomp.so.1")  # torch's own copy when torch loaded one: same soname
        released = runtime.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
    except (OSError, AttributeError) as exc:
        logger.debug("OpenMP pool not released: %s", exc)
        return False
    return released
