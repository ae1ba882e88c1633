"""The real Gemma 3 270M, served exactly: greedy completions equal Hugging Face's token for token.

Twelve held-out prompts (`bench.heldout_text`: standard-library docstrings, 110 to 3,000 tokens, most
past the 512-token window of the model's local layers) are completed by an aggregated engine with the
prefix cache on and off, and by a real decode server fed by a real prefill server on loopback; every
completion equals `transformers`' greedy `generate` on the same fp32 checkpoint, whose own sliding
window is checked to apply. A 4,000-token prompt then shows what the KV groups save: the KV the prefill
tier sends and the blocks the decode tier holds for the sequence, each against a layout where all 18
layers keep every block, with the reply still Hugging Face's.

The model is never fetched here (1 GB, minutes to convert): without `tandem fetch-model gemma-3-270m`
the module is skipped.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import hf_greedy
from test_disagg_serving import RunningDecode, RunningPrefill, tokens_of
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.heldout_text import corpus, heldout_prompts, spread_lengths
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine, GenerateRequest
from engine.model_catalog import GEMMA3_270M
from engine.model_runner import ScheduledChunk
from engine.model_store import is_complete, model_cache_dir
from engine.params import SamplingParams, StoppingParams
from kv_transfer.wire import transfer_payload_bytes
from serving.kv_layout import engine_kv_layout

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

logger = logging.getLogger(__name__)

NEW_TOKENS = 24
WINDOW = 512
LENGTHS = spread_lengths(12, 110, 3000)  # 110 ... 3,000: six past the window, two past 2,000
SAVINGS_PROMPT_TOKENS = 4000
MAX_MODEL_LEN = 4096
NUM_BLOCKS = 2048
# Enough for every group's blocks of all twelve prompts (about 4,400), so the second wave's hits do not
# depend on what the LRU evicted during the first.
CACHING_NUM_BLOCKS = 4608
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    directory = model_cache_dir(GEMMA3_270M)
    if not is_complete(directory):
        pytest.skip(f"gemma-3-270m is not cached at {directory}; run `tandem fetch-model gemma-3-270m`")
    return directory


@pytest.fixture(scope="module")
def prompts(gemma_dir: Path) -> list[list[int]]:
    """The held-out prompts as Gemma's tokenizer encodes them (BOS first)."""
    tokenizer = AutoTokenizer.from_pretrained(gemma_dir)
    texts = heldout_prompts(LENGTHS, lambda text: len(tokenizer(text).input_ids))
    encoded = [tokenizer(text).input_ids for text in texts]
    assert all(ids[0] == tokenizer.bos_token_id for ids in encoded)
    lengths = [len(ids) for ids in encoded]
    assert min(lengths) >= 100 and max(lengths) <= 3000
    assert sum(n > WINDOW for n in lengths) >= 6 and sum(n > 2000 for n in lengths) >= 2
    return encoded


@pytest.fixture(scope="module")
def savings_prompt(gemma_dir: Path) -> list[int]:
    """Exactly 4,000 tokens of held-out text, from a docstring none of the twelve prompts starts with."""
    tokenizer = AutoTokenizer.from_pretrained(gemma_dir)
    return tokenizer(corpus(len(LENGTHS))).input_ids[:SAVINGS_PROMPT_TOKENS]


@pytest.fixture(scope="module")
def hf_model(gemma_dir: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None  # run on past EOS like ignore_eos, without suppressing it
    return model.eval()


@pytest.fixture(scope="module")
def references(hf_model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    """Hugging Face's greedy completions of the twelve prompts, computed once for every test here."""
    return [hf_greedy(hf_model, prompt, NEW_TOKENS) for prompt in prompts]


class HeldBlocks:
    """Wraps an engine's `step` and records, per request, the most KV blocks it held going into a step
    (what it needs at that moment: the step's own blocks are allocated before the call)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._step = engine.step
        self.peak: dict[str, int] = {}
        engine.step = self

    def __call__(self, chunks: list[ScheduledChunk]):
        manager = self._engine.block_manager
        for chunk in chunks:
            held = manager.num_held_blocks(chunk.seq)
            self.peak[chunk.seq.request_id] = max(self.peak.get(chunk.seq.request_id, 0), held)
        return self._step(chunks)


def first_divergence(ours: list[int], expected: list[int]) -> str:
    """Where two completions part, in words, for an assertion message."""
    index = next((i for i, (a, b) in enumerate(zip(ours, expected, strict=False)) if a != b), None)
    if index is None:
        return f"lengths {len(ours)} != {len(expected)}"
    return f"first differs at new token {index}: ours {ours[index]}, transformers {expected[index]}"


def assert_completions_equal(name: str, prompts, outputs, references) -> None:
    for prompt, ours, expected in zip(prompts, outputs, references, strict=True):
        assert ours == expected, f"{name}, prompt of {len(prompt)} tokens: {first_divergence(ours, expected)}"


def test_reference_applies_the_sliding_window(hf_model: torch.nn.Module, prompts: list[list[int]]):
    """The reference is only a reference if its local layers slide: lifting its window past the prompt
    changes the last logits of a prompt longer than the window, and restoring it restores them."""
    prompt = next(p for p in prompts if WINDOW < len(p) < 2 * WINDOW)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        windowed = hf_model(ids, logits_to_keep=1).logits[0, -1]
        hf_model.config.sliding_window = MAX_MODEL_LEN
        try:
            unwindowed = hf_model(ids, logits_to_keep=1).logits[0, -1]
        finally:
            hf_model.config.sliding_window = WINDOW
        again = hf_model(ids, logits_to_keep=1).logits[0, -1]
    assert not torch.allclose(windowed, unwindowed, atol=1e-2)
    assert torch.equal(windowed, again)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_aggregated_engine_equals_transformers(gemma_dir, prompts, references, prefix_caching):
    """One engine, all twelve prompts at once (chunked prefill mixing them, then batched decode). With
    the prefix cache on, a second wave of the same prompts is served from it (each sliding group's last
    window kept cached after it slid out) and still completes the same."""
    num_blocks = CACHING_NUM_BLOCKS if prefix_caching else NUM_BLOCKS
    config = EngineConfig(
        dtype=torch.float32,
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=prefix_caching,
    )
    engine = Engine.from_pretrained(gemma_dir, config)
    assert engine.model_config.kv_layout.is_hybrid
    sampling, stopping = (
        SamplingParams(temperature=0.0),
        StoppingParams(max_tokens=NEW_TOKENS, ignore_eos=True),
    )
    requests = [GenerateRequest(prompt, sampling, stopping) for prompt in prompts]
    waves = 2 if prefix_caching else 1
    for wave in range(waves):
        done = engine.generate(requests, max_num_batched_tokens=512)
        assert_completions_equal(
            f"aggregated wave {wave}", prompts, [s.output_token_ids for s in done], references
        )
        cached = [seq.num_cached_tokens for seq in done]
        if wave == 0:
            assert cached == [0] * len(prompts)
        else:
            # Every full block but the one holding the last prompt token came from the cache.
            assert cached == [(len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts]
        assert engine.block_manager.num_free_blocks == num_blocks


@pytest.fixture(scope="module")
def disaggregated(gemma_dir: Path) -> Iterator[tuple[RunningPrefill, RunningDecode, dict[str, HeldBlocks]]]:
    """A prefill server and a decode server that sends it every prompt, on loopback, both at fp32, each
    engine's blocks held per request recorded."""
    prefill = RunningPrefill(gemma_dir, token_budget=512, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN)
    # Twelve prompts of up to 3,000 tokens on one 2-core prefill tier: on a loaded machine the last one's
    # prefill ends minutes after it was sent, past the 60 s default of one Prefill call.
    decode = RunningDecode(
        gemma_dir,
        num_blocks=NUM_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
        prefill=prefill.address,
        prefill_timeout_s=900.0,
    )
    held = {"prefill": HeldBlocks(prefill.engine), "decode": HeldBlocks(decode.engine)}
    try:
        yield prefill, decode, held
    finally:
        decode.close()
        prefill.close()


def test_disaggregated_servers_equal_transformers(disaggregated, prompts, references):
    """All twelve prompts sent at once to the decode server: each prefilled on the prefill server, its
    KV (the sliding groups' last window only) streamed over gRPC, decoded in one batch."""
    prefill, decode, _ = disaggregated
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        futures = [
            pool.submit(decode.generate, prompt, NEW_TOKENS, f"heldout-{i}", timeout=600)
            for i, prompt in enumerate(prompts)
        ]
        replies = [future.result() for future in futures]
    assert_completions_equal("disaggregated", prompts, [tokens_of(r) for r in replies], references)
    assert not decode.locally_prefilled_request_ids(), "a prompt was prefilled on the decode tier"
    assert decode.stats.remote_prefills_completed >= len(prompts) and decode.stats.attempt_failures == 0


def test_sliding_window_savings_on_4000_tokens(disaggregated, hf_model, savings_prompt):
    """A 4,000-token prompt, disaggregated: the KV on the wire and the KV blocks the decode tier holds
    for it are each at most 0.35x of a full-attention layout of the same model (18 layers, every block
    of the prompt), and the reply is still Hugging Face's."""
    prefill, decode, held = disaggregated
    layout = engine_kv_layout(decode.engine)
    assert [g.window for g in layout.groups] == [None] + [WINDOW] * 5
    full_attention = dataclasses.replace(layout, attention=None)

    received_before = decode.stats.kv_bytes_received
    reply = tokens_of(decode.generate(savings_prompt, NEW_TOKENS, "savings", timeout=600))
    expected = hf_greedy(hf_model, savings_prompt, NEW_TOKENS)
    assert reply == expected, first_divergence(reply, expected)

    wire = decode.stats.kv_bytes_received - received_before
    assert wire == transfer_payload_bytes(layout, SAVINGS_PROMPT_TOKENS)
    wire_full = transfer_payload_bytes(full_attention, SAVINGS_PROMPT_TOKENS)

    # A block holds one block of K and V in each of the layout's slots (a group's layers).
    block_bytes = decode.engine.model_config.kv_layout.num_slots * layout.block_bytes()
    held_bytes = held["decode"].peak["savings"] * block_bytes
    held_full = -(-SAVINGS_PROMPT_TOKENS // BLOCK_SIZE) * layout.num_layers * layout.block_bytes()
    logger.info(
        "4,000-token prompt: KV on the wire %d of %d bytes (%.3fx); "
        "decode held %d blocks, %d of %d bytes (%.3fx); prefill held %d blocks at most (%.3fx)",
        wire,
        wire_full,
        wire / wire_full,
        held["decode"].peak["savings"],
        held_bytes,
        held_full,
        held_bytes / held_full,
        held["prefill"].peak["savings"],
        held["prefill"].peak["savings"] * block_bytes / held_full,
    )
    assert wire <= 0.35 * wire_full
    assert held_bytes <= 0.35 * held_full
