"""Every decoder layer of a decode-only fp32 CPU step as one C++ call (the extension's `decode_layers`).

At batch 1 a layer of SmolLM2-135M streams ~14 MB of weights in a fraction of a millisecond, and the
per-op path adds ~10 module calls and ~40 small aten ops per layer on top (views, splits, casts, a host
sync in the cache write, allocations) while holding the GIL, which the server's event loop needs to
stream the previous token. The stack runs the same C++ kernels in the same order, so it computes
what the per-op path computes, with the GIL released from the first layer to the last.

It takes a step only when the per-op path would run those kernels anyway: fp32 on the CPU (over an
fp32, int8 or fp8 e4m3 KV cache), every token a decode, at most `GEMV_MAX_ROWS` tokens (beyond that
oneDNN's linears win and the per-op path takes the step). Prefill chunks, other dtypes and GPUs keep
the per-op path, which stays the reference.
`TANDEM_CPU_DECODE_STACK=0` turns the stack off.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

import torch
from torch import nn

from engine.kv_cache import KVCache
from kernels import cpu_extension
from kernels.cpu_linear import GEMV_MAX_ROWS
from kernels.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

DISABLE_ENV = "TANDEM_CPU_DECODE_STACK"


class CpuDecodeStack:
    """The decoder layers of a model, by reference to its own weights (nothing is copied)."""

    def __init__(self, layers: nn.ModuleList, extension: ModuleType) -> None:
        self._extension = extension
        first = layers[0].self_attn
        self._num_heads = first.num_heads
        self._scale = first.scale
        self._eps = layers[0].input_layernorm.eps
        self._layers = [self._weights_of(layer) for layer in layers]

    def _weights_of(self, layer: nn.Module) -> object:
        attn, mlp = layer.self_attn, layer.mlp

        def plain(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.detach()

        return self._extension.DecoderLayerWeights(
            input_norm=plain(layer.input_layernorm.weight),
            qkv=plain(attn.qkv_proj.weight),
            qkv_bias=plain(attn.qkv_proj.bias),
            o=plain(attn.o_proj.weight),
            o_bias=plain(attn.o_proj.bias),
            post_norm=plain(layer.post_attention_layernorm.weight),
            gate_up=plain(mlp.gate_up_proj.weight),
            gate_up_bias=plain(mlp.gate_up_proj.bias),
            down=plain(mlp.down_proj.weight),
            down_bias=plain(mlp.down_proj.bias),
        )

    @staticmethod
    def accepts(hidden: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether the stack runs this step: a few decode tokens (dtype and device were checked once)."""
        return hidden.shape[0] <= GEMV_MAX_ROWS and meta.is_decode_only

    def __call__(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's output and residual, before the final norm (what the layer loop returns)."""
        return self._extension.decode_layers(
            hidden,
            self._layers,
            kv_cache.k,
            kv_cache.v,
            *cos_sin,
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self._num_heads,
            self._eps,
            self._scale,
            kv_cache.k_scales,
            kv_cache.v_scales,
            kv_cache.rotation,
        )


def build(layers: nn.ModuleList) -> CpuDecodeStack | None:
    """A stack over `layers` when they are fp32 on the CPU and the extension is built, else None."""
    if os.environ.get(DISABLE_ENV, "1") == "0" or len(layers) == 0:
        return None
    weight = layers[0].self_attn.qkv_proj.weight
    if weight is None or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    extension = cpu_extension.load()
    if extension is None:
        return None
    logger.info("decode-only steps run the C++ decoder stack", extra={"layers": len(layers)})
    return CpuDecodeStack(layers, extension)
