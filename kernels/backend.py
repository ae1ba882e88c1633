"""The one dispatch point between the engine and the kernels.

Two real implementations exist — torch (CPU, and the reference) and Triton (CUDA) — so the
engine talks to an `AttentionBackend` and never to either directly. `TANDEM_ATTENTION_BACKEND`
(`auto`, `torch`, `triton`) forces a choice; `auto` picks Triton on CUDA and torch elsewhere.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod

import torch

from kernels import cpu_extension
from kernels import torch_reference as ref
from kernels.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

BACKEND_ENV = "TANDEM_ATTENTION_BACKEND"


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
    ) -> None: ...

    @abstractmethod
    def attention(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...

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
    are fp32 on the CPU, else the torch reference (batched gather for decode-only attention, one
    sequence at a time otherwise)."""

    name = "torch"

    def __init__(self, use_cpu_extension: bool = True) -> None:
        self._extension = cpu_extension.load() if use_cpu_extension else None

    def _native(self, *tensors: torch.Tensor) -> bool:
        return self._extension is not None and all(
            t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors
        )

    def write_kv_cache(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        if self._native(key, value, k_cache, v_cache):
            self._extension.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
        else:
            ref.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

    def attention(self, query, k_cache, v_cache, meta, scale) -> torch.Tensor:
        if self._native(query, k_cache, v_cache):
            return self._extension.paged_attention(
                query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale
            )
        if meta.is_decode_only:
            tables, lens = meta.block_tables, meta.seq_lens
            return ref.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale)
        return ref.paged_attention(query, k_cache, v_cache, meta, scale)

    def rms_norm(self, x, weight, eps, residual=None):
        if self._native(x, weight) and (residual is None or self._native(residual)):
            return self._extension.rms_norm(x, weight, eps, residual)
        return ref.rms_norm(x, weight, eps, residual)

    def apply_rope(self, query, key, cos, sin):
        if self._native(query, key, cos):
            return self._extension.apply_rope(query, key, cos, sin)
        return ref.apply_rope(query, key, cos, sin)

    def silu_and_mul(self, gate_up):
        if self._native(gate_up):
            return self._extension.silu_and_mul(gate_up)
        return ref.silu_and_mul(gate_up)


def _make_triton_backend() -> AttentionBackend:
    from kernels.triton_backend import TritonBackend

    return TritonBackend()


def get_backend(device: torch.device, requested: str | None = None) -> AttentionBackend:
    """Pick the backend for `device`, honouring `requested` or the environment override."""
    choice = (requested or os.environ.get(BACKEND_ENV, "auto")).lower()
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"{BACKEND_ENV} must be auto, torch or triton, not {choice!r}")
    if choice == "auto":
        choice = "triton" if device.type == "cuda" else "torch"
    if choice == "triton":
        backend = _make_triton_backend()
    else:
        # The C++ kernels serve only fp32 CPU tensors: on a GPU, building them is a compile for nothing.
        backend = TorchBackend(use_cpu_extension=device.type == "cpu")
    logger.info("attention backend selected", extra={"backend": backend.name, "device": str(device)})
    return backend
