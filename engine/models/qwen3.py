"""Qwen3: the Llama layer with an RMSNorm over each query and key head before RoPE (no qkv bias unless
`attention_bias`); its sliding layers, if any, come from `layer_types` like Qwen2's. The C++ decode stack
computes it: the head norms are its `q_norm`/`k_norm`."""

from __future__ import annotations

from torch import nn

from engine.models.decoder import PRE_NORMS, Attention, CausalLM


class Qwen3ForCausalLM(CausalLM):
    stack_norms = PRE_NORMS

    def make_attention(self, layer_index: int) -> nn.Module:
        return Attention(self.config, layer_index, self.backend, qk_norm=self.make_norm)


MODEL = Qwen3ForCausalLM
