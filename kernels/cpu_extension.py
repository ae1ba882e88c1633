"""The C++ CPU kernels, compiled on first use and cached: paged attention and the fused small ops.

Pure torch can only attend over paged KV after gathering every sequence's blocks into a padded
copy, once per layer per step; on a CPU that copy cost more than the attention itself. The C++
kernel reads the blocks in place through the block table. RMSNorm, RoPE and SiLU-and-multiply are
single passes instead of torch's chains of small ops. The module is built with the machine's C++
compiler the first time a process needs it (torch caches the build under `$TORCH_EXTENSIONS_DIR`,
by default `~/.cache/torch_extensions`); where no compiler is found the torch path runs instead,
with one warning. `TANDEM_CPU_EXTENSION=0` turns it off.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

CPU_DIR = Path(__file__).parent / "cpu"
SOURCES = [CPU_DIR / "paged_attention.cpp", CPU_DIR / "fused_ops.cpp", CPU_DIR / "bindings.cpp"]
DISABLE_ENV = "TANDEM_CPU_EXTENSION"


@functools.cache
def load() -> ModuleType | None:
    """The compiled module, or None when it is disabled or cannot be built here."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    from torch.utils.cpp_extension import load as build

    logger.info(
        "loading the C++ CPU kernels: the first start on a machine compiles them, about a minute "
        "(later starts load the cached build)"
    )
    try:
        return build(
            name="tandem_cpu_kernels",
            sources=[str(path) for path in SOURCES],
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, no headers: the torch path still works
        logger.warning("CPU attention extension unavailable, using the torch path: %s", exc)
        return None
