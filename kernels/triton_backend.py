"""The Triton implementation of `AttentionBackend`: the GPU path, and the CPU path under the interpreter.

Decode-only steps go to the split-KV decode kernel; any step with a prefill chunk goes to the
chunked-prefill kernel, whose launch covers the step's single-token decodes as well.
"""

from __future__ import annotations

import torch

from kernels import triton_cache, triton_decode, triton_fused, triton_prefill
from kernels.backend import AttentionBackend
from kernels.metadata import AttentionMetadata
from kernels.triton_common import is_interpreted


class TritonUnavailableError(RuntimeError):
    """Triton kernels were asked for where they cannot run: no CUDA device and no interpreter."""


class TritonBackend(AttentionBackend):
    """Every op of `AttentionBackend` as a Triton kernel."""

    name = "triton"

    def __init__(self) -> None:
        if not torch.cuda.is_available() and not is_interpreted(triton_decode._decode_kernel):
            raise TritonUnavailableError(
                "the triton attention backend needs a CUDA device, or TRITON_INTERPRET=1 set before "
                "triton is imported; use TANDEM_ATTENTION_BACKEND=torch (or auto) on a CPU"
            )

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
        triton_cache.write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scales, v_scales)

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
        if meta.is_decode_only:
            tables, lens = meta.block_tables, meta.seq_lens
            return triton_decode.paged_decode_attention(
                query, k_cache, v_cache, tables, lens, scale, None, k_scales, v_scales, window
            )
        return triton_prefill.paged_prefill_attention(
            query, k_cache, v_cache, meta, scale, None, k_scales, v_scales, window
        )

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return triton_fused.rms_norm(x, weight, eps, residual)

    def apply_rope(
        self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return triton_fused.apply_rope(query, key, cos, sin)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return triton_fused.silu_and_mul(gate_up)
