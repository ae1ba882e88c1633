"""Token-exact greedy parity with Hugging Face on the real default model, SmolLM2-135M-Instruct, fp32."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import TEST_DEVICE, hf_greedy
from torch import nn
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


def assert_chat_replies_match_hf(
    model_dir: Path,
    chats: list[str],
    new_tokens: int,
    num_blocks: int,
    reference: Callable[[nn.Module], nn.Module] | None = None,
    **config_kwargs,
) -> list[str]:
    """Greedy replies to `chats` (each a user turn through the chat template, EOS ignored) from an fp32
    engine over `model_dir` equal Hugging Face's, token for token, and every KV block comes back; returns
    the replies' text.

    `reference` turns the loaded HF model into the one to compare with (the model itself when None);
    `config_kwargs` go to the engine's config (e.g. `quantization`).
    """
    config = EngineConfig(
        dtype=torch.float32,
        device=TEST_DEVICE,
        cache=CacheConfig(block_size=16, num_blocks=num_blocks),
        **config_kwargs,
    )
    engine = Engine.from_pretrained(model_dir, config)
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in chats]
    stopping = StoppingParams(max_tokens=new_tokens, ignore_eos=True)
    requests = [GenerateRequest(p, SamplingParams(temperature=0.0), stopping) for p in prompts]
    ours = engine.generate(requests, max_num_batched_tokens=48)
    assert engine.block_manager.num_free_blocks == num_blocks

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if reference is not None:
        hf = reference(hf)
    hf.generation_config.eos_token_id = None  # run on past EOS like ignore_eos, without suppressing it
    for prompt, seq in zip(prompts, ours, strict=True):
        assert seq.output_token_ids == hf_greedy(hf, prompt, new_tokens)
    return [engine.tokenizer.decode(seq.output_token_ids) for seq in ours]


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_chat_greedy_matches_transformers(real_model_dir):
    replies = assert_chat_replies_match_hf(real_model_dir, CHATS, NEW_TOKENS, num_blocks=128)
    assert "Paris" in replies[0]
