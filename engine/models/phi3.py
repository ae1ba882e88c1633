"""Phi-3 (and Phi-4-mini, which shares its `model_type`): the Llama layer, stored fused.

Its checkpoints already hold `qkv_proj` (q, k, v rows in that order) and `gate_up_proj` (gate rows,
then up rows), exactly our fused layout, so nothing is stacked while loading. RoPE may cover only part
of each head (`partial_rotary_factor`, Phi-4-mini's 0.75), and `sliding_window` applies to every
layer; the skeleton does both, and so does the C++ decode stack (its `rotary_dim`). `longrope` runs with
its short factors (`engine.config`).
"""

from __future__ import annotations

from engine.models.decoder import PRE_NORMS, CausalLM


class Phi3ForCausalLM(CausalLM):
    stacked_params = {}
    stack_norms = PRE_NORMS


MODEL = Phi3ForCausalLM
