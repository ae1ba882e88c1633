"""Where and when a benchmark ran: CPU, its flags, cores, memory and its bandwidth, load, versions, commit.

Numbers from a shared 2-core machine mean little without the load average next to them, so every
result file carries this block, taken when the run starts. A ratio against a peer holds on one CPU: the
instruction sets our kernels use (AVX-512 VNNI, AMX) and the memory bandwidth a decode step is bound by
differ between hosts, so `host_label()` names them in one line that benches print beside every ratio.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# The /proc/cpuinfo flags our CPU kernels use or could use, under the name machine_info() reports them
# by, with the spellings kernels have been seen under (`avx512vnni` in some, `avx512_vnni` in Linux's).
KERNEL_FLAGS: dict[str, tuple[str, ...]] = {
    "avx2": ("avx2",),
    "avx512f": ("avx512f",),
    "avx512bw": ("avx512bw",),
    "avx512_vnni": ("avx512_vnni", "avx512vnni"),
    "avx512_bf16": ("avx512_bf16",),
    "amx_tile": ("amx_tile",),
    "amx_int8": ("amx_int8",),
}
# The copy probe's buffers (each) and repetitions: far beyond any cache, well under 2 s in all.
BANDWIDTH_BUFFER_MIB = 256
BANDWIDTH_REPEATS = 3


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags(cpuinfo: str | None = None) -> dict[str, bool]:
    """Which of `KERNEL_FLAGS` the CPU has, from `/proc/cpuinfo` (or the text given); all False when it
    cannot be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    present: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            present = set(line.split(":", 1)[1].split())
            break
    return {
        name: any(spelling in present for spelling in spellings) for name, spellings in KERNEL_FLAGS.items()
    }


def memory_bandwidth_gbs(
    buffer_mib: int = BANDWIDTH_BUFFER_MIB, repeats: int = BANDWIDTH_REPEATS
) -> dict[str, float]:
    """Copy bandwidth in GB/s (bytes read plus bytes written, as STREAM's copy counts them) of one torch
    thread and of all of torch's threads, the best of `repeats` copies of a `buffer_mib` buffer each."""
    import torch

    source = torch.ones(buffer_mib * 2**20 // 4, dtype=torch.float32)
    target = torch.empty_like(source)
    moved = 2 * source.numel() * source.element_size()
    threads = torch.get_num_threads()
    result: dict[str, float] = {}
    try:
        for name, count in (("single_thread", 1), ("all_threads", threads)):
            torch.set_num_threads(count)
            target.copy_(source)  # first touch of the target's pages, and warm-up
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                target.copy_(source)
                best = min(best, time.perf_counter() - start)
            result[name] = round(moved / best / 1e9, 1)
    finally:
        torch.set_num_threads(threads)
    result["threads"] = threads
    return result


def host_label(info: dict | None = None) -> str:
    """The host in one line, e.g. "AMD EPYC 7B13, 2 cores, avx512 vnni bf16, 32.7 GB/s": CPU model, cores,
    the widest vector instruction set and its int8/bf16 extensions, the copy bandwidth probed (the better
    of one thread and all: on a shared host the all-thread figure drops while a neighbour runs).
    `info` is a `machine_info()` (a stored one: keys it lacks are left out); None probes this host."""
    if info is None:
        info = machine_info()
    parts = [str(info.get("cpu", "?")), f"{info.get('cores', '?')} cores"]
    flags = info.get("cpu_flags")
    if flags:
        if flags.get("avx512f"):
            isa = ["avx512"]
            isa += ["vnni"] if flags.get("avx512_vnni") else []
            isa += ["bf16"] if flags.get("avx512_bf16") else []
        else:
            isa = ["avx2"] if flags.get("avx2") else ["no avx2"]
        isa += ["amx"] if flags.get("amx_int8") else []
        parts.append(" ".join(isa))
    probed = info.get("memory_bandwidth_gbs") or {}
    bandwidth = max((probed.get(key) or 0.0 for key in ("single_thread", "all_threads")), default=0.0)
    if bandwidth:
        parts.append(f"{bandwidth:.1f} GB/s")
    return ", ".join(parts)


def memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine_info(probe_bandwidth: bool = True) -> dict:
    """This host now; `probe_bandwidth` runs the copy probe (about half a second; None without it)."""
    import torch

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "cpu_flags": cpu_flags(),
        "memory_gib": memory_gib(),
        "memory_bandwidth_gbs": memory_bandwidth_gbs() if probe_bandwidth else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average_1_5_15": load_average(),
        "git_commit": git_commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
