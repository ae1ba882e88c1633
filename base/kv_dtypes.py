"""The KV cache's element dtypes: what `--kv-cache-dtype` names, which of them are quantized, and what a
token of each costs.

Pure data over torch dtypes, below the kernels that quantize (`kernels.kv_quant`), the engine that sizes
its cache (`engine.config`), the wire that ships it (`kv_transfer`) and the decode front door that knows
the cache only by its size (`engine.model_facts`), so the last can load none of the others.
"""

from __future__ import annotations

import torch

from base.errors import ConfigError

SCALE_DTYPE = torch.float32
# The largest stored magnitude of each quantized element dtype.
QUANT_MAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
# `--kv-cache-dtype` values other than `auto` (the model's dtype), and the element dtype they store.
KV_CACHE_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
KV_CACHE_DTYPE_CHOICES = ("auto", *KV_CACHE_DTYPES)


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of `dtype` carries scales beside its elements."""
    return dtype in QUANT_MAX


def quant_max(dtype: torch.dtype) -> float:
    """The largest magnitude a quantized element of `dtype` stores."""
    return QUANT_MAX[dtype]


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache element dtype `--kv-cache-dtype name` means for a model running in `model_dtype`."""
    if name == "auto":
        return model_dtype
    try:
        return KV_CACHE_DTYPES[name]
    except KeyError:
        raise ConfigError(
            f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}, not {name!r}"
        ) from None


def kv_cache_dtype_flag(dtype: torch.dtype) -> str:
    """The `--kv-cache-dtype` value that stores `dtype` (for messages): `int8`, `fp8_e4m3` or `auto`."""
    for name, stored in KV_CACHE_DTYPES.items():
        if stored == dtype:
            return name
    return "auto"


def kv_bytes_per_token_head(head_dim: int, dtype: torch.dtype) -> int:
    """Cache bytes one token's K (or V) takes in one KV head of one layer, its scale included."""
    element = torch.empty((), dtype=dtype).element_size()
    scale = torch.empty((), dtype=SCALE_DTYPE).element_size() if is_quantized(dtype) else 0
    return head_dim * element + scale
