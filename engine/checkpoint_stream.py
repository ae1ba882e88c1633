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

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open

from base.errors import ModelNotFoundError
from engine import mapped_pages
from engine.load_progress import LoadProgress
from engine.model_cache_check import check_finite

if TYPE_CHECKING:
    from transformers import PretrainedConfig


# Bytes per element of each safetensors dtype, by the name its header gives it.
DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1,
}  # fmt: skip


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as its shard's header describes it, before any of its bytes are read."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES.get(self.dtype, 4)


@dataclass(frozen=True)
class Shard:
    """One safetensors file and the tensors it holds, in file order."""

    path: Path
    tensors: tuple[StoredTensor, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(tensor.name for tensor in self.tensors)


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

    @property
    def stored(self) -> list[StoredTensor]:
        """Every tensor's dtype and shape on disk, shard by shard, from the headers alone."""
        return [tensor for shard in self.shards for tensor in shard.tensors]

    @property
    def nbytes(self) -> int:
        """The bytes of every tensor on disk (what a load reads)."""
        return sum(tensor.nbytes for tensor in self.stored)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor as stored, shard by shard; raises NonFiniteWeightsError at a NaN or infinite one.

        A tensor views its mapped shard: use it (copy, convert, quantize) before asking for the next,
        which gives its pages back; one kept past that still reads right, from the file again. How far
        the load is (tensors, bytes, rate, time left) is shown as `engine.load_progress` says.
        """
        progress = LoadProgress(f"loading {self.path.name}", len(self.stored), self.nbytes)
        for shard in self.shards:
            with _open(shard.path) as handle:
                for name in shard.names:
                    tensor = handle.get_tensor(name)
                    check_finite(name, tensor, shard.path)
                    yield name, tensor
                    progress.advance(1, tensor.nbytes)
                    mapped_pages.release(tensor, shard.path)
                    del tensor
        progress.finish("checkpoint streamed", path=str(self.path))


def read_shards(paths: Sequence[Path]) -> tuple[Shard, ...]:
    """Each shard's tensor names from its header. Raises ModelNotFoundError for a shard that cannot be
    read or that repeats a tensor of an earlier one (which would load one of the two at random)."""
    shards: list[Shard] = []
    seen: set[str] = set()
    for path in paths:
        with _open(path) as handle:
            names = tuple(handle.offset_keys() if hasattr(handle, "offset_keys") else handle.keys())
            tensors = tuple(_stored(handle, name) for name in names)
        duplicated = seen.intersection(names)
        if duplicated:
            raise ModelNotFoundError(f"{path} repeats tensors from another shard: {sorted(duplicated)[:5]}")
        seen.update(names)
        shards.append(Shard(path, tensors))
    return tuple(shards)


def _stored(handle, name: str) -> StoredTensor:
    """A tensor's dtype and shape from the shard's header (`get_slice` reads none of its bytes)."""
    view = handle.get_slice(name)
    return StoredTensor(name, view.get_dtype(), tuple(view.get_shape()))


def _open(path: Path):
    """`safe_open` the shard for torch on the CPU, its failure as ModelNotFoundError."""
    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError) as exc:
        raise ModelNotFoundError(f"cannot read weights from {path}: {exc}") from exc
