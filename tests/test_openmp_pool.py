"""Releasing the calling thread's OpenMP pool ends its workers; the engine thread releases it on start."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from serving import engine_thread, openmp_pool

needs_openmp = pytest.mark.skipif(
    "OpenMP" not in torch.__config__.parallel_info(), reason="this torch build does not run on OpenMP"
)

# A fresh process: the test process's own thread count is set to 1 by conftest.
SCRIPT = textwrap.dedent(
    """
    import os, time, torch
    from serving import openmp_pool
    torch.set_num_threads(2)
    torch.ones(1 << 24).sum()  # a parallel region on this thread starts its pool: one worker thread
    before = len(os.listdir("/proc/self/task"))
    released = openmp_pool.release_caller_pool()
    deadline = time.monotonic() + 10
    while len(os.listdir("/proc/self/task")) >= before and time.monotonic() < deadline:
        time.sleep(0.01)
    print(released, before - len(os.listdir("/proc/self/task")))
    """
)


@needs_openmp
def test_release_ends_the_calling_threads_workers():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "1"]


def test_the_engine_thread_releases_its_starters_pool_before_it_runs(monkeypatch):
    order = []
    monkeypatch.setattr(openmp_pool, "release_caller_pool", lambda: order.append("released") or True)

    class Recorder(engine_thread.EngineThread):
        def step_once(self) -> bool:
            return False

        def _on_stop(self) -> None:
            pass

        def warm_up(self) -> None:
            order.append("warm-up")

    thread = Recorder(engine=None, deliver=lambda events: None, event_log=None)
    thread.start()
    assert thread.wait_ready(10)
    thread.stop()
    assert order == ["released", "warm-up"]
