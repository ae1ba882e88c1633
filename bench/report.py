"""Result files and tables: one JSON object per measured run, and the table printed after it.

A run's JSON (schema_version 1) holds: `system` (what was measured and how it was configured),
`workload` and `arrivals` (what was sent), `metrics` (see bench.metrics), `distributions` (TTFT/ITL
quantiles for CDF plots), `machine` and `command`. Comparisons and sweeps keep a list of such runs.

Every command writes to `results_dir()` unless told otherwise, outside the source tree, so a run leaves
`git status` clean. What the READMEs show (their tables' markdown and the pictures they embed) is
refreshed by passing `--out-dir bench/results`, where git ignores the JSON.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

SCHEMA_VERSION = 1
RESULTS_ENV = "TANDEM_BENCH_RESULTS"


def results_dir() -> Path:
    """Where every command writes its results by default: `$TANDEM_BENCH_RESULTS`, else `bench-results`
    under tandem's home (`$TANDEM_HOME`, else `~/.cache/tandem`)."""
    configured = os.environ.get(RESULTS_ENV)
    if configured:
        return Path(configured).expanduser()
    from base.settings import get_settings

    return get_settings().home / "bench-results"


def command_line() -> str:
    """How this process was started, as a copy-pasteable command."""
    argv = list(sys.argv)
    if argv and argv[0].endswith("cli.py"):
        argv[0] = "tandem"
    elif argv:
        argv[0] = Path(argv[0]).name
    return shlex.join(argv)


def run_result(system: dict, workload: dict, arrivals: dict, metrics: dict, distributions: dict) -> dict:
    return {
        "system": system,
        "workload": workload,
        "arrivals": arrivals,
        "metrics": metrics,
        "distributions": distributions,
    }


def write_json(path: Path, document: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema_version": SCHEMA_VERSION, **document}, indent=2) + "\n")
    return path


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def metrics_table(runs: Sequence[dict], title: str, baseline: str | None = None) -> Table:
    """One row per run: throughputs, latency percentiles, goodput, and the ratio to `baseline`."""
    base = next((r for r in runs if r["system"]["name"] == baseline), None)
    table = Table(title=title)
    columns = (
        "system",
        "req/s",
        "out tok/s",
        "total tok/s",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "ITL p50",
        "ITL p99",
        "E2E p99",
        "goodput req/s",
        "ok/failed",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "system" else "right")
    if base is not None:
        table.add_column(f"x {baseline}", justify="right")
    for run in runs:
        m = run["metrics"]
        goodput = m.get("goodput")
        rate = run["arrivals"]["request_rate"]
        label = run["system"]["name"] + ("" if rate == "inf" else f" @ {rate:g} req/s")
        row = [
            label,
            f"{m['request_throughput']:.2f}",
            f"{m['output_throughput']:.1f}",
            f"{m['total_token_throughput']:.1f}",
            _ms(m["ttft_ms"]["p50"]),
            _ms(m["ttft_ms"]["p99"]),
            _ms(m["tpot_ms"]["p50"]),
            _ms(m["itl_ms"]["p50"]),
            _ms(m["itl_ms"]["p99"]),
            _ms(m["e2el_ms"]["p99"]),
            f"{goodput['request_goodput']:.2f}" if goodput else "-",
            f"{m['completed']}/{m['failed']}",
        ]
        if base is not None:
            row.append(f"{m['output_throughput'] / base['metrics']['output_throughput']:.2f}")
        table.add_row(*row)
    return table


def print_table(table: Table) -> None:
    """Print to stdout; wide enough for every column even when stdout is a file or a pipe."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    console.print(table)
