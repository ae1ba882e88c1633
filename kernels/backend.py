"""The attention backend interface between the engine and the kernels, and its torch implementation.

Two real implementations exist — torch (CPU, and the reference) and Triton (CUDA) — so the
engine talks to an `AttentionBackend` and never to either directly; `kernels.platform` picks one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import ModuleType

import torch

from kernels import torch_reference as ref
from kernels.metadata import AttentionMetadata
from kernels.window import kernel_window

# Cache element dtypes the C++ kernels read (the quantized ones with their scales).
NATIVE_KV = (torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn)
# Activation dtypes the C++ attention and cache write take (bf16 ones are widened to fp32 inside).
NATIVE_ATTENTION = (torch.float32, torch.bfloat16)


class AttentionBackend(ABC):
    """Cache writes, attention over the paged cache, and the small fused ops of a decoder layer."""

    name: str

    @abstractmethod
    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> None:
        """Store K/V rows at their slots; with scale caches (a quantized cache) quantize them on the way."""

    @abstractmethod
    def attention(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        """Attention over the paged cache; a quantized cache's rows are dequantized inside the kernel.

        `window`: a sliding window (`kernels.window`: the query at position p sees keys p - window < j
        <= p), None for full causal attention. Block-table entries of blocks below every query's
        window of a sequence may be garbage; they are never read.
        """

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ref.rms_norm(x, weight, eps, residual)

    def apply_rope(
        self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ref.apply_rope(query, key, cos, sin)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return ref.silu_and_mul(gate_up)


class TorchBackend(AttentionBackend):
    """The CPU path: the C++ kernels (`kernels.cpu_extension`) when they are built and the tensors
    are fp32 or bf16 on the CPU, else the torch reference (batched gather for decode-only attention,
    one sequence at a time otherwise)."""

    name = "torch"

    def __init__(self, extension: ModuleType | None) -> None:
        """`extension`: the C++ CPU kernels (`kernels.cpu_extension.load()`), or None for torch only."""
        self._extension = extension

    def _native(self, *tensors: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
        return self._extension is not None and all(
            t.device.type == "cpu" and t.dtype in dtypes for t in tensors
        )

    def _native_cache(self, k_cache: torch.Tensor, *activations: torch.Tensor) -> bool:
        """fp32 or bf16 activations over a cache the C++ kernels read: fp32, bf16, or int8/fp8 with scales."""
        return (
            self._native(*activations, dtypes=NATIVE_ATTENTION)
            and k_cache.device.type == "cpu"
            and k_cache.dtype in NATIVE_KV
        )

    def write_kv_cache(
        self, key, value, k_cache, v_cache, slot_mapping, k_scales=None, v_scales=None
    ) -> None:
        if self._native_cache(k_cache, key, value):
            self._extension.write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scales, v_scales)
        else:
            ref.write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scales, v_scales)

    def attention(
        self, query, k_cache, v_cache, meta, scale, k_scales=None, v_scales=None, window=None
    ) -> torch.Tensor:
        if self._native_cache(k_cache, query):
            tables, lens, starts = meta.block_tables, meta.seq_lens, meta.query_start_loc
            scales = (k_scales, v_scales)
            return self._extension.paged_attention(
                query, k_cache, v_cache, tables, lens, starts, scale, *scales, kernel_window(window)
            )
        if meta.is_decode_only:
            tables, lens = meta.block_tables, meta.seq_lens
            return ref.paged_decode_attention(
                query, k_cache, v_cache, tables, lens, scale, k_scales, v_scales, window
            )
        return ref.paged_attention(query, k_cache, v_cache, meta, scale, k_scales, v_scales, window)

    def rms_norm(self, x, weight, eps, residual=None):
        rows = (x, weight) if residual is None else (x, weight, residual)
        if self._native(*rows):
            return self._extension.rms_norm(x, weight, eps, residual)
        if self._native(*rows, dtypes=(torch.bfloat16,)):
            return self._extension.rms_norm_bf16(x, weight, eps, residual)
        return ref.rms_norm(x, weight, eps, residual)

    def apply_rope(self, query, key, cos, sin):
        if self._native(query, key, cos):
            return self._extension.apply_rope(query, key, cos, sin)
        if self._native(query, key, cos, sin, dtypes=(torch.bfloat16,)):
            return self._extension.apply_rope_bf16(query, key, cos, sin)
        return ref.apply_rope(query, key, cos, sin)

    def silu_and_mul(self, gate_up):
        if self._native(gate_up):
            return self._extension.silu_and_mul(gate_up)
        if self._native(gate_up, dtypes=(torch.bfloat16,)):
            return self._extension.silu_and_mul_bf16(gate_up)
        return ref.silu_and_mul(gate_up)
