"""The model registry: which module builds the forward pass of each Hugging Face `model_type`.

Every family is a small module under this package stating only how its decoder differs from the
shared skeleton (`engine.models.decoder`); `engine.families.FAMILIES` names them, and this package
builds the one a config asks for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from engine.families import FAMILIES

if TYPE_CHECKING:
    from engine.config import ModelConfig
    from engine.models.decoder import CausalLM
    from kernels.backend import AttentionBackend


def model_class(model_type: str) -> type[CausalLM]:
    """The `CausalLM` subclass of the family that runs `model_type` (a KeyError for an unknown one:
    `ModelConfig.from_hf` has refused those already)."""
    return importlib.import_module(f"engine.models.{FAMILIES[model_type]}").MODEL


def build_model(config: ModelConfig, backend: AttentionBackend) -> CausalLM:
    """The family's model for `config`, with its attention and fused ops on `backend` (weights not loaded)."""
    return model_class(config.model_type)(config, backend)
