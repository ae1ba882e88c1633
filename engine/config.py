"""Configuration: what the checkpoint says about the model, and how the engine is sized."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from base.errors import ConfigError, InvalidRequestError, UnsupportedModelError
from base.kv_dtypes import kv_bytes_per_token_head, resolve_kv_cache_dtype
from engine.families import FAMILIES
from engine.kv_layout import KVLayout
from engine.quantization import check_supported
from engine.speculation import SpeculativeConfig

logger = logging.getLogger(__name__)

# The gated MLP activations the decoder computes (`engine.models.decoder.GatedMLP`).
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")
# RoPE variants whose tables are a fixed function of the position; `dynamic` rescales them with the
# sequence length, which a paged cache of already-rotated keys cannot follow.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# Config fields that change attention in ways the kernels do not compute, refused when set.
UNSUPPORTED_WHEN_SET = ("attn_logit_softcapping", "use_bidirectional_attention")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Accept a dtype or its name ('float32', 'bfloat16', 'float16')."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidRequestError(f"dtype must be one of {sorted(DTYPES)}, not {name!r}") from None


SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
    "ti": 2**40,
    "tib": 2**40,
}


def parse_memory_size(text: str) -> int:
    """Bytes in a size such as `2GiB`, `512MiB`, `2G`, `1.5Gi` or `1048576`.

    Decimal units (K, M, G, T, and with a B) are powers of 1000 and binary ones (Ki, KiB, ...) powers
    of 1024, as Kubernetes quantities are, so the Helm chart's values mean the same here.
    """
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in SIZE_UNITS:
        raise ConfigError(f"cannot parse memory size {text!r}; use e.g. 2GiB, 512MiB, 2G or a byte count")
    size = int(float(match.group(1)) * SIZE_UNITS[unit])
    if size <= 0:
        raise ConfigError(f"memory size must be > 0, got {text!r}")
    return size


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts our forward pass needs, read from a Hugging Face config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    hf_config: Any = field(repr=False, compare=False)
    # Each layer's sliding window in tokens (a query attends to the last `window` positions, itself
    # included), None for a layer with full attention.
    layer_windows: tuple[int | None, ...] = ()
    # The gated MLP's activation (`hidden_act`, Gemma's `hidden_activation`): one of SUPPORTED_ACTIVATIONS.
    hidden_act: str = "silu"

    @property
    def kv_layout(self) -> KVLayout:
        """How the layers' KV is grouped into block tables (`engine.kv_layout`)."""
        return KVLayout.from_layer_windows(self.layer_windows or (None,) * self.num_layers)

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """The facts of a Hugging Face config of a supported family (a multimodal checkpoint: its text
        part); what tandem cannot run is refused here, at start, with one line naming the field."""
        model_type = hf_config.model_type
        if model_type not in FAMILIES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; tandem runs {', '.join(sorted(FAMILIES))}"
            )
        hf = hf_config.get_text_config()
        activation_field = "hidden_activation" if getattr(hf, "hidden_activation", None) else "hidden_act"
        activation = getattr(hf, activation_field, None) or "silu"
        if activation not in SUPPORTED_ACTIVATIONS:
            supported = ", ".join(SUPPORTED_ACTIVATIONS)
            raise UnsupportedModelError(
                f"{activation_field} {activation!r} is not supported; tandem runs {supported}"
            )
        for name in UNSUPPORTED_WHEN_SET:
            if getattr(hf, name, None):
                raise UnsupportedModelError(f"{name}={getattr(hf, name)!r} is not supported (only unset)")
        max_positions = hf.max_position_embeddings
        for params in rope_parameter_sets(hf).values():
            rope_type = params.get("rope_type", params.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise UnsupportedModelError(
                    f"rope_parameters rope_type {rope_type!r} is not supported; "
                    f"tandem runs {', '.join(SUPPORTED_ROPE_TYPES)}"
                )
            if rope_type == "longrope":
                max_positions = min(max_positions, _longrope_short_context(hf, params))
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        eos = getattr(hf, "eos_token_id", None)
        eos = getattr(hf_config, "eos_token_id", None) if eos is None else eos
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
        attention_bias = bool(getattr(hf, "attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            eos_token_ids=eos_ids,
            hf_config=hf,
            layer_windows=layer_windows(hf),
            hidden_act=activation,
        )


def rope_parameter_sets(hf_config: Any) -> dict[str | None, Mapping[str, Any]]:
    """The config's RoPE parameters: `{None: params}` for one set for every layer, or one set per layer
    type (`{"full_attention": ..., "sliding_attention": ...}`) where the config nests them so (Gemma 3:
    its local layers rotate with `rope_local_base_freq`, which transformers stores that way)."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    layer_types = set(getattr(hf_config, "layer_types", None) or ())
    if params and all(key in layer_types for key in params):
        return dict(params)
    return {None: params}


def _longrope_short_context(hf_config: Any, params: Mapping[str, Any]) -> int:
    """The longest sequence longrope serves here: its short factors up to the pretraining length.

    Hugging Face switches every position to the long factors once a sequence outgrows that length, so a
    key rotated before the switch would no longer match; the cache keeps rotated keys, so tandem serves
    the short range only (where it matches Hugging Face exactly) and says so once.
    """
    original = params.get("original_max_position_embeddings") or getattr(
        hf_config, "original_max_position_embeddings", hf_config.max_position_embeddings
    )
    if original < hf_config.max_position_embeddings:
        logger.warning(
            "longrope RoPE: serving up to original_max_position_embeddings only",
            extra={
                "original_max_position_embeddings": original,
                "max_position_embeddings": hf_config.max_position_embeddings,
            },
        )
    return original


def layer_windows(hf_config: Any) -> tuple[int | None, ...]:
    """Each layer's sliding window, as the family's Hugging Face code applies it.

    Qwen2/Qwen3 (whose `sliding_window` is None unless `use_sliding_window`, their `layer_types`
    derived from `max_window_layers`) and Gemma 3 slide on the layers `layer_types` marks; Mistral,
    Mixtral and Phi-3 apply `sliding_window` to every layer and ignore any `layer_types`; Llama never
    slides.
    """
    window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None)
    if hf_config.model_type in LAYER_TYPED_WINDOWS and types:
        return tuple(window if kind == "sliding_attention" else None for kind in types)
    if hf_config.model_type in LAYER_TYPED_WINDOWS or hf_config.model_type == "llama":
        return (None,) * hf_config.num_hidden_layers
    return (window,) * hf_config.num_hidden_layers


# Families whose layers slide where `layer_types` says (the others: every layer or none).
LAYER_TYPED_WINDOWS = ("qwen2", "qwen3", "qwen3_moe", "gemma3_text")


@dataclass(frozen=True)
class CacheConfig:
    """Size of the paged KV pool: either a block count or a memory budget for all layers' K and V.

    With `fit_to_sequences` (the flags' default budget) the pool holds no more tokens than its running
    sequences can fill, `max_model_len` x `max_num_seqs`, as llama.cpp's `-c` sizes its cache: a server
    started for 16 sequences of 2,048 tokens does not hold a 2 GiB pool resident.
    """

    block_size: int = 16
    num_blocks: int | None = None
    memory_bytes: int = 1 << 30
    fit_to_sequences: bool = False

    def block_bytes(self, model: ModelConfig, dtype: torch.dtype) -> int:
        """Bytes of one block: K and V of every layer slot (`engine.kv_layout`; all layers when the model
        has one attention type), in a cache of `dtype` (a quantized one's scales too)."""
        per_token_head = kv_bytes_per_token_head(model.head_dim, dtype)
        return 2 * model.kv_layout.num_slots * self.block_size * model.num_kv_heads * per_token_head

    def resolve_num_blocks(
        self, model: ModelConfig, dtype: torch.dtype, sequence_tokens: int | None = None
    ) -> int:
        """Blocks of a cache of `dtype` (the KV dtype): the count given, or as many as the budget holds
        (with `fit_to_sequences`, no more than the running sequences' `sequence_tokens` fill)."""
        if self.num_blocks is not None:
            return self.num_blocks
        blocks = max(1, self.memory_bytes // self.block_bytes(model, dtype))
        if self.fit_to_sequences and sequence_tokens is not None:
            blocks = min(blocks, -(-sequence_tokens // self.block_size))
        return blocks


@dataclass(frozen=True)
class EngineConfig:
    """How one engine instance runs: where, in what precision, and within which limits."""

    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    cache: CacheConfig = field(default_factory=CacheConfig)
    # `--kv-cache-dtype`: auto (the model's dtype), int8 or fp8_e4m3 (quantized, with per-token scales).
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # `--max-num-batched-tokens auto`: the serving tiers fit the per-step token budget to the step cost
    # measured at start (`engine.step_cost`), at most `max_num_batched_tokens`, so that no step of a large
    # model on a small host takes long enough to stall every stream or miss the engine heartbeat. False:
    # `max_num_batched_tokens` is the budget as set.
    fit_token_budget: bool = False
    attention_backend: str | None = None
    enable_prefix_caching: bool = True
    # Text a request's grammar forces is appended without sampling and computed in the next step's chunk.
    grammar_jump_forward: bool = False
    # Weight quantization of the decoder linears, LM head and embedding (`engine.quantization`): "none" or a
    # method name.
    quantization: str = "none"
    # Speculative decoding of the decode tier's steps (`engine.speculation`); the prefill tier ignores it.
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        check_supported(self.quantization, self.device, self.dtype)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The element dtype of the KV cache (raises ConfigError for an unknown `kv_cache_dtype`)."""
        return resolve_kv_cache_dtype(self.kv_cache_dtype, self.dtype)
