"""CPU seconds another process (and each of its threads) has used, read from the OS (/proc, Linux).

On a shared machine wall-clock throughput moves with whatever else runs; the CPU time a server
spends on a fixed amount of work barely does, so the serving-path benchmark reports that. Reading
/proc needs no cooperation from the server and no extra dependency.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from base.errors import TandemError

CLOCK_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")


class ProcessCpuError(TandemError):
    """The process is gone, or this OS has no /proc to read its CPU time from."""


@dataclass(frozen=True)
class ThreadCpu:
    """One thread: its id, its OS name (Python threads all show the interpreter's) and CPU seconds."""

    tid: int
    name: str
    cpu_s: float


def _parse_stat(text: str) -> tuple[str, float]:
    """(comm, user + system seconds) of one /proc stat line; comm may hold spaces and parentheses."""
    name = text[text.index("(") + 1 : text.rindex(")")]
    fields = text[text.rindex(")") + 2 :].split()
    # After "pid (comm) ", fields start at `state` (field 3): utime is field 14, stime field 15.
    return name, (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_SECOND


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of every thread `pid` has run, living or ended."""
    try:
        return _parse_stat(Path(f"/proc/{pid}/stat").read_text())[1]
    except OSError as exc:
        raise ProcessCpuError(f"cannot read the CPU time of process {pid}: {exc}") from exc


def descendants(pid: int) -> list[int]:
    """The living processes `pid` started, and theirs (the decode server's engine-core process)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(text[text.rindex(")") + 2 :].split()[1])
        parents.setdefault(parent, []).append(int(entry.name))
    found, frontier = [], [pid]
    while frontier:
        children = parents.get(frontier.pop(), [])
        found += children
        frontier += children
    return found


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of `pid` and of every living process under it: a server's whole cost."""
    total = process_cpu_seconds(pid)
    for child in descendants(pid):
        try:
            total += process_cpu_seconds(child)
        except ProcessCpuError:
            continue  # exited meanwhile
    return total


def thread_cpu_seconds(pid: int) -> dict[int, ThreadCpu]:
    """CPU seconds of each living thread of `pid`, by thread id (threads that exit meanwhile are skipped)."""
    threads = {}
    try:
        tids = [int(entry.name) for entry in Path(f"/proc/{pid}/task").iterdir()]
    except OSError as exc:
        raise ProcessCpuError(f"cannot list the threads of process {pid}: {exc}") from exc
    for tid in tids:
        try:
            name, seconds = _parse_stat(Path(f"/proc/{pid}/task/{tid}/stat").read_text())
        except OSError:
            continue
        threads[tid] = ThreadCpu(tid, name, seconds)
    return threads


def thread_cpu_delta(before: dict[int, ThreadCpu], after: dict[int, ThreadCpu], pid: int) -> list[dict]:
    """Per-thread CPU seconds spent between two snapshots, busiest first; the process's first thread
    (where the asyncio loop runs) is labelled "main"."""
    rows = []
    for tid, now in after.items():
        spent = now.cpu_s - (before[tid].cpu_s if tid in before else 0.0)
        if spent > 0:
            rows.append({"tid": tid, "name": "main" if tid == pid else now.name, "cpu_s": round(spent, 3)})
    return sorted(rows, key=lambda row: row["cpu_s"], reverse=True)
