"""Configuration: what the checkpoint says about the model, and how the engine is sized."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from base.errors import ConfigError, InvalidRequestError, UnsupportedModelError
from engine.kv_layout import KVLayout
from kernels.kv_quant import kv_bytes_per_token_head, resolve_kv_cache_dtype

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")

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

    @property
    def kv_layout(self) -> KVLayout:
        """How the layers' KV is grouped into block tables (`engine.kv_layout`)."""
        return KVLayout.from_layer_windows(self.layer_windows or (None,) * self.num_layers)

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        model_type = hf_config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; tandem runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if getattr(hf_config, "use_sliding_window", False) or (
            model_type == "mistral" and getattr(hf_config, "sliding_window", None)
        ):
            raise UnsupportedModelError("sliding-window attention is not supported")
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {hf_config.hidden_act!r} is not supported (only silu)")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        eos = hf_config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias and model_type == "llama",
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            eos_token_ids=eos_ids,
            hf_config=hf_config,
            layer_windows=layer_windows(hf_config),
        )


def layer_windows(hf_config: Any) -> tuple[int | None, ...]:
    """Each layer's window from a Hugging Face config: its `layer_types` where it has them, else one
    `sliding_window` for every layer (Mistral, Mixtral, Phi-3), else full attention everywhere."""
    window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None)
    if types:
        return tuple(window if kind == "sliding_attention" else None for kind in types)
    return (window,) * hf_config.num_hidden_layers


@dataclass(frozen=True)
class CacheConfig:
    """Size of the paged KV pool: either a block count or a memory budget for all layers' K and V."""

    block_size: int = 16
    num_blocks: int | None = None
    memory_bytes: int = 1 << 30

    def block_bytes(self, model: ModelConfig, dtype: torch.dtype) -> int:
        """Bytes of one block: K and V of every layer slot (`engine.kv_layout`; all layers when the model
        has one attention type), in a cache of `dtype` (a quantized one's scales too)."""
        per_token_head = kv_bytes_per_token_head(model.head_dim, dtype)
        return 2 * model.kv_layout.num_slots * self.block_size * model.num_kv_heads * per_token_head

    def resolve_num_blocks(self, model: ModelConfig, dtype: torch.dtype) -> int:
        """Blocks of a cache of `dtype` (the KV dtype): the count given, or as many as the budget holds."""
        if self.num_blocks is not None:
            return self.num_blocks
        return max(1, self.memory_bytes // self.block_bytes(model, dtype))


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
    attention_backend: str | None = None
    enable_prefix_caching: bool = True
    # Text a request's grammar forces is appended without sampling and computed in the next step's chunk.
    grammar_jump_forward: bool = False
    # Weight quantization of the decoder layers' linears (`engine.quantization`): "none" or a method name.
    quantization: str = "none"

    def __post_init__(self) -> None:
        from engine.quantization import check_supported

        check_supported(self.quantization, self.device, self.dtype)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The element dtype of the KV cache (raises ConfigError for an unknown `kv_cache_dtype`)."""
        return resolve_kv_cache_dtype(self.kv_cache_dtype, self.dtype)
