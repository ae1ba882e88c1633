"""Mixtral: the Llama layer (with Mistral's window where the config sets one) whose MLP is a sparse mixture
of experts in every layer; the top-k routing weights are always renormalised (`engine.models.moe`)."""

from __future__ import annotations

from engine.models.moe import MoeCausalLM, MoeSpec


class MixtralForCausalLM(MoeCausalLM):
    def moe_spec(self) -> MoeSpec:
        hf = self.config.hf_config
        return MoeSpec(
            num_experts=hf.num_local_experts,
            top_k=hf.num_experts_per_tok,
            intermediate_size=hf.intermediate_size,
            renormalize=True,
        )


MODEL = MixtralForCausalLM
