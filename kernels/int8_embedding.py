"""The token embedding as int8 rows with one fp32 scale each, the LM head's format (`kernels.int8_linear`).

Row i of the embedding is row i of the LM head's weight, so the same per-row quantization serves both:
a lookup dequantizes only the rows it reads (`q[i] * scale[i]`, in fp32, then the model's dtype). A model
with tied embeddings builds its table `sharing` the int8 head's buffers: one int8 copy of the matrix,
read by the head every step and indexed by the lookup, and no full-precision copy anywhere. For Gemma 3
270M (262,144 x 640, tied) that is 168 MB where fp32 held 671 MB.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.int8_linear import Int8Linear, quantize_per_channel


class Int8Embedding(nn.Module):
    """`nn.Embedding` at inference over int8 rows and per-row scales, filled by `load_weight_rows`."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        # The dtype the lookup returns: the model's, as the full-precision table it replaces had.
        self.dtype = dtype

    @classmethod
    def empty_like(cls, embedding: nn.Embedding, tied_head: nn.Module | None = None) -> Int8Embedding:
        """An empty table of `embedding`'s shape, device and dtype; with `tied_head` (an `Int8Linear` of
        the same shape), one that reads that head's int8 rows and scales instead of holding its own."""
        weight = embedding.weight
        if tied_head is not None:
            if not isinstance(tied_head, Int8Linear) or tied_head.qweight.shape != weight.shape:
                raise ValueError(f"an int8 embedding of {tuple(weight.shape)} cannot share {tied_head!r}")
            return cls(tied_head.qweight, tied_head.scale, weight.dtype)
        qweight = torch.zeros(weight.shape, dtype=torch.int8, device=weight.device)
        scale = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
        return cls(qweight, scale, weight.dtype)

    @torch.no_grad()
    def load_weight_rows(self, offset: int, weight: torch.Tensor) -> None:
        """Quantize checkpoint rows into rows `offset...` (into the head's buffers when tied)."""
        qweight, scale = quantize_per_channel(weight.to(self.qweight.device))
        self.qweight[offset : offset + qweight.shape[0]] = qweight
        self.scale[offset : offset + qweight.shape[0]] = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)
        rows = self.qweight.index_select(0, flat).float() * self.scale.index_select(0, flat).unsqueeze(1)
        return rows.to(self.dtype).reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, dtype={self.dtype}"
