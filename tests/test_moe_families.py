"""Mixtral and Qwen3-MoE: greedy output token for token equal to Hugging Face on tiny random models with
more experts than top-k, GQA and several layers; from the in-memory (fused) expert names, from what
`save_pretrained` writes (one tensor per expert), and with int8 experts against the dequantized model."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY_VOCAB, engine_for, hf_greedy, random_prompts
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

from engine.config import ModelConfig
from engine.engine import GenerateRequest
from engine.models.mixtral import MixtralForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM
from engine.params import SamplingParams, StoppingParams
from kernels.int8_linear import dequantize, quantize_per_channel
from kernels.moe import Experts, Int8Experts

GREEDY = SamplingParams(temperature=0.0)

COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts_per_tok=2,
    max_position_embeddings=2048,
    initializer_range=0.08,
    tie_word_embeddings=False,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)


def tiny_moe(kind: str, seed: int, **overrides) -> torch.nn.Module:
    """A tiny random Mixtral (4 experts) or Qwen3-MoE (5 experts, layer 1 dense), top-2, GQA."""
    torch.manual_seed(seed)
    if kind == "mixtral":
        config = MixtralConfig(**COMMON, intermediate_size=80, num_local_experts=4, **overrides)
    else:
        shape = {"intermediate_size": 112, "moe_intermediate_size": 48, "num_experts": 5}
        shape["mlp_only_layers"] = [1]
        config = Qwen3MoeConfig(**COMMON, **(shape | overrides))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    for name, param in model.named_parameters():
        if name.endswith("mlp.gate.weight"):  # the routers start at zero (Qwen3-MoE): give them a choice
            torch.nn.init.normal_(param, std=0.3)
    return model.eval()


def greedy_parity(hf: torch.nn.Module, engine, seed: int, count: int = 6, budget: int = 29) -> None:
    prompts = random_prompts(count, seed, max_len=50)
    max_new = [6 + (i * 5) % 9 for i in range(count)]
    requests = [
        GenerateRequest(p, GREEDY, StoppingParams(max_tokens=n, ignore_eos=True))
        for p, n in zip(prompts, max_new, strict=True)
    ]
    seqs = engine.generate(requests, max_num_batched_tokens=budget, max_num_seqs=4)
    for prompt, n, seq in zip(prompts, max_new, seqs, strict=True):
        assert seq.output_token_ids == hf_greedy(hf, prompt, n), f"prompt of {len(prompt)} tokens diverged"


@pytest.mark.parametrize(
    ("kind", "overrides", "model_class"),
    [
        ("mixtral", {}, MixtralForCausalLM),
        ("qwen3_moe", {"norm_topk_prob": False}, Qwen3MoeForCausalLM),
        ("qwen3_moe", {"norm_topk_prob": True, "decoder_sparse_step": 2, "mlp_only_layers": []}, None),
    ],
)
def test_moe_greedy_matches_hf(kind, overrides, model_class):
    hf = tiny_moe(kind, seed=1, **overrides)
    engine = engine_for(hf, block_size=8, num_blocks=128, shuffle_seed=1)
    if model_class is not None:
        assert isinstance(engine.model, model_class)
    mlps = [type(layer.mlp).__name__ for layer in engine.model.layers]
    sparse = [
        i for i, layer in enumerate(hf.model.layers) if type(layer.mlp).__name__.endswith("SparseMoeBlock")
    ]
    assert [i for i, name in enumerate(mlps) if name == "SparseMoeBlock"] == sparse and sparse
    greedy_parity(hf, engine, seed=1)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_moe_loads_what_save_pretrained_writes(kind, tmp_path: Path):
    """transformers 5 writes one tensor per expert (Mixtral's `block_sparse_moe.experts.N.w1/w3/w2`,
    Qwen3-MoE's `mlp.experts.N.gate_proj/up_proj/down_proj`), not the fused ones it holds in memory."""
    hf = tiny_moe(kind, seed=2)
    hf.save_pretrained(tmp_path)
    state_dict = load_file(tmp_path / "model.safetensors")
    assert any(".experts.0." in name for name in state_dict)
    on_disk = SimpleNamespace(config=hf.config, state_dict=lambda: state_dict)
    engine = engine_for(on_disk, block_size=8, num_blocks=96)
    greedy_parity(hf, engine, seed=2, count=3)


def dequantized_reference(hf: torch.nn.Module) -> torch.nn.Module:
    """`hf` with every decoder linear, expert matrix, the embedding and the LM head replaced by its int8
    round trip (rows quantized as `--quantization int8` does); the routers and norms as they were."""
    state = hf.state_dict()
    for name, tensor in state.items():
        layer_weight = name.startswith("model.layers.") and name.endswith(("proj.weight", "_proj"))
        vocabulary = name in ("model.embed_tokens.weight", "lm_head.weight")
        if (layer_weight or vocabulary) and tensor.dim() >= 2:
            rows = tensor.reshape(-1, tensor.shape[-1])
            state[name] = dequantize(*quantize_per_channel(rows)).reshape(tensor.shape)
    hf.load_state_dict(state)
    return hf


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_int8_experts_match_the_dequantized_model(kind):
    hf = tiny_moe(kind, seed=3)
    engine = engine_for(hf, block_size=8, num_blocks=96, quantization="int8")
    experts = [m for m in engine.model.modules() if isinstance(m, Experts | Int8Experts)]
    assert experts and all(isinstance(m, Int8Experts) for m in experts)
    greedy_parity(dequantized_reference(hf), engine, seed=3, count=4)


def test_model_config_reads_moe_families():
    for kind in ("mixtral", "qwen3_moe"):
        config = ModelConfig.from_hf(tiny_moe(kind, seed=0).config)
        assert config.model_type == kind and config.num_layers == 3
