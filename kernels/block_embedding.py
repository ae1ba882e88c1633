"""The token embedding over GGUF blocks as stored (any type of `kernels.gguf_blocks`): a lookup
dequantizes only the rows it reads.

An 8 B Llama's embedding is 4096 x 49,152 to 128,256 rows (Gemma 3's 262,144): dequantized once into fp32
it holds 0.8 to 2.1 GB in every process that loads it, four to eight times its blocks' bytes, and a copy
the tiers of `tandem up` cannot share. Kept as a view of the mapped file (`BlockWeight`), each step reads
the few rows of its tokens and the pages are shared. When the LM head is tied to it, the head is a
`BlockLinear` over the very same blocks (`engine.models.decoder.CausalLM`), so the matrix is held once.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.gguf_blocks import BlockWeight, dequantize


class BlockEmbedding(nn.Module):
    """`nn.Embedding` at inference over block-quantized rows; lookups return the model's dtype."""

    def __init__(self, weight: BlockWeight, dtype: torch.dtype) -> None:
        super().__init__()
        if weight.out_order is not None:
            raise ValueError("an embedding's rows are stored in token order; got a row permutation")
        self.num_embeddings, self.embedding_dim = weight.shape
        self.blocks = weight.blocks
        self.kind = weight.kind
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize(self.blocks.index_select(0, input_ids.reshape(-1)), self.kind, self.embedding_dim)
        return rows.to(self.dtype).reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind.lower()}, dtype={self.dtype}"
