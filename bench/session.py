"""What the comparison commands (`tandem bench quantized`, `gemma`, `speculative`, `memory`, `replicas`)
do around their measurements, in one place.

Each refuses a busy machine (unless told), opens its JSON document with the same header, measures its
systems one after the other on fresh servers (a system that cannot run now is skipped and its reason
recorded), and closes the document: the load average at the end, `<benchmark>.json` written to the
output directory and, for a command with a README table, `README_<benchmark>_table.md` and its
picture beside it, the table printed.

    start_load, valid = session.quiet_machine(args.allow_load)  # first, before anything heavy runs
    document = session.header("gemma", start_load, model=..., workloads=...)
    document["runs"], document["skipped"] = session.each_system(names, measure)
    document["ratios"], document["valid"] = ratios(document["runs"]), valid
    session.finish(document, args.out_dir, table, draw)

The header holds `benchmark`, `machine` (bench.machine.machine_info), `host` (its one-line label, to
print beside every ratio: a ratio holds on one CPU), `command`, `commit`, `started` and
`load_average_at_start`; `finish` adds `load_average_at_end`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import logging
import math
from collections.abc import Callable, Iterable
from pathlib import Path

from base.errors import TandemError
from bench.report import command_line, write_json

logger = logging.getLogger(__name__)

# Above this 1-minute load average a comparison does not start: a neighbour would void its ratios.
MAX_START_LOAD = 1.0


class SystemSkipped(TandemError):
    """A system cannot run on this machine now (not built, not wired up); the message says why."""


def quiet_machine(allow_load: bool, limit: float = MAX_START_LOAD) -> tuple[list[float], bool]:
    """The load average now, and whether it is at most `limit`; a busy machine ends the command unless
    `allow_load` (the run is then recorded as not valid)."""
    from bench.machine import load_average

    load = load_average()
    valid = load[0] <= limit
    if not valid and not allow_load:
        raise SystemExit(
            f"load average {load[0]:.2f} > {limit}: other processes would void the comparison "
            "(--allow-load runs anyway and records the run as not valid)"
        )
    return load, valid


def header(benchmark: str, load_at_start: list[float] | None = None, **fields: object) -> dict:
    """A result document's first keys (see the module docstring), then `fields`; the load average is
    read now unless `load_at_start` was read before."""
    from bench.machine import git_commit, host_label, load_average, machine_info

    machine = machine_info()
    return {
        "benchmark": benchmark,
        "machine": machine,
        "host": host_label(machine),
        "command": command_line(),
        "commit": git_commit(),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_average_at_start": load_average() if load_at_start is None else load_at_start,
        **fields,
    }


def systems(text: str, known: Iterable[str]) -> list[str]:
    """The systems of the comma list `text`, in its order; SystemExit when one is not `known`."""
    known = tuple(known)
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = set(names) - set(known)
    if unknown:
        raise SystemExit(f"unknown systems: {', '.join(sorted(unknown))} (known: {', '.join(known)})")
    return names


def each_system(names: Iterable[str], measure: Callable[[str], dict]) -> tuple[list[dict], dict[str, str]]:
    """`measure(name)` for each system in turn: the runs, and why each system that could not run did not
    (a `SystemSkipped`, or a server that did not start)."""
    from bench.servers import ServerStartError

    runs: list[dict] = []
    skipped: dict[str, str] = {}
    for name in names:
        try:
            runs.append(measure(name))
        except (SystemSkipped, ServerStartError) as exc:
            logger.warning("skipping %s: %s", name, exc)
            skipped[name] = str(exc)
    return runs, skipped


def at_once(backend, workload, extra: dict, max_concurrency: int | None = None) -> dict:
    """One run of `workload` (a bench.serve.Workload) on `backend`, every request sent at once (at most
    `max_concurrency` in flight), without a progress bar or SLOs; the run's metrics."""
    from bench import serve
    from bench.workload import ArrivalProcess

    no_slos = argparse.Namespace(goodput=[])
    run = serve.measure(
        backend, no_slos, ArrivalProcess(math.inf), False, extra, workload, max_concurrency=max_concurrency
    )
    return asyncio.run(run)["metrics"]


def peak_rss_bytes(pids: Iterable[int]) -> int:
    """The summed high-water RSS (VmHWM) of `pids`: what each process held at its peak."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
    return total


def server_pids() -> list[int]:
    """Every process this one started, at any depth: the servers a command is measuring."""
    import psutil

    return [child.pid for child in psutil.Process().children(recursive=True)]


def finish(
    document: dict,
    out_dir: Path,
    table: Callable[[dict], str] | None = None,
    draw: Callable[[dict, Path], Path] | None = None,
    name: str | None = None,
) -> Path:
    """Add the load average at the end and write `<name>.json` (`name` defaults to the benchmark's) to
    `out_dir`; with runs and a `table`, also write it as `README_<name>_table.md`, `draw` the picture and
    print the table."""
    from bench.machine import load_average

    document["load_average_at_end"] = load_average()
    name = name or document["benchmark"]
    path = write_json(out_dir / f"{name}.json", document)
    if table is not None and document["runs"]:
        text = table(document)
        (out_dir / f"README_{name}_table.md").write_text(text)
        if draw is not None:
            logger.info("wrote %s", draw(document, out_dir))
        print(text)
    logger.info("wrote %s", path)
    return path
