"""Give back the resident pages of a memory-mapped file once what they held has been used.

`safetensors.safe_open` maps a whole shard and hands out tensors that view the mapping. Each page a
tensor's reader touches stays in the process's resident set (as file-backed memory) until the shard is
closed, so a loader that converts tensor after tensor would still end a shard holding all of it: for an
8 B model's 5 GB shards, more than half the resident model again. `release` drops the whole pages under
one tensor from the process with `madvise(MADV_DONTNEED)`; the data stays on disk (and in the page cache),
and a later read of the same tensor faults it back in unchanged.

DONTNEED on anonymous memory would zero it instead, so pages are released only where /proc/self/maps
says they are a mapping of the file named; elsewhere (no /proc, no madvise, a copy) nothing happens and
the load is merely larger.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import torch

_PAGE = mmap.PAGESIZE
# Absent where the platform has no madvise (not Linux): releasing is then skipped.
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
_LIBC = ctypes.CDLL(None, use_errno=True) if _MADV_DONTNEED is not None else None


def release(tensor: torch.Tensor, path: Path) -> int:
    """Drop the whole pages under `tensor`'s bytes when they map the file at `path`; return the bytes
    released (0 when nothing was). Call only once `tensor` has been copied or quantized away."""
    if _LIBC is None or tensor.device.type != "cpu" or tensor.nbytes < _PAGE:
        return 0
    begin = tensor.data_ptr()
    end = begin + tensor.nbytes
    if not any(low <= begin and end <= high for low, high in _file_mappings(path)):
        return 0
    start = -(-begin // _PAGE) * _PAGE
    length = (end // _PAGE) * _PAGE - start
    if length <= 0 or _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_DONTNEED):
        return 0
    return length


def _file_mappings(path: Path) -> list[tuple[int, int]]:
    """The address ranges where this process maps the file at `path` (empty without /proc)."""
    target = os.path.realpath(path)
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n") == target:
                    low, high = fields[0].split("-")
                    ranges.append((int(low, 16), int(high, 16)))
    except OSError:
        return []
    return ranges
