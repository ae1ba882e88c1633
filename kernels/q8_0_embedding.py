"""The token embedding over GGUF Q8_0 blocks as stored: a lookup dequantizes only the rows it reads.

An 8 B Llama's embedding is 4096 x 49,152 to 128,256 rows: dequantized once into fp32 it holds 0.8 to
2.1 GB in every process that loads it, four times its Q8_0 bytes, and a copy the tiers of `tandem up`
cannot share. Kept as a view of the mapped file (`kernels.q8_0_linear.Q8_0Weight`), each step reads the
few rows of its tokens and the pages are shared. When the LM head is tied to it, the head is a
`Q8_0Linear` over the very same blocks (`engine.models.decoder.CausalLM`), so the matrix is held once.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.q8_0_linear import Q8_0Weight, dequantize_q8_0


class Q8_0Embedding(nn.Module):
    """`nn.Embedding` at inference over Q8_0 rows; lookups return the model's dtype."""

    def __init__(self, weight: Q8_0Weight, dtype: torch.dtype) -> None:
        super().__init__()
        if weight.out_order is not None:
            raise ValueError("an embedding's Q8_0 rows are stored in token order; got a row permutation")
        self.num_embeddings, self.embedding_dim = weight.shape
        self.blocks = weight.blocks
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize_q8_0(self.blocks.index_select(0, input_ids.reshape(-1)), self.embedding_dim)
        return rows.to(self.dtype).reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, q8_0, dtype={self.dtype}"
