"""Every decoder layer of a decode-only fp32 CPU step as one C++ call (the extension's `decode_layers`),
over fp32, int8 (`kernels.int8_linear`) or GGUF Q8_0 (`kernels.block_linear`, exact or w8a8) linear weights.

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
`int8_linear.GEMV_MAX_ROWS`), Q8_0 weights on their GEMV (a `BlockLinear` all of whose segments are
Q8_0: exact up to `block_linear.GEMV_MAX_ROWS` rows, past which the per-op path runs the module; w8a8 at
any rows; `takes_linear` says which linears the stack computes). A
Q8_0 linear goes in as its segments, each the module's view of the mapped GGUF, with the output column
of every stored row (`_q8_0_weights`). At a batch of 128 on a small model
the per-op path's Python was nearly a fifth of the forward (bench/README.md, "CPU kernels"). Longer
prefill chunks, other dtypes and GPUs keep the per-op path, which stays the reference.

A step whose rows all run on the GEMVs (single-stream decode, a few streams, a draft's verification) runs
the whole stack in one parallel region (`decode_region.cpp`): the threads share each
GEMV's rows and the attention's heads and meet at barriers, where the per-op kernels open five regions a
layer and leave the small ops between them to one thread. It gives the same values, bit for bit.

Each family's layer is described to C++ by what it computes, not by its family
(`DecoderLayerWeights`): which norm module plays each part (a `LayerNorms` the family declares: Llama's two,
Gemma 3's four), the q/k norms over each head (Qwen3, Gemma 3), the activation (SiLU, GELU-tanh), the
attention's scale, the features RoPE rotates (Phi-4-mini's partial rotary), the window, the RoPE table (Gemma
3's local and global layers have their own) and the KV group, whose block tables and slot mapping the layer
reads (`engine.kv_layout`: Gemma 3's sliding and full layers keep separate ones).
`TANDEM_CPU_DECODE_STACK=0` turns the stack off.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import torch
from torch import nn

from kernels import block_linear, cpu_linear, int8_linear
from kernels.block_linear import BlockLinear
from kernels.cpu_linear import CpuLinear
from kernels.int8_linear import Int8Linear
from kernels.metadata import AttentionMetadata
from kernels.window import kernel_window

# Longest query of one sequence the stack takes: a decode token and its draft (`engine.speculation`).
MAX_QUERY_LEN = 16
# The gated MLP activations (`ModelConfig.hidden_act`) the stack computes, by the name its kernels give them.
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}

CosSin = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class LayerNorms:
    """Which norm module of a family's decoder layer (by attribute name) plays each part the stack computes.

    `input` norms the residual stream into the attention; `mlp` adds the attention's output to the stream
    and norms the MLP's input; `attn_out` and `mlp_out`, where the layer has them (Gemma's sandwich), norm
    the attention's and the MLP's outputs before their residual adds. Each norm module gives the factor
    its kernel multiplies by (`kernel_weight()`: `weight`, or Gemma's `1 + weight`) and its `eps`.
    """

    input: str
    mlp: str
    attn_out: str | None = None
    mlp_out: str | None = None


def takes_linear(linear: nn.Module) -> bool:
    """Whether the stack computes `linear`: any but a GGUF layer holding blocks of a type other than Q8_0,
    which the stack has no kernel for (the per-op path runs it)."""
    return not isinstance(linear, BlockLinear) or linear.kinds == {"Q8_0"}


def _row_limit(linear: nn.Module) -> int | None:
    """Most rows the stack can run `linear` on as its module does (None: any): past the GEMV, an int8
    linear has the int8 GEMM, an fp32 `CpuLinear` oneDNN and a w8a8 Q8_0 one its own kernel; an exact
    Q8_0 one and a plain fp32 one only their GEMV."""
    if isinstance(linear, BlockLinear):
        return None if linear.w8a8 else block_linear.GEMV_MAX_ROWS
    return None if isinstance(linear, (Int8Linear, CpuLinear)) else cpu_linear.GEMV_MAX_ROWS


def _q8_0_weights(linear: BlockLinear, extension: ModuleType) -> object:
    """The extension's view of a Q8_0 linear: its segments' blocks as they are (views of the mapped file)
    and, for each stored row, the output column the module puts it in (its segment's offset plus, for
    llama.cpp's permuted q/k rows, the inverse of the segment's `out_order`). The stack computes stored
    rows in order, streaming each segment front to back, and writes each to its column: what the module
    computes, with no weight copied or read out of order."""
    columns = []
    for offset, weight in linear.segments:
        rows = weight.blocks.shape[0]
        local = torch.arange(rows)
        if weight.out_order is not None:
            local = torch.empty_like(local).index_copy_(0, weight.out_order.cpu(), torch.arange(rows))
        columns.append(offset + local)
    blocks = [weight.blocks for _, weight in linear.segments]
    return extension.Q8_0Weights(blocks, torch.cat(columns), linear.w8a8)


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
    """The decoder layers of a model, by reference to its own weights (nothing is copied but Gemma's
    `1 + weight` norm factors, which its norms keep too)."""

    def __init__(
        self,
        layers: nn.ModuleList,
        extension: ModuleType,
        norms: LayerNorms,
        windows: Sequence[int | None] | None = None,
        rope_keys: Sequence[Hashable] | None = None,
        rotary_dims: Sequence[int] | None = None,
    ) -> None:
        """`norms`: the family's norm arrangement; `windows`: each layer's sliding window (None: full
        attention), as `ModelConfig.layer_windows` gives them; `rope_keys`: the key of the cos/sin table each
        layer's RoPE reads (`CausalLM.layer_rope`), all None for a model with one; `rotary_dims`: the
        features each layer's RoPE rotates, the head size where None."""
        for name, values in (("windows", windows), ("rope_keys", rope_keys), ("rotary_dims", rotary_dims)):
            if values and len(values) != len(layers):
                raise ValueError(f"{len(values)} layer {name} for {len(layers)} layers")
        self._extension = extension
        self._norms = norms
        first = layers[0].self_attn
        self._num_heads = first.num_heads
        self._eps = getattr(layers[0], norms.input).eps
        windows = windows or (None,) * len(layers)
        rope_keys = rope_keys or (None,) * len(layers)
        # The distinct tables in first-use order; each layer reads its own by index.
        self._rope_keys = list(dict.fromkeys(rope_keys))
        rotary_dims = rotary_dims or (first.head_dim,) * len(layers)
        self._layers = [
            self._weights_of(layer, windows[i], self._rope_keys.index(rope_keys[i]), rotary_dims[i])
            for i, layer in enumerate(layers)
        ]
        self._num_groups = 1 + max(weights.kv_group for weights in self._layers)
        first_linears = (first.qkv_proj, first.o_proj, layers[0].mlp.gate_up_proj, layers[0].mlp.down_proj)
        limits = [limit for limit in map(_row_limit, first_linears) if limit is not None]
        self._max_rows = min(limits) if limits else None

    def _norm_weight(self, module: nn.Module | None) -> torch.Tensor | None:
        """The factor `module`'s RMSNorm kernel multiplies by; one eps serves every norm of the stack."""
        if module is None:
            return None
        if module.eps != self._eps:
            raise ValueError(f"a norm's eps {module.eps} differs from the stack's {self._eps}")
        return module.kernel_weight()

    def _weights_of(self, layer: nn.Module, window: int | None, rope: int, rotary_dim: int) -> object:
        attn, mlp, norms = layer.self_attn, layer.mlp, self._norms
        linears = {"qkv": attn.qkv_proj, "o": attn.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}
        parts = {
            "input_norm": norms.input,
            "mlp_norm": norms.mlp,
            "attn_out_norm": norms.attn_out,
            "mlp_out_norm": norms.mlp_out,
        }
        weights: dict[str, torch.Tensor | None] = {
            part: self._norm_weight(getattr(layer, name) if name else None) for part, name in parts.items()
        }
        weights["q_norm"] = self._norm_weight(attn.q_norm)
        weights["k_norm"] = self._norm_weight(attn.k_norm)
        for name, linear in linears.items():
            bias = linear.bias
            weights[f"{name}_bias"] = None if bias is None else bias.detach()
            if isinstance(linear, BlockLinear):
                weights[name] = torch.empty(linear.out_features, linear.in_features, device="meta")
                weights[f"{name}_q8_0"] = _q8_0_weights(linear, self._extension)
            elif isinstance(linear, Int8Linear):
                weights[name], weights[f"{name}_scale"] = linear.qweight, linear.scale
            elif isinstance(linear, CpuLinear):
                weights[name], weights[f"{name}_blocked"] = linear.weight, linear.blocked_weight
            else:
                weights[name] = linear.weight.detach()
        return self._extension.DecoderLayerWeights(
            **weights,
            activation=ACTIVATIONS[mlp.activation],
            scale=attn.scale,
            rotary_dim=rotary_dim,
            window=kernel_window(window),
            kv_group=attn.kv_group,
            rope=rope,
        )

    def accepts(self, hidden: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether the stack runs this step: decode tokens and drafts only, few enough for fp32 weights
        (dtype and device were checked once)."""
        few = self._max_rows is None or hidden.shape[0] <= self._max_rows
        return few and meta.max_query_len <= MAX_QUERY_LEN

    def __call__(
        self,
        hidden: torch.Tensor,
        tables: Mapping[Hashable, CosSin],
        kv_cache: PagedKVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's output and residual, before the final norm (what the layer loop returns);
        `tables`: the step's cos/sin by RoPE key, as the model computed them for its layers."""
        groups = [meta.for_group(group) for group in range(self._num_groups)]
        return self._extension.decode_layers(
            hidden,
            self._layers,
            kv_cache.k,
            kv_cache.v,
            [tables[key][0] for key in self._rope_keys],
            [tables[key][1] for key in self._rope_keys],
            [group.slot_mapping for group in groups],
            [group.block_tables for group in groups],
            meta.seq_lens,
            meta.query_start_loc,
            self._num_heads,
            self._eps,
            kv_cache.k_scales,
            kv_cache.v_scales,
            kv_cache.rotation,
            cpu_linear.GEMV_MAX_ROWS,
            int8_linear.GEMV_MAX_ROWS,
        )
