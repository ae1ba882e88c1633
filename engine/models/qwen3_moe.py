"""Qwen3-MoE: Qwen3's attention (an RMSNorm over each query and key head before RoPE) with a sparse mixture
of experts as the MLP of every `decoder_sparse_step`-th layer not listed in `mlp_only_layers`; those keep
a dense MLP of `intermediate_size`. The experts have `moe_intermediate_size`; the top-k routing weights
are renormalised only when `norm_topk_prob`, and rounded to the activation dtype (`engine.models.moe`)."""

from __future__ import annotations

from torch import nn

from engine.models.decoder import Attention
from engine.models.moe import MoeCausalLM, MoeSpec


class Qwen3MoeForCausalLM(MoeCausalLM):
    def make_attention(self, layer_index: int) -> nn.Module:
        return Attention(self.config, layer_index, self.backend, qk_norm=self.make_norm)

    def moe_spec(self) -> MoeSpec:
        hf = self.config.hf_config
        return MoeSpec(
            num_experts=hf.num_experts,
            top_k=hf.num_experts_per_tok,
            intermediate_size=hf.moe_intermediate_size,
            renormalize=bool(hf.norm_topk_prob),
            weights_in_activation_dtype=True,
        )

    def is_sparse(self, layer_index: int) -> bool:
        hf = self.config.hf_config
        step = hf.decoder_sparse_step or 1
        only_dense = layer_index in (hf.mlp_only_layers or [])
        return not only_dense and hf.num_experts > 0 and (layer_index + 1) % step == 0


MODEL = Qwen3MoeForCausalLM
