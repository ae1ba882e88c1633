"""The garbage collector's settings for a long-running serving process.

A tier or engine core process loads a model, a tokenizer and its server objects once and keeps them until
it exits. Left in the collector's generations they are traversed by every full collection, and a decode
step allocates enough short-lived containers to trigger young collections every few steps. Both the tier
process and the engine core process it spawns settle their heaps the same way once they are ready.
"""

from __future__ import annotations

import gc

# Net new container objects between two collections of the young generation (Python's default: 700).
# One decode step allocates a few tracked objects per stream (its delta, their lists), ~600 at 128
# streams: with the default the young generation was collected about once per step.
YOUNG_THRESHOLD = 10_000


def freeze_startup_objects() -> None:
    """Move everything allocated so far out of the collector's generations (it is never freed) and let the
    young generation grow to `YOUNG_THRESHOLD` before it is collected. Call once, when startup is done."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *gc.get_threshold()[1:])
