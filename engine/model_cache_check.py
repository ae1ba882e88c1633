"""Integrity of a fetched model's cache, and of any checkpoint's weights as they load.

A completeness marker only says that a build finished; the files it vouches for can be truncated,
overwritten or flipped afterwards, and a server that trusted the marker served a checkpoint with 4 MiB
of NaN as empty completions. So the marker also carries a manifest, the size and SHA-256 of every
file written when the cache was built, and both `tandem fetch-model` and every server start check the
files against it. Hashing is cheap next to loading: SHA-256 of SmolLM2's 538 MB of fp32 weights takes
0.4 s from the page cache, up to 1 s on a busy host (AMD EPYC, 2 cores), and the load reads the same
bytes right after, so a server start pays little more than the hash itself.

Checkpoints that are not a tandem cache have no manifest, so loading also refuses non-finite weights,
which no served model has and which turn every logit into NaN (the sampler then emits nothing useful).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from base.errors import ModelNotFoundError

_HASH_CHUNK_BYTES = 1 << 20
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class ModelCacheDamagedError(ModelNotFoundError):
    """A cached model's files differ from what its manifest recorded when the cache was built."""


class NonFiniteWeightsError(ModelNotFoundError):
    """A checkpoint holds NaN or infinite weights: it would serve garbage, so it is not loaded."""


@dataclass(frozen=True)
class FileRecord:
    """What the cache recorded about one file when it wrote it."""

    size: int
    sha256: str

    def to_json(self) -> dict[str, int | str]:
        return {"size": self.size, "sha256": self.sha256}


def build_manifest(model_dir: Path, exclude: str) -> dict[str, FileRecord]:
    """Size and SHA-256 of every file in `model_dir` but `exclude` (the marker that will hold them)."""
    return {
        path.name: FileRecord(path.stat().st_size, file_sha256(path))
        for path in sorted(model_dir.iterdir())
        if path.is_file() and path.name != exclude
    }


def parse_manifest(raw: object) -> dict[str, FileRecord] | None:
    """The manifest a marker holds, or None when it has none or it is malformed (an unverifiable cache)."""
    if not isinstance(raw, dict) or not raw:
        return None
    manifest = {}
    for name, record in raw.items():
        if not isinstance(record, dict) or "/" in name:
            return None
        size, sha256 = record.get("size"), record.get("sha256")
        if not isinstance(size, int) or not isinstance(sha256, str) or not _SHA256_HEX.fullmatch(sha256):
            return None
        manifest[name] = FileRecord(size, sha256)
    return manifest


def verify_cache(model_dir: Path, manifest: Mapping[str, FileRecord], cure: str) -> None:
    """Raise ModelCacheDamagedError naming the first file that differs from `manifest`, and `cure`.

    Sizes are checked for every file before any is hashed, so a truncated or missing file is named as
    such at the cost of a stat. A `*.safetensors` file the manifest does not list is damage too: the
    loader would read it as weights.
    """
    for name, record in manifest.items():
        path = model_dir / name
        if not path.is_file():
            raise _damaged(path, "is missing", cure)
        size = path.stat().st_size
        if size != record.size:
            raise _damaged(path, f"is {size} bytes, but {record.size} were written (truncated?)", cure)
    for path in sorted(model_dir.glob("*.safetensors")):
        if path.name not in manifest:
            raise _damaged(path, "was not written by the fetch (it would be loaded as weights)", cure)
    for name, record in manifest.items():
        if file_sha256(model_dir / name) != record.sha256:
            raise _damaged(model_dir / name, "does not have the SHA-256 recorded when it was cached", cure)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_HASH_CHUNK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def check_finite(name: str, tensor: torch.Tensor, source: Path) -> None:
    """Raise NonFiniteWeightsError when `tensor` (`name` in `source`) is floating-point and holds NaN or
    infinity. Called on each tensor as the checkpoint streams in, so no check holds more than one.

    A sum is non-finite whenever an element is, and costs one pass with no temporary the size of the
    tensor (0.2 s for SmolLM2's 272 tensors, 135M values, where `isfinite(t).all()` took 1.3 to 3.4 s;
    AMD EPYC, 2 cores); only a non-finite sum, possibly an overflow of finite values, is counted exactly.
    The sum keeps the tensor's dtype (torch accumulates a half-precision one in fp32 all the same):
    asking for an fp32 result first copies a bf16 tensor whole to fp32, 128 MiB for a 32k x 1024
    embedding, which is what a streamed load must not hold.
    """
    if not tensor.is_floating_point() or torch.isfinite(tensor.sum()):
        return
    bad = int((~torch.isfinite(tensor)).sum())
    if bad:
        raise NonFiniteWeightsError(
            f"{source} holds {bad} NaN or infinite value(s) in {name} ({tensor.numel()} values); "
            "the weights are damaged, refusing to load them"
        )


def _damaged(path: Path, problem: str, cure: str) -> ModelCacheDamagedError:
    return ModelCacheDamagedError(
        f"the cached model is damaged: {path} {problem}; run `{cure}` to download and rebuild it"
    )
