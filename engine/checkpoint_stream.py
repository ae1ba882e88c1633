"""A safetensors checkpoint read as a stream of `(name, tensor)`, one tensor at a time.

Why a stream: a dict of the whole checkpoint, cast to the engine's dtype, is the checkpoint again in
fp32 (twice a bf16 file) next to the model being filled from it; for an 8 B model that is ~30 GB before
the model holds a byte. Here each shard is memory-mapped (`safe_open`), each tensor is handed out as it
is stored (a view of the mapped file, its own dtype) for the model to convert or quantize straight into
its parameter, and its pages are given back (`engine.mapped_pages`) when the model asks for the next
one: peak memory at load is the resident model plus about one tensor.

Every shard's header is read before any tensor, so a checkpoint whose shards repeat a tensor, or one
that cannot be read, is refused before loading starts; non-finite weights are refused per tensor as
they stream (`engine.model_cache_check.check_finite`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open

from base.errors import ModelNotFoundError
from engine import mapped_pages
from engine.model_cache_check import check_finite

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shard:
    """One safetensors file and the names of the tensors it holds, in file order."""

    path: Path
    names: tuple[str, ...]


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint's config and shards, its weights not read yet (`tensors` reads them)."""

    path: Path
    config: PretrainedConfig
    shards: tuple[Shard, ...]

    @property
    def names(self) -> list[str]:
        """Every tensor name on disk, shard by shard (a tied LM head is usually absent: none is invented)."""
        return [name for shard in self.shards for name in shard.names]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor as stored, shard by shard; raises NonFiniteWeightsError at a NaN or infinite one.

        A tensor views its mapped shard: use it (copy, convert, quantize) before asking for the next,
        which gives its pages back; one kept past that still reads right, from the file again.
        """
        started, count, nbytes = time.monotonic(), 0, 0
        for shard in self.shards:
            with _open(shard.path) as handle:
                for name in shard.names:
                    tensor = handle.get_tensor(name)
                    check_finite(name, tensor, shard.path)
                    yield name, tensor
                    count, nbytes = count + 1, nbytes + tensor.nbytes
                    mapped_pages.release(tensor, shard.path)
                    del tensor
        logger.info(
            "checkpoint streamed",
            extra={
                "path": str(self.path),
                "tensors": count,
                "bytes": nbytes,
                "seconds": round(time.monotonic() - started, 2),
            },
        )


def read_shards(paths: Sequence[Path]) -> tuple[Shard, ...]:
    """Each shard's tensor names from its header. Raises ModelNotFoundError for a shard that cannot be
    read or that repeats a tensor of an earlier one (which would load one of the two at random)."""
    shards: list[Shard] = []
    seen: set[str] = set()
    for path in paths:
        with _open(path) as handle:
            names = tuple(handle.offset_keys() if hasattr(handle, "offset_keys") else handle.keys())
        duplicated = seen.intersection(names)
        if duplicated:
            raise ModelNotFoundError(f"{path} repeats tensors from another shard: {sorted(duplicated)[:5]}")
        seen.update(names)
        shards.append(Shard(path, names))
    return tuple(shards)


def _open(path: Path):
    """`safe_open` the shard for torch on the CPU, its failure as ModelNotFoundError."""
    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError) as exc:
        raise ModelNotFoundError(f"cannot read weights from {path}: {exc}") from exc
