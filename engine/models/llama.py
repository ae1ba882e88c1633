"""Llama, Mistral and Qwen2: the skeleton's own layer (Qwen2's qkv bias and Mistral's window are config
facts the skeleton reads); the C++ decode stack computes it from `PRE_NORMS`."""

from __future__ import annotations

from engine.models.decoder import PRE_NORMS, CausalLM


class LlamaForCausalLM(CausalLM):
    stack_norms = PRE_NORMS


MODEL = LlamaForCausalLM
