"""`tandem bench request-files`: which recorded files count, the per-process sets, union and intersection,
the tracer and its windows in a plain subprocess, and (slow) one real traced server."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import request_files
from bench.request_files import ENGINE_CORE, FRONT_DOOR, repo_file, repo_files, summarize

ROOT = Path("/repo")


@pytest.mark.parametrize(
    ("filename", "expected"),
    [
        ("/repo/decode_service/front_door/servicer.py", "decode_service/front_door/servicer.py"),
        ("/repo/engine/models/decoder.py", "engine/models/decoder.py"),
        ("/repo/kernels/../engine/sampler.py", "engine/sampler.py"),
        ("/repo/protos/tandem/v1/generation_pb2.py", "protos/tandem/v1/generation_pb2.py"),
        ("/repo/tests/test_client.py", None),
        ("/repo/.venv/lib/python3.11/site-packages/grpc/__init__.py", None),
        ("/repo/build/lib/engine/engine.py", None),
        ("/repo/engine/.hidden/x.py", None),
        ("/root/.pyenv/versions/3.11.7/lib/python3.11/asyncio/events.py", None),
        ("/repository/engine/engine.py", None),
        ("<frozen importlib._bootstrap>", None),
        ("<string>", None),
        ("/repo/kernels/cpu/decode.cpp", None),
        ("", None),
    ],
)
def test_repo_file_keeps_only_the_repositorys_own_sources(filename: str, expected: str | None) -> None:
    assert repo_file(filename, ROOT) == expected


def test_a_relative_filename_is_read_against_the_processs_directory() -> None:
    assert repo_file("engine/engine.py", ROOT, cwd="/repo") == "engine/engine.py"
    assert repo_file("engine/engine.py", ROOT, cwd="/elsewhere") is None
    assert repo_file("engine/engine.py", ROOT) is None


def test_repo_files_are_unique_and_sorted() -> None:
    recorded = [
        "/repo/serving/status.py",
        "/usr/lib/python3.11/threading.py",
        "/repo/base/logs.py",
        "/repo/serving/status.py",
        "<frozen abc>",
    ]
    assert repo_files(recorded, ROOT) == ["base/logs.py", "serving/status.py"]


def test_summary_counts_each_process_the_union_and_the_files_in_both() -> None:
    request = {
        FRONT_DOOR: ["a/front.py", "a/shared.py", "a/tick.py", "a/front.py"],
        ENGINE_CORE: ["b/core.py", "a/shared.py"],
    }
    idle = {FRONT_DOOR: ["a/tick.py", "a/never_in_request.py"], ENGINE_CORE: []}
    summary = summarize(request, idle)
    front = summary["processes"][FRONT_DOOR]
    assert front["count"] == 3 and front["files"] == ["a/front.py", "a/shared.py", "a/tick.py"]
    assert front["also_idle"] == ["a/tick.py"]
    assert front["request_only"] == ["a/front.py", "a/shared.py"]
    assert summary["processes"][ENGINE_CORE]["count"] == 2
    assert summary["union"] == ["a/front.py", "a/shared.py", "a/tick.py", "b/core.py"]
    assert summary["union_count"] == 4
    assert summary["in_both"] == ["a/shared.py"] and summary["in_both_count"] == 1
    text = request_files.report_text(summary)
    assert "union across processes: 4 files (3 front door + 2 engine core)" in text
    assert "    a/tick.py  *" in text
    assert summarize({FRONT_DOOR: []})["union_count"] == 0


CHILD = """\
import os, sys, threading, time
sys.path.insert(0, sys.argv[1])
from pkg import before, during
before.run()
stop = os.path.join(sys.argv[2], "stop")
def loop():
    while not os.path.exists(stop):
        during.run()
        time.sleep(0.001)
worker = threading.Thread(target=loop)
worker.start()
print("ready", flush=True)
worker.join()
"""


def test_the_tracer_records_what_threads_run_inside_a_window_only(tmp_path: Path) -> None:
    """A traced process: code run before the window is not in it, code a thread runs during it is."""
    root, hook, trace = tmp_path / "root", tmp_path / "hook", tmp_path / "trace"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    for name in ("before", "during"):
        (root / "pkg" / f"{name}.py").write_text("def run():\n    return 1\n")
    request_files.write_hook(hook)
    trace.mkdir()
    env = {**os.environ, "PYTHONPATH": str(hook), request_files.TRACE_ENV: str(trace)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(root), str(trace)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        dumps, length = request_files.window(trace, "w", [child.pid], lambda: None, min_s=0.2, settle=0.0)
    finally:
        (trace / "stop").write_text("")
        child.wait(30)
    assert child.returncode == 0
    assert length >= 0.2 and set(dumps) == {child.pid}
    assert repo_files(dumps[child.pid]["files"], root) == ["pkg/during.py"]


def test_the_tracer_is_inert_without_its_variable(tmp_path: Path) -> None:
    request_files.write_hook(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != request_files.TRACE_ENV}
    code = (
        "import sys, threading, sitecustomize\n"
        "print(sitecustomize.__file__, sys.getprofile(), threading.active_count())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(tmp_path / "sitecustomize.py"), "None", "1"]


@pytest.mark.slow
@pytest.mark.real_model
def test_one_generate_on_a_real_server_is_traced_in_both_processes(real_model_dir: Path) -> None:
    parser = argparse.ArgumentParser()
    request_files.add_arguments(parser)
    args = parser.parse_args(["--threads", "1", "--settle", "0.2", "--min-window", "1.5"])
    result = request_files.measure(args, real_model_dir)
    processes = result["processes"]
    assert {FRONT_DOOR, ENGINE_CORE} <= set(processes)
    assert result["request"]["reply"]["tokens"] > 0
    assert "decode_service/front_door/servicer.py" in processes[FRONT_DOOR]["files"]
    assert "engine/model_runner.py" in processes[ENGINE_CORE]["files"]
    assert "engine/model_runner.py" not in processes[FRONT_DOOR]["files"]
    assert result["union_count"] == len(
        set(processes[FRONT_DOOR]["files"]) | set(processes[ENGINE_CORE]["files"])
    )
    assert set(result["in_both"]) <= set(processes[FRONT_DOOR]["files"]) & set(
        processes[ENGINE_CORE]["files"]
    )
    # Only the message's parameter types run on both sides of the pipe.
    assert result["in_both"] == ["engine/params.py"]
    # A request without tools, constraints or speculation enters none of their modules.
    for module in (
        "decode_service/front_door/constraints.py",
        "decode_service/engine_core/grammar_gate.py",
        "engine/speculation.py",
    ):
        assert module not in result["union"], module
