"""Import layering: no product package imports a package above its own layer, and what the decode
tier's two halves reach, through any chain of imports, is what their promises say.

Why: an upward import drags the upper layer (gRPC servers, the HTTP stack, the CLI) into every user
of the lower one and opens the way to import cycles; with every arrow pointing down, each layer can be
loaded, tested and reused without the ones above it. The walk is static (`ast`), so it also sees
imports inside functions and under `TYPE_CHECKING`, which a runtime check would miss.

The promises are checked on the transitive closure of the import graph: a module that imports nothing
forbidden itself but imports one that does reaches it all the same, and each offence is reported with
the chain of files that reaches it. `test_the_checker_*` feed the checker small trees of their own, so
it cannot pass by seeing nothing.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Iterable
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Bottom to top. A package may import its own modules and packages of lower layers; packages that
# share a layer are peers and never import each other (the two tiers stay independent).
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"protos", "base"}),
    frozenset({"kernels"}),
    frozenset({"engine"}),
    frozenset({"kv_transfer"}),
    frozenset({"serving"}),
    frozenset({"prefill_service", "decode_service"}),
    frozenset({"tandem"}),
    frozenset({"bench"}),
)
RANK = {package: rank for rank, layer in enumerate(LAYERS) for package in layer}

# The command line wires every layer together (`tandem bench` runs bench), so it alone may import up.
CLI_MODULES = ("tandem/cli.py", "tandem/up*.py")

# What holds the model's weights or its KV cache, and the torch-level kernels that run them: the decode
# front door must not need any of it, so that it can run in a process that never loads them (it knows
# the model by `engine.model_facts`).
WEIGHT_MODULES = ("engine.engine", "engine.models", "engine.model_runner", "engine.kv_cache", "kernels")
FRONT_DOOR = "decode_service.front_door"
ENGINE_CORE = "decode_service.engine_core"

# module -> {module it loads: first line that loads it}
Graph = dict[str, dict[str, int]]


def product_packages(root: Path = ROOT) -> set[str]:
    """Top-level directories of the repository that are Python packages, tests aside."""
    return {entry.parent.name for entry in root.glob("*/__init__.py")} - {"tests"}


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `packages` under `root` (a package is its
    `__init__.py`)."""
    files = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def imported_names(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) for every import in the file, at any depth of the syntax tree, relative ones
    resolved; a `from a import b` gives both `a` and `a.b` (which may be a module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found.append((node.lineno, source))
            found += [(node.lineno, f"{source}.{alias.name}") for alias in node.names]
    return found


def import_graph(root: Path = ROOT, packages: Iterable[str] | None = None) -> Graph:
    """The static import graph of the product modules: loading `a.b.c` loads packages `a` and `a.b` too."""
    files = module_files(root, product_packages(root) if packages is None else packages)
    graph: Graph = {}
    for module, path in files.items():
        edges: dict[str, int] = {}
        for line, name in imported_names(module, path):
            parts = name.split(".")
            for end in range(1, len(parts) + 1):
                target = ".".join(parts[:end])
                if target in files and target != module:
                    edges.setdefault(target, line)
        graph[module] = edges
    return graph


def within(module: str, prefixes: Iterable[str]) -> bool:
    return any(module == prefix or module.startswith(f"{prefix}.") for prefix in prefixes)


def module_path(graph_files: dict[str, Path], module: str, root: Path) -> str:
    return graph_files[module].relative_to(root).as_posix()


def forbidden_chains(
    graph: Graph, starts: Iterable[str], forbidden: Callable[[str], bool]
) -> dict[str, list[str]]:
    """For every forbidden module the `starts` reach, the shortest chain of modules that reaches it.

    The walk does not go on through a forbidden module: each offence is where a chain first crosses the
    line, which is the import to cut."""
    parent: dict[str, str | None] = {start: None for start in starts}
    queue = deque(parent)
    offences = {}
    while queue:
        module = queue.popleft()
        if forbidden(module):
            chain = [module]
            while (previous := parent[chain[-1]]) is not None:
                chain.append(previous)
            offences[module] = chain[::-1]
            continue
        for target in graph.get(module, {}):
            if target not in parent:
                parent[target] = module
                queue.append(target)
    return offences


def describe(
    chains: dict[str, list[str]], root: Path = ROOT, packages: Iterable[str] | None = None
) -> list[str]:
    """One line per offence: the files of its chain, `a.py -> b/__init__.py -> ...`."""
    files = module_files(root, product_packages(root) if packages is None else packages)
    return [" -> ".join(module_path(files, m, root) for m in chain) for _, chain in sorted(chains.items())]


def promise_offences(
    root: Path, starts_under: str, forbidden: Iterable[str], packages: Iterable[str] | None = None
) -> list[str]:
    """The chains from any module under `starts_under` to a module under one of `forbidden`."""
    forbidden = tuple(forbidden)
    graph = import_graph(root, packages)
    starts = [module for module in graph if within(module, (starts_under,))]
    assert starts, f"the walk found no {starts_under}"
    chains = forbidden_chains(graph, starts, lambda module: within(module, forbidden))
    return describe(chains, root, packages)


def offending_imports() -> list[str]:
    """One line per import that points up a layer or across to a peer, as `file:line: module (why)`.

    Direct edges suffice here: when every edge points down, so does every chain."""
    files = module_files(ROOT, product_packages())
    offences = []
    for module, edges in sorted(import_graph().items()):
        relative = module_path(files, module, ROOT)
        package = module.partition(".")[0]
        if any(fnmatch(relative, pattern) for pattern in CLI_MODULES):
            continue
        for target, line in sorted(edges.items()):
            top = target.partition(".")[0]
            if top == package or RANK[top] < RANK[package]:
                continue
            relation = "its peer" if RANK[top] == RANK[package] else "a higher layer"
            offences.append(f"{relative}:{line}: imports {target} ({package} -> {top}, {relation})")
    return offences


def test_every_package_has_a_layer() -> None:
    assert product_packages() == set(RANK), "add each new top-level package to LAYERS"


def test_the_walk_sees_imports_inside_functions() -> None:
    # tandem.cli imports bench lazily, inside a function; a walk that missed it would pass vacuously.
    assert "bench.cli" in import_graph()["tandem.cli"]


def test_no_package_imports_upward_or_across() -> None:
    offences = offending_imports()
    assert not offences, "imports against the layering:\n" + "\n".join(offences)


def test_the_decode_engine_core_never_reaches_its_front_door() -> None:
    """The core must be able to run in a process of its own, knowing the front door only by messages."""
    offences = promise_offences(ROOT, ENGINE_CORE, [FRONT_DOOR])
    assert not offences, "the engine core reaches its front door:\n" + "\n".join(offences)


def test_the_decode_front_door_knows_the_model_only_by_its_facts() -> None:
    """Type-only imports count too: an annotation is how a dependency on the engine creeps back in."""
    offences = promise_offences(ROOT, FRONT_DOOR, WEIGHT_MODULES)
    assert not offences, "the front door reaches what holds the weights:\n" + "\n".join(offences)


def test_the_decode_front_door_loads_without_the_model_code() -> None:
    """At run time too: importing every front-door module leaves the weights' modules and the kernels
    unloaded (torch itself may come in through third-party libraries)."""
    graph = import_graph()
    modules = sorted(module for module in graph if within(module, (FRONT_DOOR,)))
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        f"weights = {WEIGHT_MODULES!r}\n"
        "print(sorted(m for m in sys.modules if any(m == w or m.startswith(w + '.') for w in weights)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]", f"importing the front door loaded {done.stdout.strip()}"


# The checker on trees of its own: an offence two imports away is caught, and a clean tree reports none.


def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


TREE = {
    "svc/__init__.py": "",
    "svc/config.py": "from svc.limits import LIMIT\n",
    "svc/limits.py": "LIMIT = 1\n",
    "svc/core/__init__.py": "",
    "svc/core/stage.py": "def build():\n    from .. import config\n    return config\n",
    "svc/door/__init__.py": "",
    "svc/door/admission.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import svc.config\n",
    "low/__init__.py": "",
    "low/facts.py": "from . import names\n",
    "low/names.py": "",
    "low/weights.py": "",
}


def test_the_checker_catches_a_transitive_import(tmp_path: Path) -> None:
    # The core reaches the door through config (two hops, one inside a function, one relative); the
    # door reaches the weights through facts and names (three hops, one under TYPE_CHECKING).
    write_tree(
        tmp_path,
        TREE
        | {
            "svc/limits.py": "from svc.door.admission import *\n",
            "low/names.py": "import low.weights\n",
        },
    )
    packages = ("svc", "low")
    assert promise_offences(tmp_path, "svc.core", ["svc.door"], packages) == [
        "svc/core/stage.py -> svc/config.py -> svc/limits.py -> svc/door/__init__.py",
        "svc/core/stage.py -> svc/config.py -> svc/limits.py -> svc/door/admission.py",
    ]
    write_tree(tmp_path, {"svc/config.py": "from svc.limits import LIMIT\nfrom low import facts\n"})
    assert promise_offences(tmp_path, "svc.door", ["low.weights"], packages) == [
        "svc/door/admission.py -> svc/config.py -> low/facts.py -> low/names.py -> low/weights.py"
    ]


def test_the_checker_reports_nothing_without_an_offence(tmp_path: Path) -> None:
    write_tree(tmp_path, TREE)
    packages = ("svc", "low")
    assert import_graph(tmp_path, packages)["svc.core.stage"] == {"svc": 2, "svc.config": 2}
    assert promise_offences(tmp_path, "svc.core", ["svc.door"], packages) == []
    assert promise_offences(tmp_path, "svc.door", ["low.weights"], packages) == []
