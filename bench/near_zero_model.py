"""A model whose forward costs next to nothing, with a real tokenizer: the serving path's test subject.

To see what the server itself spends per token (scheduling, sampling bookkeeping, detokenization,
stream messages), the model must not hide it: three layers of width 64 with random weights cost a
few microseconds of matmul per token, while the real SmolLM2 tokenizer keeps detokenization and
vocabulary-sized work (LM head, sampling) as a real deployment has them. Written on the fly as an
ordinary checkpoint directory, so the server loads it through the same path as any model.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

# The tokenizer files and the eos ids of generation_config.json, copied from the tokenizer's model.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


@dataclass(frozen=True)
class NearZeroModelSpec:
    """Shape of the generated model; `vocab_size` None (or one above the tokenizer's) takes the tokenizer
    model's vocabulary."""

    num_layers: int = 3
    hidden_size: int = 64
    num_heads: int = 2
    num_kv_heads: int = 1
    intermediate_size: int = 128
    vocab_size: int | None = None
    seed: int = 0

    def describe(self) -> dict:
        return asdict(self)


def tokenizer_source(name_or_path: str | None) -> Path:
    """The checkpoint directory whose tokenizer the model borrows: the cached default model when None,
    else a directory with config.json (for the vocabulary size) and tokenizer.json (weights not needed)."""
    from base.errors import ModelNotFoundError
    from engine.model_store import resolve_model

    if name_or_path is None:
        return resolve_model(None)
    directory = Path(name_or_path).expanduser()
    for required in ("config.json", "tokenizer.json"):
        if not (directory / required).is_file():
            raise ModelNotFoundError(f"tokenizer model {directory} has no {required}")
    return directory


def write_near_zero_model(directory: Path, tokenizer_model: Path, spec: NearZeroModelSpec) -> Path:
    """Write a random-weight Llama of `spec` plus `tokenizer_model`'s tokenizer into `directory`.

    `tokenizer_model` is a checkpoint directory (e.g. the cached SmolLM2); its special-token ids and
    generation config come along, so end-of-sequence handling is the real model's.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    source = json.loads((tokenizer_model / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=min(spec.vocab_size or source["vocab_size"], source["vocab_size"]),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=source.get("max_position_embeddings", 2048),
        tie_word_embeddings=True,
        bos_token_id=source.get("bos_token_id"),
        eos_token_id=source.get("eos_token_id"),
        pad_token_id=source.get("pad_token_id"),
    )
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        if (tokenizer_model / name).is_file():
            shutil.copyfile(tokenizer_model / name, directory / name)
    return directory
