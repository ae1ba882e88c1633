"""Llama, Mistral and Qwen2: the skeleton's own layer (Qwen2's qkv bias and Mistral's window are config
facts the skeleton reads), and the one layer the C++ decode stack computes."""

from __future__ import annotations

from engine.models.decoder import CausalLM


class LlamaForCausalLM(CausalLM):
    llama_layers = True


MODEL = LlamaForCausalLM
