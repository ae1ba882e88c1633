"""Qwen3: the Llama layer with an RMSNorm over each query and key head before RoPE (no qkv bias unless
`attention_bias`); its sliding layers, if any, come from `layer_types` like Qwen2's."""

from __future__ import annotations

from torch import nn

from engine.models.decoder import Attention, CausalLM


class Qwen3ForCausalLM(CausalLM):
    def make_attention(self, layer_index: int) -> nn.Module:
        return Attention(self.config, layer_index, self.backend, qk_norm=self.make_norm)


MODEL = Qwen3ForCausalLM
