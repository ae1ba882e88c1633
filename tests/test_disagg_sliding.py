"""Disaggregated serving of a model with sliding-window layers, on loopback: a tiny random Qwen2 whose
layers alternate two local (window 40) and one global, prefilled on a real prefill server and decoded on
a real decode server. Greedy tokens equal Hugging Face's and the aggregated server's, for prompts
shorter and longer than the window, with the prefix cache on and off, while only the sliding blocks
the decode tier still reads cross the wire."""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import hf_greedy, tiny_hf_config, wait_until
from test_disagg_serving import RunningDecode, RunningPrefill, StepGate, tokens_of
from tiny_tokenizer import TINY_VOCAB_SIZE, build_tiny_tokenizer
from transformers import AutoModelForCausalLM

from kv_transfer.wire import transfer_payload_bytes
from serving.kv_layout import engine_kv_layout

WINDOW = 40
# Shorter than the window, past it, and 55 and 71: (L - WINDOW + 1) % BLOCK_SIZE == 0, where the
# window's oldest key opens a block.
LENGTHS = [23, 41, 55, 71, 100, 150, 233]


def _save_windowed(directory: Path, seed: int, layer_types: list[str], window: int) -> torch.nn.Module:
    """A tiny random Qwen2 whose layers attend as `layer_types` say, saved with its tokenizer."""
    torch.manual_seed(seed)
    config = tiny_hf_config("qwen2", num_layers=len(layer_types), vocab_size=TINY_VOCAB_SIZE)
    config.tie_word_embeddings = False
    config.use_sliding_window = True
    config.sliding_window = window
    config.max_window_layers = 0
    config.layer_types = layer_types
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    hf.save_pretrained(directory)
    build_tiny_tokenizer(directory)
    return hf


@pytest.fixture(scope="module")
def sliding_model(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    directory = tmp_path_factory.mktemp("tiny-sliding-model")
    layer_types = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    return directory, _save_windowed(directory, 33, layer_types, WINDOW)


@contextlib.contextmanager
def _both_topologies(
    model_dir: Path, prefix_caching: bool = True
) -> Iterator[tuple[RunningPrefill, RunningDecode, RunningDecode]]:
    """A prefill server, a decode server that uses it and an aggregated one; on leaving, every pool has
    all its blocks back."""
    prefill = RunningPrefill(model_dir, prefix_caching=prefix_caching)
    disaggregated = RunningDecode(model_dir, prefill=prefill.address, prefix_caching=prefix_caching)
    aggregated = RunningDecode(model_dir, prefix_caching=prefix_caching)
    try:
        yield prefill, disaggregated, aggregated
        assert wait_until(disaggregated.pool_is_full) and wait_until(aggregated.pool_is_full)
        assert wait_until(prefill.pool_is_full)
    finally:
        disaggregated.close()
        aggregated.close()
        prefill.close()


def prompts(seed: int, shared: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    head = shared or []
    return [head + [rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(n)] for n in LENGTHS]


@pytest.mark.slow
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_sliding_window_model_disaggregated_equals_aggregated_equals_hf(sliding_model, prefix_caching):
    model_dir, hf = sliding_model
    with _both_topologies(model_dir, prefix_caching) as (prefill, disaggregated, aggregated):
        layout = engine_kv_layout(disaggregated.engine)
        assert layout.sliding and layout.num_groups == 3
        first = prompts(seed=2)
        # A second wave on the first wave's longest prompt's first 96 tokens: the prefill tier's cache
        # serves them (decode got only that prompt's last window of the sliding groups).
        second = prompts(seed=3, shared=first[-1][:96])
        for wave, batch in enumerate((first, second)):
            for i, prompt in enumerate(batch):
                expected = hf_greedy(hf, prompt, 6)
                remote = tokens_of(disaggregated.generate(prompt, 6, f"w{wave}-{i}"))
                local = tokens_of(aggregated.generate(prompt, 6, f"w{wave}-{i}"))
                assert remote == expected, f"disaggregated prompt of {len(prompt)} tokens diverged"
                assert local == expected, f"aggregated prompt of {len(prompt)} tokens diverged"
            if wave == 0:
                stats = disaggregated.stats
                sent = sum(transfer_payload_bytes(layout, len(p)) for p in first)
                full_attention = dataclasses.replace(layout, attention=None)
                full = sum(transfer_payload_bytes(full_attention, len(p)) for p in first)
                assert stats.kv_bytes_received == sent < full
        # A conversation: a reply decoded here, then the next turn on it. Decode computed the reply's
        # blocks itself and cached them in every group (a sliding group's last window too), so with the
        # prefix cache it holds the turn's first blocks and prefill sends only the rest.
        reply = tokens_of(disaggregated.generate(first[0], 64, "turn-1"))
        assert reply == hf_greedy(hf, first[0], 64)
        turn = first[0] + reply + prompts(seed=4)[0][:20]
        assert tokens_of(disaggregated.generate(turn, 6, "turn-2")) == hf_greedy(hf, turn, 6)
        assert tokens_of(aggregated.generate(turn, 6, "turn-2")) == hf_greedy(hf, turn, 6)
        stats = disaggregated.stats
        assert stats.remote_prefills_completed == 2 * len(LENGTHS) + 2 and stats.attempt_failures == 0
        assert not disaggregated.locally_prefilled_request_ids(), "a prompt was prefilled on decode"
        assert (stats.kv_blocks_skipped > 0) == prefix_caching


@pytest.fixture(scope="module")
def all_sliding_model(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """Every layer windowed over 20 tokens (Mistral v0.1's shape of layout): one sliding KV group."""
    directory = tmp_path_factory.mktemp("tiny-all-sliding-model")
    return directory, _save_windowed(directory, 34, ["sliding_attention"] * 2, 20)


def _burst_behind_a_held_step(
    server: RunningDecode, holder: RunningDecode | RunningPrefill, batch: list[list[int]]
) -> list[list[int]]:
    """Send `batch[-1]` (another tenant's prompt), hold `holder`'s engine in its step, send the rest,
    then let go: the rest are queued together, so they are admitted in one step before any computed."""
    gate = holder.gate
    gate.entered.clear()
    gate.is_open.clear()
    with ThreadPoolExecutor(len(batch)) as pool:
        futures = [pool.submit(server.generate, batch[-1], 6, "other-tenant")]
        assert gate.entered.wait(60)
        futures = [pool.submit(server.generate, p, 6, f"r{i}") for i, p in enumerate(batch[:-1])] + futures
        assert wait_until(lambda: len(holder.server.registry) == len(batch))
        gate.is_open.set()
        return [tokens_of(future.result()) for future in futures]


@pytest.mark.slow
def test_prompts_sharing_more_than_a_window_arrive_together_and_all_succeed(all_sliding_model):
    """Six prompts sharing 64 tokens, queued together behind another tenant's, on both topologies: each
    prompt after the first takes the shared blocks its twins computed meanwhile (below the last window:
    none), and every stream is exact."""
    model_dir, hf = all_sliding_model
    rng = random.Random(7)
    shared = [rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(64)]
    batch = [shared + [rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(5 + i)] for i in range(6)]
    batch.append([rng.randrange(3, TINY_VOCAB_SIZE) for _ in range(30)])
    expected = [hf_greedy(hf, prompt, 6) for prompt in batch]
    with _both_topologies(model_dir) as (prefill, disaggregated, aggregated):
        assert engine_kv_layout(aggregated.engine).num_groups == 1
        aggregated.gate = StepGate(aggregated.engine)
        assert _burst_behind_a_held_step(aggregated, aggregated, batch) == expected
        assert _burst_behind_a_held_step(disaggregated, prefill, batch) == expected
        assert disaggregated.stats.attempt_failures == 0
        for engine in (aggregated.engine, prefill.engine):
            assert engine.block_manager.num_hit_tokens >= 5 * 64, "each twin reused the shared prefix"
