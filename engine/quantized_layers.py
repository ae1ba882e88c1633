"""The modules each weight quantization method (`engine.quantization`) builds its layers as, and so the
kernels that run them.

A method's linear module replaces a linear layer, of its shape, device and bias, with a
`load_weight_rows(offset, weight)` that quantizes checkpoint rows into it, given the C++ CPU kernels (or
None); its forward picks the kernel. Its embedding table replaces the token embedding, given the
embedding and, when it is tied to the LM head, the head's quantized module whose rows it then reads.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from torch import nn

from engine.quantization import NONE
from kernels.int8_embedding import Int8Embedding
from kernels.int8_linear import Int8Linear
from kernels.w8a8_linear import W8A8Linear

LinearModule = Callable[[nn.Linear, ModuleType | None], nn.Module]
EmbeddingModule = Callable[[nn.Embedding, nn.Module | None], nn.Module]

# method name -> (linear module, embedding table); the keys are `engine.quantization.METHODS`'.
LAYERS: dict[str, tuple[LinearModule, EmbeddingModule]] = {
    "int8": (Int8Linear.empty_like, Int8Embedding.empty_like),
    # Activations are quantized before every linear and the LM head; the embedding lookup is int8's.
    "w8a8_int8": (W8A8Linear.empty_like, Int8Embedding.empty_like),
}


def linear_module(name: str) -> LinearModule | None:
    """The empty module `name`'s method builds each decoder linear as; None for full-precision weights.
    The engine's `kernels.platform.Platform` swaps it in before loading, so `CausalLM.load_weights` then
    quantizes into it."""
    return None if name == NONE else LAYERS[name][0]


def embedding_module(name: str) -> EmbeddingModule | None:
    """The empty table `name`'s method builds the token embedding as; None for full-precision weights.
    `kernels.platform.Platform.quantize_embeddings` swaps it in."""
    return None if name == NONE else LAYERS[name][1]
