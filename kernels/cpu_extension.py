"""The C++ CPU kernels, compiled on first use and cached: paged attention and the cache write, the fused
small ops (fp32 and bf16), the linear layers' few-row GEMV (fp32, bf16, int8 and GGUF block weights) and
int8-weight GEMM, and the decode-only decoder stack built from them.

Pure torch can only attend over paged KV after gathering every sequence's blocks into a padded
copy, once per layer per step; on a CPU that copy cost more than the attention itself. The C++
kernel reads the blocks in place through the block table. RMSNorm, RoPE and SiLU-and-multiply are
single passes instead of torch's chains of small ops. The module is built with the machine's C++
compiler the first time a process needs it (torch caches the build under `$TORCH_EXTENSIONS_DIR`,
by default `~/.cache/torch_extensions`); where no compiler is found the torch path runs instead,
with one warning. The build's name carries a hash of the sources, flags and source folder, so two
versions of the kernels, or two checkouts (torch's build file names source paths, so they would
rebuild each other's module), never share a cache entry. torch guards a build with a bare `lock`
file that a killed compile leaves behind, after which every later load waits on it forever; so
builds here also hold an `flock` that the kernel drops when its holder dies, and a `lock` found
while holding it is stale and removed. `make install` builds it ahead (`python -m kernels.cpu_extension`);
otherwise the first process to need it pays for the compile, announced by one log line.
`TANDEM_CPU_EXTENSION=0` turns it off.

Only `bindings.cpp` includes `<torch/extension.h>` (pybind11 and the whole C++ frontend); the kernels
include `<torch/types.h>`, the tensor API alone, which compiles in a third of the time per file.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

CPU_DIR = Path(__file__).parent / "cpu"
SOURCES = [
    CPU_DIR / "paged_attention.cpp",
    CPU_DIR / "fused_ops.cpp",
    CPU_DIR / "fused_ops_bf16.cpp",
    CPU_DIR / "gemv.cpp",
    CPU_DIR / "gemv_int8.cpp",
    CPU_DIR / "gemv_q8_0.cpp",
    CPU_DIR / "gemv_q8_0_w8a8.cpp",
    CPU_DIR / "gemv_blocks.cpp",
    CPU_DIR / "q8_0_linear.cpp",
    CPU_DIR / "gemv_bf16.cpp",
    CPU_DIR / "gemm_int8.cpp",
    CPU_DIR / "w8a8.cpp",
    CPU_DIR / "lm_head.cpp",
    CPU_DIR / "kv_cache.cpp",
    CPU_DIR / "decode_stack.cpp",
    CPU_DIR / "decode_region.cpp",
    CPU_DIR / "bindings.cpp",
]
HEADERS = [CPU_DIR / "kernels.h", CPU_DIR / "gemv_common.h", CPU_DIR / "row_ops.h", CPU_DIR / "half_float.h"]
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
COMPILE_SECONDS = 70  # measured on the 2-core development machine (AMD EPYC); told to the user before a build


def build_name() -> str:
    """`tandem_cpu_kernels_<hash>`: the hash covers every source, header, flag and the source folder."""
    digest = hashlib.sha256()
    sources = [path.read_bytes() for path in [*SOURCES, *HEADERS]]
    folders = sorted({str(path.resolve().parent) for path in SOURCES})
    for part in [*sources, " ".join(CFLAGS + LDFLAGS).encode(), "\n".join(folders).encode()]:
        digest.update(part)
    return f"tandem_cpu_kernels_{digest.hexdigest()[:10]}"


@contextlib.contextmanager
def exclusive_build(build_dir: Path) -> Iterator[None]:
    """Hold the build folder's flock; a torch `lock` still there once it is held was left by a dead build."""
    with open(build_dir / "build.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("removing a lock left by an interrupted build: %s", stale)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.cache
def load() -> ModuleType | None:
    """The compiled module, or None when it cannot be built here.

    Whether the engine uses it (`TANDEM_CPU_EXTENSION`) is `kernels.platform`'s choice, not this build's.
    """
    from torch.utils.cpp_extension import _get_build_directory
    from torch.utils.cpp_extension import load as build

    name = build_name()
    try:
        build_dir = Path(_get_build_directory(name, verbose=False))
        if not (build_dir / f"{name}.so").exists():
            logger.info(
                "compiling the C++ CPU kernels once for this machine (about %d s on 2 cores) into %s",
                COMPILE_SECONDS,
                build_dir,
                extra={"build": name},
            )
        with exclusive_build(build_dir):
            return build(
                name=name,
                sources=[str(path) for path in SOURCES],
                extra_cflags=CFLAGS,
                extra_ldflags=LDFLAGS,
                verbose=False,
            )
    except Exception as exc:  # no compiler, no ninja, no headers: the torch path still works
        logger.warning("CPU kernel extension unavailable, using the torch path: %s", exc)
        return None


def main() -> int:
    """Build (or find) the extension now; exit 1 when it cannot be built here."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    module = load()
    if module is None:
        return 1
    logger.info("CPU kernels ready: %s (GEMV on %s)", module.__file__, module.gemv_isa())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
