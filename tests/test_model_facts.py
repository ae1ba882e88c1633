"""`ModelFacts`: what the decode front door knows of the model, read without its weights.

`ModelFacts.load` must describe a checkpoint exactly as the engine that loads it does, field by field
(EOS ids merged from config and tokenizer, the max_model_len rule, the KV pool sized for the KV dtype),
or the front door would accept what the engine cannot serve; and it must never read the weights.
"""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
import torch
from conftest import save_tiny_model
from tiny_tokenizer import ENDOFTEXT_ID, IM_END_ID, TINY_VOCAB_SIZE

from base.errors import InvalidRequestError
from engine import checkpoint_stream
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.model_facts import ModelFacts
from engine.params import SamplingParams, StoppingParams

GREEDY = SamplingParams(temperature=0.0)
# An EOS id the model's config names but the tokenizer does not: the facts must merge both.
CONFIG_EOS_ID = 7


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("facts-model")
    save_tiny_model(directory, seed=3)
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = CONFIG_EOS_ID
    config_path.write_text(json.dumps(config))
    return directory


# Pools sized by a memory budget, so num_blocks depends on the KV dtype (int8 blocks are smaller).
BUDGET = CacheConfig(block_size=8, memory_bytes=1 << 20)
CONFIGS = {
    "full precision": EngineConfig(cache=BUDGET, max_model_len=300, max_num_seqs=5),
    "int8 weights and KV": EngineConfig(
        cache=BUDGET, quantization="int8", kv_cache_dtype="int8", enable_prefix_caching=False
    ),
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_loaded_facts_equal_the_engines_field_by_field(model_dir, config):
    engine = Engine.from_pretrained(model_dir, config)
    loaded = ModelFacts.load(model_dir, config)
    for item in fields(ModelFacts):
        if item.compare:
            assert getattr(loaded, item.name) == getattr(engine.facts, item.name), item.name
    assert loaded == engine.facts
    assert loaded.eos_token_ids == {CONFIG_EOS_ID, IM_END_ID, ENDOFTEXT_ID}
    assert loaded.num_blocks == engine.num_blocks
    # The tokenizer is not compared as an object; two loads of it must behave alike.
    text = "Hello, world! 東京"
    assert loaded.tokenizer.encode(text) == engine.facts.tokenizer.encode(text)
    assert loaded.tokenizer.eos_token_ids == engine.facts.tokenizer.eos_token_ids


def test_the_kv_dtype_sizes_the_pool(model_dir):
    """The comparison above would pass vacuously if both sides ignored the KV dtype."""
    plain = ModelFacts.load(model_dir, CONFIGS["full precision"])
    int8 = ModelFacts.load(model_dir, CONFIGS["int8 weights and KV"])
    assert int8.kv_dtype == torch.int8 and int8.quantization == "int8"
    assert int8.num_blocks > plain.num_blocks


def test_loading_facts_never_reads_the_weights(model_dir, monkeypatch):
    def no_weights(*args, **kwargs):
        raise AssertionError("ModelFacts.load read the weights")

    monkeypatch.setattr(checkpoint_stream, "safe_open", no_weights)
    facts = ModelFacts.load(model_dir, EngineConfig(), model_name="served")
    assert facts.model_name == "served" and facts.vocab_size == TINY_VOCAB_SIZE


def test_the_engine_shares_its_tokenizer_with_its_facts(model_dir):
    """A chat template set through the facts (--chat-template) is the one the engine's tokenizer has."""
    engine = Engine.from_pretrained(model_dir, EngineConfig(cache=CacheConfig(num_blocks=4)))
    assert engine.facts.tokenizer is engine.tokenizer
    assert engine.facts.model_name == model_dir.name


def facts(max_model_len: int = 64, block_size: int = 8, num_blocks: int = 4) -> ModelFacts:
    return ModelFacts(
        model_name="m",
        vocab_size=100,
        max_model_len=max_model_len,
        eos_token_ids=frozenset({0}),
        block_size=block_size,
        num_blocks=num_blocks,
        dtype=torch.float32,
        kv_dtype=torch.float32,
        quantization="none",
        enable_prefix_caching=True,
        max_num_seqs=4,
    )


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "message"),
    [
        ([], 1, "the prompt has no tokens"),
        ([5, 100], 1, r"token id 100 is outside the vocabulary \[0, 100\)"),
        ([-1], 1, r"token id -1 is outside the vocabulary \[0, 100\)"),
        ([5] * 64, 1, "prompt has 64 tokens; max_model_len is 64"),
        ([5] * 60, 5, r"prompt \(60 tokens\) \+ max_tokens \(5\) exceeds max_model_len \(64\)"),
    ],
)
def test_make_sequence_refuses_what_the_model_cannot_serve(prompt, max_tokens, message):
    with pytest.raises(InvalidRequestError, match=f"^{message}$"):
        facts().make_sequence(prompt, GREEDY, StoppingParams(max_tokens=max_tokens))


def test_make_sequence_validates_sampling_and_stopping():
    with pytest.raises(InvalidRequestError, match="temperature"):
        facts().make_sequence([5], SamplingParams(temperature=-1.0), StoppingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        facts().make_sequence([5], GREEDY, StoppingParams(max_tokens=0))


def test_make_sequence_wraps_a_valid_request():
    seq = facts().make_sequence([5] * 60, GREEDY, StoppingParams(max_tokens=4), "req", cache_salt="s")
    assert (seq.request_id, seq.num_prompt_tokens, seq.cache_salt) == ("req", 60, "s")
    assert facts().make_sequence([5], GREEDY, StoppingParams(max_tokens=1)).request_id


def test_blocks_for_tokens_rounds_up_to_whole_blocks():
    assert [facts(block_size=8).blocks_for_tokens(n) for n in (0, 1, 8, 9, 16, 17)] == [0, 1, 1, 2, 2, 3]
