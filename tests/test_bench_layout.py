"""How bench/ is laid out: where its commands write by default, and no import circle among its modules."""

from __future__ import annotations

import argparse
import ast
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


def bench_imports(root: Path = BENCH) -> dict[str, set[str]]:
    """Each module of the `bench` package under `root` and the package's modules it imports, at any
    depth in its code (lazy imports inside functions count: they are still a dependency)."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = ("bench", *path.relative_to(root).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # `from bench import compare` imports the module bench.compare.
                found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        graph[name] = {other for other in found if other in modules and other != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_bench_has_no_import_circle() -> None:
    graph = bench_imports()
    assert {"bench.compare", "bench.plots", "bench.report"} <= set(graph)
    assert circles(graph) == [], "modules of bench/ that import each other, directly or not"


def test_the_circle_finder_finds_a_circle_through_a_lazy_and_a_package_import(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("def f():\n    from bench import b\n")
    (tmp_path / "b.py").write_text("import bench.c\n")
    (tmp_path / "c.py").write_text("from bench.a import f\n")
    (tmp_path / "d.py").write_text("from bench import a\n")
    graph = bench_imports(tmp_path)
    assert graph["bench.a"] == {"bench.b"} and graph["bench.d"] == {"bench.a"}
    assert circles(graph) == [["bench.a", "bench.b", "bench.c"]]
