"""The model registry: which module builds the forward pass of each Hugging Face `model_type`.

Every family is a small module under this package stating only how its decoder differs from the
shared skeleton (`engine.models.decoder`); this table names them. It is kept free of torch modules so
that `engine.config` can refuse an unknown `model_type` at start, from a process that never builds a
model (the decode front door reads configs too), without importing any family.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import ModelConfig
    from engine.models.decoder import CausalLM
    from kernels.backend import AttentionBackend

# model_type -> the module under `engine.models` whose `MODEL` class runs it.
FAMILIES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "phi3": "phi3",
    "mixtral": "mixtral",
    "qwen3_moe": "qwen3_moe",
}


def model_class(model_type: str) -> type[CausalLM]:
    """The `CausalLM` subclass of the family that runs `model_type` (a KeyError for an unknown one:
    `ModelConfig.from_hf` has refused those already)."""
    return importlib.import_module(f"engine.models.{FAMILIES[model_type]}").MODEL


def build_model(config: ModelConfig, backend: AttentionBackend) -> CausalLM:
    """The family's model for `config`, with its attention and fused ops on `backend` (weights not loaded)."""
    return model_class(config.model_type)(config, backend)
