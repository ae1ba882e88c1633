"""Token-exact greedy parity with Hugging Face on the real default model, SmolLM2-135M-Instruct, fp32."""

from __future__ import annotations

import pytest
import torch
from conftest import TEST_DEVICE
from transformers import AutoModelForCausalLM

from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine, GenerateRequest
from engine.params import SamplingParams, StoppingParams

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue? Answer briefly.",
]
NEW_TOKENS = 64


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_chat_greedy_matches_transformers(real_model_dir):
    engine = Engine.from_pretrained(
        real_model_dir,
        EngineConfig(
            dtype=torch.float32, device=TEST_DEVICE, cache=CacheConfig(block_size=16, num_blocks=128)
        ),
    )
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    stopping = StoppingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    requests = [GenerateRequest(p, SamplingParams(temperature=0.0), stopping) for p in prompts]
    ours = engine.generate(requests, max_num_batched_tokens=48)
    assert engine.block_manager.num_free_blocks == 128

    hf = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # run on past EOS like ignore_eos, without suppressing it
    for prompt, seq in zip(prompts, ours, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
            )
        assert seq.output_token_ids == ref[0, len(prompt) :].tolist()
    answer = engine.tokenizer.decode(ours[0].output_token_ids)
    assert "Paris" in answer
