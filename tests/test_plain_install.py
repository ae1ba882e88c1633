"""A plain install (`pip install .`, no extras: what the container image runs) serves.

The image installs the project without extras, while `make` installs `.[dev,bench]`; a module the servers
import that only an extra brings made every Helm release crash-loop once. This test builds a fresh
virtual environment holding exactly what `pip install .` would: the project and the transitive closure
of its runtime `dependencies`, linked from this environment's installed distributions (a real download
and install of ~2 GB would add minutes to every run), then runs `tandem selftest` in it: both tiers start
on a tiny model, answer over gRPC and HTTP, and stop cleanly.
"""

from __future__ import annotations

import os
import re
import subprocess
import venv
from importlib import metadata
from pathlib import Path

import pytest
from conftest import free_ports
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
# pyproject.toml is read with the standard library's TOML reader (Python 3.11+, what `make` uses).
tomllib = pytest.importorskip("tomllib")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_closure(requirements: list[str]) -> dict[str, metadata.Distribution]:
    """Every installed distribution `requirements` pull in, transitively, with markers evaluated the way
    pip evaluates them here (extras only where a requirement asks for them)."""
    found: dict[str, metadata.Distribution] = {}
    pending = [(Requirement(text), "") for text in requirements]
    seen: set[tuple[str, str]] = set()
    while pending:
        requirement, extra = pending.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = _canonical(requirement.name)
        extras = sorted(requirement.extras) or [""]
        for wanted in extras:
            if (name, wanted) in seen:
                continue
            seen.add((name, wanted))
            try:
                dist = metadata.distribution(name)
            except metadata.PackageNotFoundError:
                continue  # not installed here either (an optional platform package)
            found[name] = dist
            pending += [(Requirement(text), wanted) for text in dist.requires or []]
    return found


def top_level_entries(dist: metadata.Distribution) -> set[Path]:
    """What the distribution installed at the top of site-packages (packages, modules, .libs, dist-info)."""
    site = Path(dist.locate_file(""))
    entries = set()
    for file in dist.files or []:
        first = file.parts[0]
        if first in ("..", "__pycache__") or first.endswith(".pth"):
            continue
        entries.add(site / first)
    return entries


@pytest.fixture(scope="module")
def plain_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual environment with the project and its runtime dependencies only; returns its python."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    target = tmp_path_factory.mktemp("plain") / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(target)
    python = target / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    for dist in runtime_closure(project["dependencies"]).values():
        for entry in top_level_entries(dist):
            link = site / entry.name
            if entry.exists() and not link.exists():
                link.symlink_to(entry)
    (site / "tandem-source.pth").write_text(f"{ROOT}\n")
    return python


def test_the_plain_install_has_no_extras(plain_venv: Path) -> None:
    """The environment is what `pip install .` gives: runtime dependencies yes, the extras' modules no."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(_canonical(Requirement(r).name) == "matplotlib" for r in project["dependencies"])
    probe = "import importlib.util as u; print([m for m in {} if u.find_spec(m) is None])"
    wanted = ["torch", "grpc", "transformers", "xgrammar", "msgspec", "fastapi"]
    extras = ["matplotlib", "pytest", "guidellm", "openai", "jsonschema"]
    missing = subprocess.run(
        [plain_venv, "-c", probe.format(wanted + extras)], check=True, capture_output=True, text=True
    ).stdout.strip()
    assert missing == repr(extras)


@pytest.mark.slow
def test_the_plain_install_serves_both_tiers(plain_venv: Path) -> None:
    """`tandem selftest` in the plain environment: both tiers start, answer and stop cleanly."""
    port, http_port, prefill_port = free_ports(3)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    # The C++ kernels are not what this checks: built against this venv's torch path, torch would rebuild
    # them in the shared extension cache, and every later server of the suite would wait on that build.
    env["TANDEM_CPU_EXTENSION"] = "0"
    result = subprocess.run(
        [plain_venv, "-m", "tandem.cli", "selftest", "--port", str(port), "--http-port", str(http_port)]
        + ["--prefill-port", str(prefill_port)],
        capture_output=True,
        text=True,
        env=env,
        cwd=plain_venv.parent,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "selftest passed" in result.stderr
