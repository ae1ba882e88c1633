"""Every model family served disaggregated on loopback: a real prefill server computes the prompts, its
KV crosses the wire into a real decode server, and the greedy tokens equal Hugging Face's `generate`.

The tiny random models are those the aggregated parity tests use (`test_model_families`,
`test_moe_families`): several layers, GQA, a window of 20 tokens in the families that slide (so the
prompts, all longer than it, evict blocks while prefilled in chunks and while decoded), MoE with more
experts than top-k. Prompts go in concurrently, in two waves; the second shares a prefix with the first,
so with the prefix cache on the prefill tier serves part of it from cached blocks.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import TINY_VOCAB, hf_greedy, wait_until
from test_disagg_serving import RunningDecode, RunningPrefill, tokens_of
from test_model_families import WINDOW, hf_model
from test_moe_families import tiny_moe
from tiny_tokenizer import build_tiny_tokenizer

from engine.config import ModelConfig
from kv_transfer.wire import transfer_payload_bytes
from serving.kv_layout import engine_kv_layout

# name -> the tiny Hugging Face model of that family.
MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "llama": lambda: hf_model("llama"),
    "qwen2_window": lambda: hf_model("qwen2_window"),
    "mistral_window": lambda: hf_model("mistral_window"),
    "qwen3_window": lambda: hf_model("qwen3_window"),
    "gemma3_text": lambda: hf_model("gemma3_text"),
    "phi3_window": lambda: hf_model("phi3_window"),
    "mixtral_window": lambda: tiny_moe("mixtral", seed=4, sliding_window=WINDOW),
    "qwen3_moe": lambda: tiny_moe("qwen3_moe", seed=4),
}
FULL_ATTENTION = ("llama", "qwen3_moe")
# The prefix cache off too for a family with two KV groups, one with one sliding group, and an MoE one.
NO_PREFIX_CACHE = ("gemma3_text", "mistral_window", "mixtral_window")
CASES = [(name, True) for name in MODELS] + [(name, False) for name in NO_PREFIX_CACHE]
FIRST_LENGTHS = [27, 44, 61, 83]
SHARED_PREFIX = 48


def waves(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts longer than the window: a first wave, and a second on the first's longest prompt's head."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(TINY_VOCAB) for _ in range(n)]

    first = [tokens(n) for n in FIRST_LENGTHS]
    second = [first[-1][:SHARED_PREFIX] + tokens(n) for n in (5, 22, 39)]
    return first, second


def generate_all(decode: RunningDecode, prompts: list[list[int]], wave: int) -> list[list[int]]:
    """Every prompt sent at once (greedy, EOS ignored), each with its own number of new tokens."""
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        futures = [
            pool.submit(decode.generate, prompt, max_new(i), f"w{wave}-{i}")
            for i, prompt in enumerate(prompts)
        ]
        return [tokens_of(future.result(300)) for future in futures]


def max_new(i: int) -> int:
    return 8 + (i * 3) % 5


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "prefix_caching"), CASES, ids=[f"{n}-{'cache' if c else 'no_cache'}" for n, c in CASES]
)
def test_disaggregated_greedy_matches_hf(name: str, prefix_caching: bool, tmp_path: Path) -> None:
    hf = MODELS[name]()
    hf.save_pretrained(tmp_path)
    build_tiny_tokenizer(tmp_path)
    windows = ModelConfig.from_hf(hf.config).layer_windows
    first, second = waves(seed=len(name))
    assert min(map(len, first + second)) > WINDOW
    prefill = RunningPrefill(tmp_path, token_budget=32, num_blocks=128, prefix_caching=prefix_caching)
    decode = RunningDecode(tmp_path, num_blocks=128, prefill=prefill.address, prefix_caching=prefix_caching)
    try:
        layout = engine_kv_layout(decode.engine)
        assert layout.sliding == any(windows) == (name not in FULL_ATTENTION)
        for wave, prompts in enumerate((first, second)):
            outputs = generate_all(decode, prompts, wave)
            for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
                expected = hf_greedy(hf, prompt, max_new(i))
                assert output == expected, f"{name}: prompt of {len(prompt)} tokens diverged"
            if wave == 0:
                # The whole first wave's KV crossed the wire: only what decode can still read.
                sent = sum(transfer_payload_bytes(layout, len(p)) for p in first)
                assert decode.stats.kv_bytes_received == sent
                full_attention = dataclasses.replace(layout, attention=None)
                full = sum(transfer_payload_bytes(full_attention, len(p)) for p in first)
                assert (sent < full) == layout.sliding
        stats = decode.stats
        assert stats.remote_prefills_completed == len(first) + len(second) and stats.attempt_failures == 0
        assert not decode.locally_prefilled_request_ids(), "a prompt was prefilled on decode"
        expected_ids = {f"w{w}-{i}" for w, prompts in enumerate((first, second)) for i in range(len(prompts))}
        assert prefill.prefilled_request_ids() == expected_ids
        assert (prefill.engine.block_manager.num_hit_tokens > 0) == prefix_caching
        assert wait_until(decode.pool_is_full) and wait_until(prefill.pool_is_full)
    finally:
        decode.close()
        prefill.close()
