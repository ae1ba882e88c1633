"""Build llama.cpp's `llama-server` and `llama-quantize` once into the tandem cache; make F32 and Q8_0 GGUFs.

llama.cpp is the strongest CPU peer we compare against, but it is not packaged as a binary here. PyPI's
`llama-cpp-python` sdist vendors its sources, so we fetch that sdist with pip, configure only the two
targets we need (server on; web UI, prebuilt-UI download, OpenSSL and curl off; native CPU flags; static
libraries so the binaries stand alone) and build them under `nice -n 19`, because the machine's cores
are shared. The model is the very Q4_1 GGUF tandem's default model comes from, re-quantized to F32 with
`llama-quantize --allow-requantize`, so llama.cpp and tandem compute with the same dequantized weights,
and that F32 file quantized to Q8_0, what llama.cpp's CPU users run.

This is slow (about 10 minutes on 2 cores) and never part of `make test`:

    python -m bench.llama_cpp_build [--force] [--jobs 2]

Everything lands in `$TANDEM_HOME/tools/llama.cpp/` (`bin/`, `models/`, `manifest.json`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from engine.model_store import tandem_home

logger = logging.getLogger(__name__)

SDIST_PACKAGE = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
TARGETS = ("llama-server", "llama-quantize")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
)
Q4_1_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
F32_NAME = "SmolLM2-135M-Instruct.F32.gguf"
Q8_0_NAME = "SmolLM2-135M-Instruct.Q8_0.gguf"


@dataclass(frozen=True)
class LlamaCppTools:
    """Where the built binaries and the GGUF files live."""

    root: Path

    @property
    def server(self) -> Path:
        return self.root / "bin" / "llama-server"

    @property
    def quantize(self) -> Path:
        return self.root / "bin" / "llama-quantize"

    @property
    def q4_1_model(self) -> Path:
        return self.root / "models" / Q4_1_NAME

    @property
    def f32_model(self) -> Path:
        return self.root / "models" / F32_NAME

    @property
    def q8_0_model(self) -> Path:
        """What CPU users of llama.cpp run: 8-bit blocks of 32 weights, each with an fp16 scale."""
        return self.root / "models" / Q8_0_NAME

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"

    def is_built(self) -> bool:
        return self.server.is_file() and self.quantize.is_file()

    def is_ready(self) -> bool:
        return self.is_built() and self.f32_model.is_file() and self.q8_0_model.is_file()


def default_tools(home: Path | None = None) -> LlamaCppTools:
    return LlamaCppTools((home if home is not None else tandem_home()) / "tools" / "llama.cpp")


def _run(command: list[str], cwd: Path | None = None) -> None:
    logger.info("running %s", " ".join(command))
    subprocess.run(command, cwd=cwd, check=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fetch_sources(scratch: Path) -> tuple[Path, str]:
    """pip-download the sdist and unpack only its vendored llama.cpp tree; returns (tree, sdist sha256)."""
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--quiet",
            f"{SDIST_PACKAGE}=={SDIST_VERSION}",
            "-d",
            str(scratch / "sdist"),
        ]
    )
    sdist = next((scratch / "sdist").glob("*.tar.gz"))
    prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
        archive.extractall(scratch / "src", members=members, filter="data")
    return scratch / "src" / prefix, _sha256(sdist)


def build_binaries(tools: LlamaCppTools, jobs: int) -> str:
    """Configure and build the two targets with nice -n 19, install them into `tools.root/bin`."""
    with tempfile.TemporaryDirectory(prefix="llama-cpp-build-") as scratch_name:
        scratch = Path(scratch_name)
        source, sdist_sha256 = _fetch_sources(scratch)
        build = scratch / "build"
        _run(["nice", "-n", "19", "cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", *CMAKE_FLAGS])
        _run(
            [
                "nice",
                "-n",
                "19",
                "cmake",
                "--build",
                str(build),
                "--parallel",
                str(jobs),
                "--target",
                *TARGETS,
            ]
        )
        (tools.root / "bin").mkdir(parents=True, exist_ok=True)
        for target in TARGETS:
            shutil.copy2(build / "bin" / target, tools.root / "bin" / target)
    return sdist_sha256


def make_f32_model(tools: LlamaCppTools) -> None:
    """Extract the default model's Q4_1 GGUF from its pinned wheel and re-quantize it to F32."""
    from engine.model_store import _download_gguf

    tools.f32_model.parent.mkdir(parents=True, exist_ok=True)
    if not tools.q4_1_model.is_file():
        with tempfile.TemporaryDirectory(prefix="smollm2-gguf-") as scratch:
            shutil.copy2(_download_gguf(Path(scratch)), tools.q4_1_model)
    _run([str(tools.quantize), "--allow-requantize", str(tools.q4_1_model), str(tools.f32_model), "F32"])


def make_q8_0_model(tools: LlamaCppTools) -> None:
    """Quantize the F32 GGUF to Q8_0, as llama.cpp users do with `llama-quantize`."""
    _run([str(tools.quantize), str(tools.f32_model), str(tools.q8_0_model), "Q8_0"])


def ensure_llama_cpp(tools: LlamaCppTools, jobs: int = 2, force: bool = False) -> LlamaCppTools:
    """Build what is missing (everything with `force`) and record how in `manifest.json`."""
    started = time.monotonic()
    manifest = json.loads(tools.manifest.read_text()) if tools.manifest.is_file() and not force else {}
    if force or not tools.is_built():
        manifest = {
            "sdist": f"{SDIST_PACKAGE}=={SDIST_VERSION}",
            "sdist_sha256": build_binaries(tools, jobs),
            "cmake_flags": list(CMAKE_FLAGS),
            "targets": list(TARGETS),
        }
    if force or not tools.f32_model.is_file():
        make_f32_model(tools)
    manifest["f32_model"] = tools.f32_model.name
    if force or not tools.q8_0_model.is_file():
        make_q8_0_model(tools)
    manifest["q8_0_model"] = tools.q8_0_model.name
    tools.manifest.write_text(json.dumps(manifest, indent=2) + "\n")
    logger.info("llama.cpp tools ready in %s (%.0f s)", tools.root, time.monotonic() - started)
    return tools


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", type=Path, default=None, help="tandem home (default: $TANDEM_HOME)")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs (default: 2)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the binaries exist")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tools = ensure_llama_cpp(default_tools(args.home), jobs=args.jobs, force=args.force)
    print(tools.server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
