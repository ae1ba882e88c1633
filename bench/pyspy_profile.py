"""Sampling profiles of a running server with py-spy, summarised as where its CPU time goes.

py-spy reads another process's Python stacks from outside (no instrumentation, every thread, the
engine thread included, which cProfile would miss), at a fixed rate and without pausing the target
(`--nonblocking`). With `gil_only` it samples only the thread holding the GIL, so the samples per
second tell how much of the time the GIL was held at all: near 1.0 means the interpreter lock, not
the cores, bounds the server.

Install it with `pip install py-spy` (the `bench` extra has it).
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from base.errors import TandemError

STOP_TIMEOUT_S = 30.0
_LINE_NUMBER = re.compile(r":\d+\)$")


class ProfilerUnavailableError(TandemError):
    """py-spy is not installed or could not attach to the process."""


def py_spy_binary() -> str:
    """py-spy on PATH, else beside this interpreter (a virtual environment that was not activated)."""
    binary = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if binary is None:
        raise ProfilerUnavailableError("py-spy is not installed: `pip install py-spy` (in the bench extra)")
    return binary


@dataclass
class PySpyRecording:
    """Records `pid` from `start()` to `stop()`; returns collapsed stacks ("frame;frame;... count")."""

    pid: int
    rate_hz: int = 250
    gil_only: bool = False
    _process: subprocess.Popen | None = None
    _output: Path | None = None

    def start(self) -> None:
        self._output = Path(tempfile.mkstemp(prefix="tandem-pyspy-", suffix=".txt")[1])
        command = [
            py_spy_binary(),
            "record",
            "--pid",
            str(self.pid),
            "--rate",
            str(self.rate_hz),
            "--format",
            "raw",
            "--output",
            str(self._output),
            "--nonblocking",
            "--threads",
        ]
        if self.gil_only:
            command.append("--gil")
        self._process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def stop(self) -> list[str]:
        assert self._process is not None and self._output is not None, "start() first"
        self._process.send_signal(signal.SIGINT)
        try:
            log, _ = self._process.communicate(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            log, _ = self._process.communicate()
        try:
            lines = self._output.read_text().splitlines()
        finally:
            self._output.unlink(missing_ok=True)
        if not lines:
            detail = log.strip()[-500:]
            raise ProfilerUnavailableError(f"py-spy recorded nothing from pid {self.pid}: {detail}")
        return lines


def _function(frame: str) -> str:
    """'func (file.py:12)' -> 'func (file.py)': samples of one function at different lines add up."""
    return _LINE_NUMBER.sub(")", frame)


def _file(frame: str) -> str:
    return frame[frame.rfind("(") + 1 :].split(":")[0].rstrip(")")


def summarize(stacks: list[str], duration_s: float, rate_hz: int, top: int = 25) -> dict:
    """Per-thread busy share, the functions with the most own and inclusive samples, own samples by file.

    Shares are of all samples; a thread's `busy_share` is its samples over the samples one thread
    busy for the whole recording would have (rate x duration).
    """
    threads: Counter[str] = Counter()
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    by_file: Counter[str] = Counter()
    total = 0
    for line in stacks:
        stack, _, count_text = line.rpartition(" ")
        count = int(count_text)
        root, *frames = stack.split(";")
        total += count
        threads[root.partition(": ")[2] or root] += count
        if not frames:
            continue
        own[_function(frames[-1])] += count
        by_file[_file(frames[-1])] += count
        for function in {_function(frame) for frame in frames}:
            inclusive[function] += count
    expected = max(rate_hz * duration_s, 1.0)

    def rows(counter: Counter[str], key: str) -> list[dict]:
        return [
            {key: name, "samples": n, "share": round(n / total, 4)} for name, n in counter.most_common(top)
        ]

    return {
        "rate_hz": rate_hz,
        "duration_s": round(duration_s, 2),
        "samples": total,
        "threads": [
            {"thread": name, "samples": n, "busy_share": round(n / expected, 3)}
            for name, n in threads.most_common()
        ],
        "top_own": rows(own, "function"),
        "top_inclusive": rows(inclusive, "function"),
        "own_by_file": rows(by_file, "file"),
    }
