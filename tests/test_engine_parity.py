"""Greedy token-exact parity of our paged, chunked, batched forward pass with Hugging Face."""

from __future__ import annotations

import pytest
import torch
from conftest import engine_for, hf_greedy, random_prompts, tiny_hf_model

from engine.engine import GenerateRequest
from engine.params import SamplingParams, StoppingParams

GREEDY = SamplingParams(temperature=0.0)

CASES = [
    # kind, heads, kv_heads, head_dim, seed, block_size, token budget
    ("llama", 4, 4, 64, 0, 16, 16),  # MHA, chunks of exactly one block
    ("llama", 4, 2, 128, 1, 16, 37),  # GQA, chunks that split blocks
    ("llama", 6, 1, 64, 2, 12, 23),  # MQA, non-power-of-two block size
    ("qwen2", 4, 2, 64, 3, 16, 64),  # qkv bias, tied embeddings
    ("qwen2", 2, 2, 128, 4, 12, 7),  # MHA, head_dim 128, tiny chunks
]


@pytest.mark.parametrize(("kind", "heads", "kv_heads", "head_dim", "seed", "block_size", "budget"), CASES)
def test_mixed_batch_greedy_matches_hf(kind, heads, kv_heads, head_dim, seed, block_size, budget):
    hf = tiny_hf_model(seed, kind=kind, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
    prompts = random_prompts(12, seed, max_len=70)
    max_new = [8 + (i * 5) % 13 for i in range(len(prompts))]
    engine = engine_for(hf, block_size=block_size, num_blocks=160, shuffle_seed=seed)
    requests = [
        GenerateRequest(p, GREEDY, StoppingParams(max_tokens=n, ignore_eos=True))
        for p, n in zip(prompts, max_new, strict=True)
    ]
    seqs = engine.generate(requests, max_num_batched_tokens=budget, max_num_seqs=8)
    for prompt, n, seq in zip(prompts, max_new, seqs, strict=True):
        assert seq.output_token_ids == hf_greedy(hf, prompt, n), f"prompt of {len(prompt)} tokens diverged"
    assert engine.block_manager.num_free_blocks == 160


def test_llama3_rope_scaling_matches_hf():
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    hf = tiny_hf_model(5, rope_parameters=rope)
    prompts = random_prompts(4, 5, min_len=40, max_len=120)
    engine = engine_for(hf, shuffle_seed=5)
    requests = [GenerateRequest(p, GREEDY, StoppingParams(max_tokens=10, ignore_eos=True)) for p in prompts]
    for prompt, seq in zip(prompts, engine.generate(requests, max_num_batched_tokens=50), strict=True):
        assert seq.output_token_ids == hf_greedy(hf, prompt, 10)


def test_bf16_runs_close_to_fp32():
    """bf16 on the CPU: same argmax on the first step for most prompts (rounding may flip near-ties)."""
    hf = tiny_hf_model(6)
    prompts = random_prompts(8, 6, min_len=5, max_len=40)
    outs = {}
    for dtype in (torch.float32, torch.bfloat16):
        engine = engine_for(hf, dtype=dtype)
        stopping = StoppingParams(max_tokens=1, ignore_eos=True)
        requests = [GenerateRequest(p, GREEDY, stopping) for p in prompts]
        outs[dtype] = [s.output_token_ids[0] for s in engine.generate(requests)]
    agree = sum(a == b for a, b in zip(outs[torch.float32], outs[torch.bfloat16], strict=True))
    assert agree >= 6
