"""How much memory this process may use: the cgroup's limit where one is set, else physical memory.

A container's limit is the one the kernel enforces (the OOM killer ends the process past it, as it ended
an 8 B load that grew past 20 GiB in issue 55), so it is the bound a start is checked against. cgroup v2
is read along this process's own cgroup path (the tightest `memory.max` from its group up to the root),
v1 from the memory controller's `memory.limit_in_bytes`; a limit above physical memory means none. The
free memory now (`MemAvailable`) is read apart: it moves as other processes come and go (a `tandem up`
decode tier starts after its prefill tier took its share), so it can only warn, never refuse.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit number; anything this large is none.
_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class MemoryLimit:
    """The bytes a process may use and where that bound comes from (named in a refusal)."""

    bytes: int
    source: str


def physical_memory() -> int:
    """This machine's RAM in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_limit(root: Path = Path("/"), physical: int | None = None) -> MemoryLimit:
    """The tightest of the cgroup limit (v2, then v1) and physical memory; `root` and `physical` are for
    tests (a fake /proc and /sys tree, a machine size)."""
    physical = physical_memory() if physical is None else physical
    cgroup = _cgroup_v2_limit(root) or _cgroup_v1_limit(root)
    if cgroup is not None and cgroup[0] < physical:
        return MemoryLimit(cgroup[0], cgroup[1])
    return MemoryLimit(physical, "physical memory")


def available_memory(root: Path = Path("/")) -> int | None:
    """`MemAvailable` from /proc/meminfo in bytes: what can be had now without swapping; None unread."""
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_v2_limit(root: Path) -> tuple[int, str] | None:
    """The tightest `memory.max` on this process's unified (v2) cgroup path."""
    return _tightest(root, root / "sys/fs/cgroup", _own_group(root, ""), "memory.max")


def _cgroup_v1_limit(root: Path) -> tuple[int, str] | None:
    """The tightest `memory.limit_in_bytes` on this process's v1 memory cgroup path (a hybrid host's)."""
    found = _tightest(
        root, root / "sys/fs/cgroup/memory", _own_group(root, "memory"), "memory.limit_in_bytes"
    )
    return None if found is None or found[0] >= _V1_UNLIMITED else found


def _own_group(root: Path, controller: str) -> str:
    """This process's group in the hierarchy of `controller` ("" names the unified one) from
    /proc/self/cgroup (`id:controllers:path` lines); "/" when unread."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return "/"
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(",") if controller else not controllers:
            return path
    return "/"


def _tightest(root: Path, base: Path, group: str, name: str) -> tuple[int, str] | None:
    """The smallest number in file `name` from `base`/`group` up to `base`, and the file it is in. In a
    container with its own cgroup namespace the group is "/" and only `base`'s own file is read."""
    directory = base / group.strip("/")
    limits = []
    while True:
        value = _read_int(directory / name)
        if value is not None:
            limits.append((value, f"cgroup {directory.relative_to(root) / name}"))
        if directory == base or base not in directory.parents:
            break
        directory = directory.parent
    return min(limits) if limits else None


def _read_int(path: Path) -> int | None:
    """The integer in a cgroup file; None for "max", a missing file or anything else."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
