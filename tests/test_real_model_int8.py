"""`--quantization int8` on the real default model, SmolLM2-135M-Instruct: greedy chat replies equal
Hugging Face running the dequantized weights (q * scale), token for token."""

from __future__ import annotations

import pytest
import torch
from conftest import TEST_DEVICE
from test_quantization import dequantized_hf
from transformers import AutoModelForCausalLM

from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine, GenerateRequest
from engine.params import SamplingParams, StoppingParams

# Held out: none of these prompts is used anywhere else in the tests.
CHATS = [
    "Name two rivers in Africa.",
    "What does a compiler do? One sentence.",
    "Give me a short tip for sleeping better.",
    "How many legs does a spider have?",
]
NEW_TOKENS = 48


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_int8_greedy_matches_transformers_on_dequantized_weights(real_model_dir):
    config = EngineConfig(
        dtype=torch.float32,
        device=TEST_DEVICE,
        cache=CacheConfig(block_size=16, num_blocks=96),
        quantization="int8",
    )
    engine = Engine.from_pretrained(real_model_dir, config)
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    stopping = StoppingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    requests = [GenerateRequest(p, SamplingParams(temperature=0.0), stopping) for p in prompts]
    ours = engine.generate(requests, max_num_batched_tokens=48)
    assert engine.block_manager.num_free_blocks == 96

    hf = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    reference = dequantized_hf(hf)
    del hf
    reference.generation_config.eos_token_id = None  # run on past EOS like ignore_eos
    for prompt, seq in zip(prompts, ours, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = reference.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
            )
        assert seq.output_token_ids == ref[0, len(prompt) :].tolist()
    assert "8" in engine.tokenizer.decode(ours[3].output_token_ids), "a spider has 8 legs"
