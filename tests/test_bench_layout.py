"""How bench/ is laid out: where its commands write by default."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from bench.cli import BENCH_COMMANDS
from bench.report import RESULTS_ENV, results_dir

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
# The flags that name where a command writes (or, for perf-report and profile, reads back) results.
RESULT_FLAGS = {"out", "out_dir", "result_file", "results_dir", "compare_file", "compare_json"}


def test_results_dir_is_the_variable_else_under_tandem_home(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv(RESULTS_ENV, str(tmp_path / "mine"))
    assert results_dir() == tmp_path / "mine"
    monkeypatch.delenv(RESULTS_ENV)
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    assert results_dir() == tmp_path / "home" / "bench-results"


def test_every_command_writes_outside_the_tree_by_default(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv(RESULTS_ENV, str(tmp_path))
    checked = 0
    for name, module_name, _ in BENCH_COMMANDS:
        parser = argparse.ArgumentParser()
        importlib.import_module(module_name).add_arguments(parser)
        for action in parser._actions:
            if action.dest in RESULT_FLAGS:
                assert Path(action.default).is_relative_to(tmp_path), f"bench {name} --{action.dest}"
                checked += 1
    assert checked >= len(BENCH_COMMANDS)
    # The `python -m bench.<module>` tools build their parsers in main(): no default names the tree.
    for path in BENCH.glob("*.py"):
        assert '"bench/results' not in path.read_text(), f"{path.name} writes into the tree by default"
