"""`tandem bench request-files`: the repository's Python files one aggregated gRPC `Generate` executes,
in the decode server's two processes.

    tandem bench request-files [--prompt Hello] [--max-tokens 8] [--server-args "--quantization int8"]
    python -m bench.request_files ...

Starts one `tandem serve decode` (aggregated: no prefill tier) on the default model with a tracer in
both of its processes, the server (the front door: gRPC servicer, validation, tokenization, streams)
and the engine core process it spawns. The tracer is a `sitecustomize` module this command writes to a
temporary directory and puts first on the server's PYTHONPATH; the spawned core inherits the
environment, so it runs there too, before anything else. Where `TANDEM_TRACE_FILES` names a directory
it installs a profile function (`sys.setprofile` and `threading.setprofile`: Python frames only, so
code of C extensions is not seen, the Python code that calls it is) that, while a window is open, adds
the source file of every frame that is called, resumed or returns to a set; a thread of its own polls
the directory for the file that opens and names a window, acknowledges the opening, and writes the set
(`<pid>.<window>.json`) when the file goes. Nothing in the product knows of it.

Then: waits until the server is healthy, sends `--warm-ups` Generate calls identical to the measured
one (lazy imports and first-call paths done; a prompt shorter than a KV block leaves no cached prefix to
hit), opens an idle window with no request in flight (what runs without a request: the heartbeat on
the core, the stall watchdog), then the request window: one `Generate` sent through the same client,
its stream read to the end, `--settle` seconds more, and both windows last at least `--min-window`
seconds (longer than the heartbeat's 1 s period, so every periodic tick falls in both, and the
difference between them is the request's).

A file counts when it is a `.py` file of the repository (under its root, outside `tests/`, the venv,
`build/` and hidden directories), once per process. Printed and written to `<out-dir>/request_files.json`:
each process's files (those also seen idle marked), the count per process, the union across both, and
the files entered in both processes (issue 36: none but the message definitions should be).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from bench.report import results_dir

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
TRACE_ENV = "TANDEM_TRACE_FILES"
WINDOW_FILE = "window"
# Top-level directories of the repository whose files are not the product's code.
EXCLUDED_DIRS = frozenset({"tests", "build", "venv", "node_modules", "__pycache__"})
FRONT_DOOR = "front door"
ENGINE_CORE = "engine core"
WAIT_S = 30.0

# The tracer, written to a temporary directory as sitecustomize.py: Python imports it at start-up, in
# the server and in every process started with the same environment.
HOOK = '''\
"""bench.request_files' tracer: the source files of the Python code this process runs while a window
is open. Inert unless TANDEM_TRACE_FILES names a directory."""
import os

_directory = os.environ.get("TANDEM_TRACE_FILES")
if _directory:
    import json
    import sys
    import threading
    import time

    _seen = set()
    _recording = False

    def _profile(frame, event, arg, _add=_seen.add):
        if _recording:
            _add(frame.f_code.co_filename)

    def _write(name, document):
        path = os.path.join(_directory, name)
        with open(path + ".tmp", "w") as file:
            json.dump(document, file)
        os.replace(path + ".tmp", path)

    def _watch():
        global _recording
        window = os.path.join(_directory, "window")
        pid = os.getpid()
        label = None
        while os.path.isdir(_directory):
            try:
                with open(window) as file:
                    wanted = file.read().strip() or None
            except OSError:
                wanted = None
            if wanted != label:
                if label is not None:
                    _recording = False
                    files = list(_seen)
                    document = {"pid": pid, "ppid": os.getppid(), "cwd": os.getcwd(), "argv": sys.argv}
                    _write(f"{pid}.{label}.json", {**document, "files": sorted(files)})
                if wanted is not None:
                    _seen.clear()
                    _recording = True
                    _write(f"{pid}.{wanted}.open", {"pid": pid})
                label = wanted
            time.sleep(0.005)

    # The watcher starts before the profile function is installed: its own frames are never recorded.
    threading.Thread(target=_watch, name="tandem-trace-files", daemon=True).start()
    sys.setprofile(_profile)
    threading.setprofile(_profile)
'''


# ---- the pure parts ---------------------------------------------------------------------------------


def repo_file(filename: str, root: Path = ROOT, cwd: str | None = None) -> str | None:
    """The repository-relative path (posix) of a recorded `co_filename` when it is one of the
    repository's own Python source files; None for the stdlib, site-packages, the venv, tests, `build/`,
    hidden directories, frozen or generated code (`<frozen ...>`, `<string>`)."""
    if not filename or filename.startswith("<") or not filename.endswith(".py"):
        return None
    path = Path(filename)
    if not path.is_absolute():
        if cwd is None:
            return None
        path = Path(cwd) / path
    try:
        relative = Path(os.path.normpath(path)).relative_to(Path(os.path.normpath(root)))
    except ValueError:
        return None
    parts = relative.parts
    if not parts or parts[0] in EXCLUDED_DIRS or any(part.startswith(".") for part in parts[:-1]):
        return None
    if "site-packages" in parts or "dist-packages" in parts:
        return None
    return relative.as_posix()


def repo_files(filenames: Iterable[str], root: Path = ROOT, cwd: str | None = None) -> list[str]:
    """The repository's own source files among `filenames`, each once, sorted."""
    found = {repo_file(name, root, cwd) for name in filenames}
    return sorted(name for name in found if name is not None)


def summarize(request: dict[str, list[str]], idle: dict[str, list[str]] | None = None) -> dict:
    """Counts of the files each process (role -> repository files) entered in the request window: per
    process, the union across processes, and the files entered in more than one process; with `idle`
    (the same for a window without a request), which of them also ran then."""
    idle = idle or {}
    processes = {}
    for role, files in request.items():
        files = sorted(set(files))
        also_idle = sorted(set(files) & set(idle.get(role, ())))
        processes[role] = {
            "count": len(files),
            "files": files,
            "also_idle": also_idle,
            "request_only": sorted(set(files) - set(also_idle)),
        }
    seen_in: dict[str, list[str]] = {}
    for role, entry in processes.items():
        for name in entry["files"]:
            seen_in.setdefault(name, []).append(role)
    union = sorted(seen_in)
    both = sorted(name for name, roles in seen_in.items() if len(roles) > 1)
    return {
        "processes": processes,
        "union": union,
        "union_count": len(union),
        "in_both": both,
        "in_both_count": len(both),
    }


def report_text(summary: dict) -> str:
    """The lists and counts, as printed."""
    lines = []
    for role, entry in summary["processes"].items():
        lines.append(
            f"{role}: {entry['count']} files ({len(entry['also_idle'])} also run with no request, *)"
        )
        for name in entry["files"]:
            lines.append(f"    {name}{'  *' if name in entry['also_idle'] else ''}")
    counts = " + ".join(f"{entry['count']} {role}" for role, entry in summary["processes"].items())
    lines.append(f"union across processes: {summary['union_count']} files ({counts})")
    lines.append(f"entered in both processes: {summary['in_both_count']}")
    lines += [f"    {name}" for name in summary["in_both"]]
    return "\n".join(lines)


# ---- the windows ------------------------------------------------------------------------------------


def write_hook(directory: Path) -> Path:
    """sitecustomize.py (the tracer) in `directory`, which then goes first on the server's PYTHONPATH."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "sitecustomize.py"
    path.write_text(HOOK)
    return path


def _wait_for(paths: Iterable[Path], what: str, timeout: float = WAIT_S) -> None:
    paths = list(paths)
    deadline = time.monotonic() + timeout
    while not all(path.exists() for path in paths):
        if time.monotonic() > deadline:
            missing = [path.name for path in paths if not path.exists()]
            raise SystemExit(f"no {what} from the traced processes within {timeout:.0f} s: {missing}")
        time.sleep(0.01)


def window(
    trace_dir: Path,
    label: str,
    pids: Iterable[int],
    action: Callable[[], object],
    min_s: float,
    settle: float,
) -> tuple[dict[int, dict], float]:
    """Open window `label` in every traced process (waiting for `pids` to acknowledge it), run `action`,
    wait `settle` seconds and until the window has lasted `min_s`, close it; every process's dump (pid ->
    its document) and the window's length in seconds."""
    pids = list(pids)
    staged = trace_dir / f"{WINDOW_FILE}.tmp"
    staged.write_text(label)
    os.replace(staged, trace_dir / WINDOW_FILE)
    _wait_for((trace_dir / f"{pid}.{label}.open" for pid in pids), f"acknowledgement of window {label!r}")
    started = time.monotonic()
    action()
    time.sleep(settle)
    time.sleep(max(0.0, started + min_s - time.monotonic()))
    (trace_dir / WINDOW_FILE).unlink()
    length = time.monotonic() - started
    _wait_for((trace_dir / f"{pid}.{label}.json" for pid in pids), f"file set of window {label!r}")
    time.sleep(0.1)  # other traced processes (multiprocessing's resource tracker) write theirs too
    dumps = {}
    for path in trace_dir.glob(f"*.{label}.json"):
        document = json.loads(path.read_text())
        dumps[document["pid"]] = document
    return dumps, length


def by_role(dumps: dict[int, dict], roles: dict[int, str], root: Path = ROOT) -> dict[str, list[str]]:
    """role -> the repository files of its process's dump; processes of no known role that ran
    repository code are listed as `pid N`."""
    found = {}
    for pid, document in sorted(dumps.items()):
        files = repo_files(document["files"], root, document.get("cwd"))
        if pid in roles:
            found[roles[pid]] = files
        elif files:
            found[f"pid {pid}"] = files
    return found


# ---- the run ----------------------------------------------------------------------------------------


def measure(args: argparse.Namespace, model_dir: Path) -> dict:
    """Start the traced server, warm it up, run the idle and the request windows; the result document's
    measured part."""
    from bench import servers
    from bench.memory import engine_ready
    from tandem.client import TandemClient

    server_args = ["--log-format", "json", *shlex.split(args.server_args)]
    request = {"prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": 0.0}
    with tempfile.TemporaryDirectory(prefix="tandem-request-files-") as scratch:
        hook_dir, trace_dir = Path(scratch) / "hook", Path(scratch) / "trace"
        write_hook(hook_dir)
        trace_dir.mkdir()
        server, target = servers.tandem_decode_server(
            "tandem-request-files", str(model_dir), args.threads, server_args
        )
        python_path = os.pathsep.join(p for p in (str(hook_dir), os.environ.get("PYTHONPATH", "")) if p)
        server.env.update({"PYTHONPATH": python_path, TRACE_ENV: str(trace_dir)})
        with server:
            core_pid = engine_ready(server.log_path.read_text()).get("engine_core_pid")
            if core_pid is None:
                raise SystemExit(f"no 'engine core process started (pid N)' line in {server.log_path}")
            roles = {server.pid: FRONT_DOOR, core_pid: ENGINE_CORE}
            with TandemClient(target, timeout=120) as client:

                def generate() -> dict:
                    done = client.complete(args.prompt, max_tokens=args.max_tokens, temperature=0.0)
                    return {"text": done.text, "tokens": done.usage.completion_tokens if done.usage else None}

                for _ in range(args.warm_ups):
                    generate()
                time.sleep(args.settle)
                idle_dumps, idle_s = window(
                    trace_dir, "idle", list(roles), lambda: None, args.min_window, 0.0
                )
                reply: dict = {}
                request_dumps, request_s = window(
                    trace_dir,
                    "request",
                    list(roles),
                    lambda: reply.update(generate()),
                    args.min_window,
                    args.settle,
                )
    idle = by_role(idle_dumps, roles)
    measured = by_role(request_dumps, roles)
    for role in (FRONT_DOOR, ENGINE_CORE):
        measured.setdefault(role, [])
    return {
        "server": {"model": model_dir.name, "server_args": server_args, "threads": args.threads},
        "request": {**request, "warm_ups": args.warm_ups, "reply": reply},
        "pids": {role: pid for pid, role in roles.items()},
        "window_s": {"idle": round(idle_s, 3), "request": round(request_s, 3)},
        "idle_files": idle,
        **summarize(measured, idle),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model dir (default: the cached default model)")
    parser.add_argument("--prompt", default="Hello", help="the Generate's prompt (default: Hello)")
    parser.add_argument("--max-tokens", type=int, default=8, help="its max_tokens, greedy (default: 8)")
    parser.add_argument(
        "--warm-ups", type=int, default=1, help="identical Generate calls before the windows (default: 1)"
    )
    parser.add_argument(
        "--server-args",
        default="",
        help='further flags of `tandem serve decode`, one string (e.g. "--quantization int8")',
    )
    parser.add_argument("--threads", type=int, default=2, help="threads of the server (default: 2)")
    parser.add_argument(
        "--settle",
        type=float,
        default=0.5,
        help="seconds after the warm-up and after the reply before a window closes (default: 0.5)",
    )
    parser.add_argument(
        "--min-window",
        type=float,
        default=2.5,
        help="seconds each window lasts at least, past the heartbeat's 1 s period (default: 2.5)",
    )
    parser.add_argument("--out-dir", type=Path, default=results_dir())


def run(args: argparse.Namespace) -> int:
    from bench import session
    from engine.model_store import resolve_model

    model_dir = resolve_model(args.model)
    document = session.header("request_files", model=model_dir.name)
    document.update(measure(args, model_dir))
    print(report_text(document))
    path = session.finish(document, args.out_dir)
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.request_files",
        description=(__doc__ or "").strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
