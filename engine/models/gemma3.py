"""Gemma 3 (`gemma3_text`, and the text part of a multimodal `gemma3` checkpoint).

How it differs from the Llama layer, each as Hugging Face computes it:
- RMSNorm scales by `1 + weight` (weights are stored as offsets from one), in fp32, cast once;
- four norms per layer: the attention and the MLP outputs are normed before their residual add
  (post-attention, post-feedforward), and the MLP input has its own (pre-feedforward);
- an RMSNorm over each query and key head before RoPE, like Qwen3's but of Gemma's kind;
- attention scaled by `query_pre_attn_scalar ** -0.5`, not by the head size;
- GELU-tanh MLP (`hidden_activation`, read by `engine.config`);
- embeddings times sqrt(hidden_size), the factor rounded to the activation dtype first;
- sliding layers (`layer_types`) with their own RoPE base (`rope_parameters["sliding_attention"]`,
  the checkpoint's `rope_local_base_freq`), which the skeleton picks per layer;
- logits soft-capped by `final_logit_softcapping` where the config sets it (Gemma 3's do not).

The C++ decode stack computes its layers from `SANDWICH_NORMS` and what the skeleton's modules hold (head
norms, GELU-tanh, scale, windows, RoPE tables, KV groups).
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn

from engine.config import ModelConfig
from engine.models.decoder import Attention, CausalLM, CosSin
from kernels.backend import AttentionBackend
from kernels.cpu_decode_stack import LayerNorms

# Prefixes of a multimodal checkpoint's text tensors (transformers 5 names, then 4), and of the rest.
TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.", "language_model.": ""}
OTHER_PREFIXES = (
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "vision_tower.",
    "multi_modal_projector.",
)


@cache
def embed_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """sqrt(hidden_size) as Hugging Face applies it: an fp32 value rounded to the activation dtype (in
    bf16, 55.4256 becomes 55.5), exact as a Python float, so the product rounds as theirs does."""
    return torch.tensor(hidden_size**0.5, dtype=torch.float32, device="cpu").to(dtype).item()


class GemmaRMSNorm(nn.Module):
    """`normed * (1 + weight)` with the residual add fused in front, the product taken in fp32."""

    def __init__(self, size: int, eps: float, backend: AttentionBackend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps
        self.backend = backend
        # `1 + weight`, kept while the weight's storage and version (bumped by every in-place load) stay
        # the same: a decode step of Gemma 3 270M calls 109 norms, and adding per call was a tenth of
        # their cost.
        self._offset: tuple[tuple[int, int], torch.Tensor] | None = None

    def kernel_weight(self) -> torch.Tensor:
        """`1 + weight`: the factor the fused fp32 RMSNorm kernel multiplies by (the C++ decode stack's too,
        which takes it once, after loading)."""
        key = (self.weight.data_ptr(), self.weight._version)
        if self._offset is None or self._offset[0] != key:
            self._offset = (key, 1.0 + self.weight.detach())
        return self._offset[1]

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dtype == torch.float32:
            # In fp32 the backend's `weight * normed` is the same arithmetic, on its fused kernel.
            return self.backend.rms_norm(x, self.kernel_weight(), self.eps, residual)
        if residual is not None:
            x = x + residual
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype), x


# `SandwichDecoderLayer`'s norms as the C++ decode stack reads them.
SANDWICH_NORMS = LayerNorms(
    input="input_layernorm",
    mlp="pre_feedforward_layernorm",
    attn_out="post_attention_layernorm",
    mlp_out="post_feedforward_layernorm",
)


class SandwichDecoderLayer(nn.Module):
    """Gemma's layer: `h += post_attn_norm(attn(input_norm(h)))`, then
    `h += post_ff_norm(mlp(pre_ff_norm(h)))`; the residual adds are fused into the input and
    pre-feedforward norms (and the next layer's input norm), as in `DecoderLayer`."""

    def __init__(self, make_norm, attention: nn.Module, mlp: nn.Module, size: int) -> None:
        super().__init__()
        self.input_layernorm = make_norm(size)
        self.self_attn = attention
        self.post_attention_layernorm = make_norm(size)
        self.pre_feedforward_layernorm = make_norm(size)
        self.mlp = mlp
        self.post_feedforward_layernorm = make_norm(size)

    def forward(self, hidden, residual, cos_sin: CosSin, kv_cache, meta):
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden, _ = self.post_attention_layernorm(self.self_attn(hidden, cos_sin, kv_cache, meta))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden, _ = self.post_feedforward_layernorm(self.mlp(hidden))
        return hidden, residual


class Gemma3ForCausalLM(CausalLM):
    stack_norms = SANDWICH_NORMS

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__(config, backend)
        self.final_logit_softcap = getattr(config.hf_config, "final_logit_softcapping", None)

    def make_norm(self, size: int) -> nn.Module:
        return GemmaRMSNorm(size, self.config.rms_norm_eps, self.backend)

    def make_attention(self, layer_index: int) -> nn.Module:
        scale = self.config.hf_config.query_pre_attn_scalar**-0.5
        return Attention(self.config, layer_index, self.backend, scale=scale, qk_norm=self.make_norm)

    def make_layer(self, layer_index: int) -> nn.Module:
        attention, mlp = self.make_attention(layer_index), self.make_mlp(layer_index)
        return SandwichDecoderLayer(self.make_norm, attention, mlp, self.config.hidden_size)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        return hidden * embed_scale(self.config.hidden_size, hidden.dtype)

    def checkpoint_name(self, hf_name: str) -> str | None:
        if hf_name.startswith(OTHER_PREFIXES):
            return None
        for prefix, text in TEXT_PREFIXES.items():
            if hf_name.startswith(prefix):
                hf_name = text + hf_name.removeprefix(prefix)
                break
        return super().checkpoint_name(hf_name)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_logit_softcap:
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return logits


MODEL = Gemma3ForCausalLM
