"""Import layering: no product package imports a package above its own layer.

Why: an upward import drags the upper layer (gRPC servers, the HTTP stack, the CLI) into every user
of the lower one and opens the way to import cycles; with every arrow pointing down, each layer can be
loaded, tested and reused without the ones above it. The walk is static (`ast`), so it also sees
imports inside functions and under `TYPE_CHECKING`, which a runtime check would miss.
"""

from __future__ import annotations

import ast
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

# The modules that hold the model's weights or its KV cache: the decode front door must not need them,
# so that it can run in a process that never loads them (it knows the model by `engine.model_facts`).
WEIGHT_MODULES = ("engine.engine", "engine.models", "engine.model_runner", "engine.kv_cache")


def product_packages() -> set[str]:
    """Top-level directories of the repository that are Python packages, tests aside."""
    return {entry.parent.name for entry in ROOT.glob("*/__init__.py")} - {"tests"}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every absolute import in the file, at any depth of the syntax tree."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def imported_names(path: Path) -> list[tuple[int, str]]:
    """`imported_modules`, plus `package.name` for each `from package import name` (which may be a module)."""
    found = imported_modules(path)
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def offending_imports() -> list[str]:
    """One line per import that points up a layer or across to a peer, as `file:line: module (why)`."""
    offences = []
    for package in sorted(RANK):
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if any(fnmatch(relative, pattern) for pattern in CLI_MODULES):
                continue
            for line, module in imported_modules(path):
                target = module.partition(".")[0]
                if target == package or target not in RANK or RANK[target] < RANK[package]:
                    continue
                relation = "its peer" if RANK[target] == RANK[package] else "a higher layer"
                offences.append(f"{relative}:{line}: imports {module} ({package} -> {target}, {relation})")
    return offences


def test_every_package_has_a_layer() -> None:
    assert product_packages() == set(RANK), "add each new top-level package to LAYERS"


def test_the_walk_sees_imports_inside_functions() -> None:
    # tandem.cli imports bench lazily, inside a function; a walk that missed it would pass vacuously.
    assert "bench.cli" in {module for _, module in imported_modules(ROOT / "tandem" / "cli.py")}


def test_the_decode_engine_core_never_imports_its_front_door() -> None:
    """The core must be able to run in a process of its own, knowing the front door only by messages."""
    core = ROOT / "decode_service" / "engine_core"
    offences = [
        f"{path.relative_to(ROOT).as_posix()}:{line}: imports {module}"
        for path in sorted(core.rglob("*.py"))
        for line, module in imported_modules(path)
        if module.startswith("decode_service.front_door")
    ]
    assert list(core.rglob("*.py")), "the walk found no engine core"
    assert not offences, "the engine core imports its front door:\n" + "\n".join(offences)


def test_no_package_imports_upward_or_across() -> None:
    offences = offending_imports()
    assert not offences, "imports against the layering:\n" + "\n".join(offences)


def test_the_decode_front_door_knows_the_model_only_by_its_facts() -> None:
    """Type-only imports count too: an annotation is how a dependency on the engine creeps back in."""
    front_door = ROOT / "decode_service" / "front_door"
    offences = {
        f"{path.relative_to(ROOT).as_posix()}:{line}: imports {weights}"
        for path in sorted(front_door.rglob("*.py"))
        for line, module in imported_names(path)
        for weights in WEIGHT_MODULES
        if module == weights or module.startswith(f"{weights}.")
    }
    assert list(front_door.rglob("*.py")), "the walk found no front door"
    assert not offences, "the front door imports what holds the weights:\n" + "\n".join(sorted(offences))
