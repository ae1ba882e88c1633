"""What a GGUF file says about its model without its weights: whether a file is one, the Hugging Face
config `transformers` maps from its metadata, its chat template, and the bytes that identify it.

Apart from the tensor streaming (`engine.gguf_checkpoint`) so that what only needs the model's facts,
such as the decode front door, never loads the kernels that hold the weights.
"""

from __future__ import annotations

import copy
import functools
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from base.errors import ModelNotFoundError

if TYPE_CHECKING:
    from gguf import GGUFReader
    from transformers import PretrainedConfig

GGUF_MAGIC = b"GGUF"
_VOCABULARY_FIELDS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
)


def is_gguf(path: Path) -> bool:
    """Whether `path` is a GGUF file (by its magic, so a misnamed file is still recognised)."""
    try:
        with Path(path).open("rb") as handle:
            return handle.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False


def gguf_hf_config(path: Path) -> PretrainedConfig:
    """The Hugging Face config `transformers` maps from the file's metadata (no tensor is read).

    transformers parses the whole metadata for it (seconds for a real vocabulary), and a start asks for
    the config several times (the plan, the front door, the engine): it is mapped once per version of
    the file, each caller getting its own copy."""
    try:
        stat = path.stat()
    except OSError as exc:
        raise ModelNotFoundError(f"cannot read the GGUF file {path}: {exc}") from exc
    return copy.deepcopy(_mapped_config(path.resolve(), stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=4)
def _mapped_config(path: Path, size: int, mtime_ns: int) -> PretrainedConfig:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelNotFoundError(f"cannot read a model config from the GGUF metadata of {path}: {exc}") from (
            exc
        )


def gguf_has_chat_template(path: Path) -> bool:
    """Whether the GGUF's metadata holds a chat template (`tokenizer.chat_template`)."""
    return gguf_reader(path).get_field("tokenizer.chat_template") is not None


def gguf_fingerprint(path: Path) -> bytes:
    """The bytes that identify a GGUF's model: its size, metadata and tensor table (names, block types,
    shapes, offsets), everything before the tensor data, which is not read."""
    reader = gguf_reader(path)
    digest = hashlib.sha256(str(path.stat().st_size).encode())
    digest.update(np.asarray(reader.data[: reader.data_offset]).tobytes())
    return digest.digest()


def gguf_reader(path: Path) -> GGUFReader:
    """The file's reader, parsed once per version of the file: parsing the metadata of a real model (a
    49k-entry vocabulary) takes seconds of Python, and a start reads it for the plan, the fingerprint
    and the weights."""
    try:
        stat = path.stat()
    except OSError as exc:
        raise ModelNotFoundError(f"cannot read the GGUF file {path}: {exc}") from exc
    return _parsed(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _parsed(path: Path, size: int, mtime_ns: int) -> GGUFReader:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path, "r")
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"cannot read the GGUF file {path}: {exc}") from exc
    # The vocabulary's parsed fields (a numpy array per token and merge: ~150 MiB for a 49k vocabulary)
    # are transformers' to read when it builds the tokenizer; the kept reader needs none of them.
    for key in [key for key in reader.fields if key.startswith(_VOCABULARY_FIELDS)]:
        del reader.fields[key]
    return reader


def gguf_field(reader: GGUFReader, key: str) -> str:
    field = reader.get_field(key)
    if field is None:
        raise ModelNotFoundError(f"GGUF metadata lacks {key}")
    return str(field.contents())
