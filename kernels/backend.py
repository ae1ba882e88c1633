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
    """The CPU path: batched decode in one call, prefill chunks one sequence at a time.

    Decode rows go to the C++ kernel (`kernels.cpu_extension`) when it is built and the cache is
    fp32 on the CPU, else to the torch reference, which gathers blocks into a padded copy.
    """

    name = "torch"

    def __init__(self, use_cpu_extension: bool = True) -> None:
        self._extension = cpu_extension.load() if use_cpu_extension else None

    def _decode(self, query, k_cache, v_cache, block_tables, seq_lens, scale) -> torch.Tensor:
        if (
            self._extension is not None
            and k_cache.device.type == "cpu"
            and k_cache.dtype == query.dtype == torch.float32
        ):
            return self._extension.paged_decode_attention(
                query.contiguous(), k_cache, v_cache, block_tables, seq_lens, scale
            )
        return ref.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale)

    def write_kv_cache(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        ref.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)

    def attention(self, query, k_cache, v_cache, meta, scale) -> torch.Tensor:
        if meta.is_decode_only:
            return self._decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
        decode_seqs = [i for i, q_len in enumerate(meta.query_lens_host) if q_len == 1]
        if len(decode_seqs) < 2:
            return ref.paged_attention(query, k_cache, v_cache, meta, scale)
        return self._mixed_attention(query, k_cache, v_cache, meta, scale, decode_seqs)

    def _mixed_attention(self, query, k_cache, v_cache, meta, scale, decode_seqs: list[int]) -> torch.Tensor:
        """Decode rows of a mixed batch in one batched gather, prefill chunks one by one."""
        out = torch.empty_like(query)
        starts = [0]
        for q_len in meta.query_lens_host:
            starts.append(starts[-1] + q_len)
        decode_rows = torch.tensor([starts[i] for i in decode_seqs])
        seq_index = torch.tensor(decode_seqs)
        out[decode_rows] = self._decode(
            query[decode_rows],
            k_cache,
            v_cache,
            meta.block_tables[seq_index],
            meta.seq_lens[seq_index],
            scale,
        )
        is_decode = set(decode_seqs)
        for i, seq_len in enumerate(meta.seq_lens_host):
            if i in is_decode:
                continue
            rows = slice(starts[i], starts[i + 1])
            key = ref.gather_context(k_cache, meta.block_tables[i], seq_len)
            value = ref.gather_context(v_cache, meta.block_tables[i], seq_len)
            out[rows] = ref.attend_one_sequence(query[rows], key, value, scale)
        return out


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
    backend = _make_triton_backend() if choice == "triton" else TorchBackend()
    logger.info("attention backend selected", extra={"backend": backend.name, "device": str(device)})
    return backend
