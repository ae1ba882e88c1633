"""Sliding-window arithmetic every attention kernel and its reference share.

Hugging Face's semantics: a query at absolute position p attends to key positions j with
p - window < j <= p; a window of None is full causal attention. Blocks of a sequence that lie wholly
below every one of its queries' windows may have been freed and reused (`engine.kv_layout`), so
their block-table entries can name anything: kernels start reading at `first_visible`'s block and
never touch an earlier one.
"""

from __future__ import annotations

# What the C++ and Triton kernels take for "no window": a runtime scalar, so windowed and global layers
# run the same compiled kernel.
NO_WINDOW = 0


class InvalidWindowError(ValueError):
    """A sliding window that is not a positive number of tokens."""


def kernel_window(window: int | None) -> int:
    """The kernels' runtime `window` argument: the window itself, or `NO_WINDOW` for full attention."""
    if window is None:
        return NO_WINDOW
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise InvalidWindowError(f"a sliding window must be a positive number of tokens, not {window!r}")
    return window


def first_visible(seq_len: int, query_len: int, window: int | None) -> int:
    """The first key position any of a sequence's `query_len` last positions can see."""
    if window is None:
        return 0
    return max(0, seq_len - query_len - window + 1)
