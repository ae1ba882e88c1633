"""Every decoder layer of a decode-only fp32 CPU step as one C++ call (the extension's `decode_layers`),
over fp32 or int8 (`kernels.int8_linear`) linear weights.

At batch 1 a layer of SmolLM2-135M streams ~14 MB of weights in a fraction of a millisecond, and the
per-op path adds ~10 module calls and ~40 small aten ops per layer on top (views, splits, casts, a host
sync in the cache write, allocations) while holding the GIL, which the server's event loop needs to
stream the previous token. The stack runs the same C++ kernels in the same order, so it computes
what the per-op path computes, with the GIL released from the first layer to the last.

It takes a step only when the per-op path would run those kernels anyway: fp32 on the CPU (over an
fp32, int8 or fp8 e4m3 KV cache) and every sequence's query a decode token or a speculative draft's
verification (at most `MAX_QUERY_LEN` tokens; the attention kernel is the same for both). Each linear
runs by row count as its module does: fp32 weights on the GEMV up to `cpu_linear.GEMV_MAX_ROWS` rows
and on oneDNN over the blocked weight beyond (`CpuLinear`; without oneDNN linears the stack takes only
steps the GEMV serves), int8 weights on the int8 GEMV or GEMM (`Int8Linear`,
`int8_linear.GEMV_MAX_ROWS`). At a batch of 128 on a small model the per-op path's Python was nearly
a fifth of the forward (bench/README.md, "CPU kernels"). Longer prefill chunks, other dtypes and GPUs
keep the per-op path, which stays the reference.

A step whose rows all run on the GEMVs (single-stream decode, a few streams, a draft's verification) runs
the whole stack in one parallel region (`decode_region.cpp`): the threads share each
GEMV's rows and the attention's heads and meet at barriers, where the per-op kernels open five regions a
layer and leave the small ops between them to one thread. It gives the same values, bit for bit.

Every layer reads the step's one block table, so the stack serves a model whose layers share one KV
group (`engine.kv_layout`); each layer may still have its own sliding window (Mistral's on every layer),
which its attention applies. A model with several KV groups keeps the per-op path.
`TANDEM_CPU_DECODE_STACK=0` turns the stack off.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Protocol

import torch
from torch import nn

from kernels import cpu_linear, int8_linear
from kernels.cpu_linear import CpuLinear
from kernels.int8_linear import Int8Linear
from kernels.metadata import AttentionMetadata
from kernels.window import kernel_window

# Longest query of one sequence the stack takes: a decode token and its draft (`engine.speculation`).
MAX_QUERY_LEN = 16


class PagedKVCache(Protocol):
    """What the stack reads of the engine's paged KV cache (`engine.kv_cache.KVCache` has it): per layer,
    K and V, their scales when quantized (empty lists otherwise), and the quantized keys' rotation.

    Kernels sit below the engine and may not import it, so the stack names only the tensors it passes on.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    k_scales: list[torch.Tensor]
    v_scales: list[torch.Tensor]
    rotation: torch.Tensor | None


class CpuDecodeStack:
    """The decoder layers of a model, by reference to its own weights (nothing is copied)."""

    def __init__(
        self, layers: nn.ModuleList, extension: ModuleType, windows: Sequence[int | None] | None = None
    ) -> None:
        """`windows`: each layer's sliding window (None: full attention), as `ModelConfig.layer_windows`
        gives them; None or empty for a model without windows."""
        if windows and len(windows) != len(layers):
            raise ValueError(f"{len(windows)} layer windows for {len(layers)} layers")
        self._extension = extension
        first = layers[0].self_attn
        self._num_heads = first.num_heads
        self._scale = first.scale
        self._eps = layers[0].input_layernorm.eps
        windows = windows or (None,) * len(layers)
        self._layers = [self._weights_of(layer, windows[i]) for i, layer in enumerate(layers)]
        # Any row count when every linear has a kernel past the GEMV (int8 GEMM, oneDNN); else the GEMV's.
        large = isinstance(layers[0].self_attn.qkv_proj, (Int8Linear, CpuLinear))
        self._max_rows = None if large else cpu_linear.GEMV_MAX_ROWS

    def _weights_of(self, layer: nn.Module, window: int | None) -> object:
        attn, mlp = layer.self_attn, layer.mlp
        linears = {"qkv": attn.qkv_proj, "o": attn.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}
        weights: dict[str, torch.Tensor | None] = {
            "input_norm": layer.input_layernorm.weight.detach(),
            "post_norm": layer.post_attention_layernorm.weight.detach(),
        }
        for name, linear in linears.items():
            bias = linear.bias
            weights[f"{name}_bias"] = None if bias is None else bias.detach()
            if isinstance(linear, Int8Linear):
                weights[name], weights[f"{name}_scale"] = linear.qweight, linear.scale
            elif isinstance(linear, CpuLinear):
                weights[name], weights[f"{name}_blocked"] = linear.weight, linear.blocked_weight
            else:
                weights[name] = linear.weight.detach()
        return self._extension.DecoderLayerWeights(**weights, window=kernel_window(window))

    def accepts(self, hidden: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether the stack runs this step: decode tokens and drafts only, few enough for fp32 weights
        (dtype and device were checked once)."""
        few = self._max_rows is None or hidden.shape[0] <= self._max_rows
        return few and meta.max_query_len <= MAX_QUERY_LEN

    def __call__(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: PagedKVCache,
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
            cpu_linear.GEMV_MAX_ROWS,
            int8_linear.GEMV_MAX_ROWS,
        )
