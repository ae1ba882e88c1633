"""Every model family in the registry against Hugging Face: greedy token-exact parity on tiny random
configs, and the refusals of what tandem cannot run.

Each config has several layers, GQA, a head size other than hidden/heads where the family allows one,
and (for the families that slide) a window shorter than the prompts, so tokens leave the window while
the prompt is still being prefilled in chunks and while decoding. Batches mix prefill chunks with
decodes; the prefix-cache case runs prompts that share long prefixes in two waves so the second wave
starts from cached blocks.
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import TINY_VOCAB, engine_for, hf_greedy
from transformers import (
    AutoModelForCausalLM,
    Gemma3Config,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from base.errors import UnsupportedModelError
from engine.config import ModelConfig
from engine.engine import GenerateRequest
from engine.models import FAMILIES
from engine.params import SamplingParams, StoppingParams

GREEDY = SamplingParams(temperature=0.0)
WINDOW = 20
COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=128,
    intermediate_size=192,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.08,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)
GEMMA_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
}
GEMMA_TEXT = dict(
    COMMON,
    head_dim=48,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    rope_parameters=GEMMA_ROPE,
    query_pre_attn_scalar=40,
)
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10_000.0,
    "short_factor": [1.0 + 0.1 * i for i in range(8)],
    "long_factor": [2.0 + 0.5 * i for i in range(8)],
}

# name -> the Hugging Face config of a tiny model of that family.
CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON, head_dim=48),
    "qwen2": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),
    "qwen2_window": lambda: Qwen2Config(
        **COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    ),
    "mistral_window": lambda: MistralConfig(**COMMON, head_dim=48, sliding_window=WINDOW),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=48),
    "qwen3_window": lambda: Qwen3Config(
        **COMMON, head_dim=48, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2
    ),
    "gemma3_text": lambda: Gemma3TextConfig(**GEMMA_TEXT),
    "gemma3": lambda: Gemma3Config(
        text_config=GEMMA_TEXT,
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        mm_tokens_per_image=4,
    ),
    "phi3_window": lambda: Phi3Config(
        **COMMON,
        sliding_window=WINDOW,
        rope_parameters={"rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
    ),
    "phi3_longrope": lambda: Phi3Config(
        **(COMMON | {"max_position_embeddings": 384}),
        original_max_position_embeddings=96,
        rope_parameters=dict(LONGROPE, partial_rotary_factor=0.5),
    ),
}


@functools.cache
def hf_model(name: str) -> torch.nn.Module:
    """The family's tiny random model, its norm weights jittered so that a norm of the wrong kind
    (`w` for `1 + w`, or one left out) changes the tokens."""
    torch.manual_seed(sorted(CONFIGS).index(name))
    model = AutoModelForCausalLM.from_config(
        CONFIGS[name](), dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.add_(torch.randn_like(param) * 0.3)
    return model.eval()


@functools.cache
def reference(name: str, prompt: tuple[int, ...], max_new: int) -> list[int]:
    return hf_greedy(hf_model(name), list(prompt), max_new)


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    """Pairs of prompts that share a 40-token prefix (longer than the window), of 45 to 70 tokens."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, TINY_VOCAB, (n,), generator=gen).tolist()

    prompts = []
    for length in (45, 58, 70):
        prefix = tokens(40)
        prompts += [prefix + tokens(length - 40), prefix + tokens(length - 41)]
    return prompts


def run_waves(engine, waves: list[list[list[int]]], max_new: int) -> list[list[int]]:
    """Each wave generated to the end before the next starts (so a later wave can hit the cache)."""
    outputs = []
    for prompts in waves:
        stopping = StoppingParams(max_tokens=max_new, ignore_eos=True)
        requests = [GenerateRequest(p, GREEDY, stopping) for p in prompts]
        seqs = engine.generate(requests, max_num_batched_tokens=23, max_num_seqs=4)
        outputs += [seq.output_token_ids for seq in seqs]
    return outputs


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no_cache", "prefix_cache"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_matches_hf(name: str, prefix_caching: bool) -> None:
    hf = hf_model(name)
    prompts = shared_prefix_prompts(seed=len(name))
    waves = [prompts[0::2], prompts[1::2]]
    max_new = 8
    engine = engine_for(hf, block_size=8, num_blocks=96, shuffle_seed=3, enable_prefix_caching=prefix_caching)
    outputs = run_waves(engine, waves, max_new)
    for prompt, output in zip(waves[0] + waves[1], outputs, strict=True):
        assert output == reference(name, tuple(prompt), max_new), f"{name}: prompt of {len(prompt)} diverged"
    if any(ModelConfig.from_hf(hf.config).layer_windows):
        assert min(map(len, prompts)) > WINDOW
    assert (engine.block_manager.num_hit_tokens > 0) == prefix_caching
    assert engine.block_manager.num_free_blocks == 96


def test_registry_covers_the_families() -> None:
    assert {config().model_type for config in CONFIGS.values()} <= set(FAMILIES)


@pytest.mark.parametrize(
    ("name", "windows"),
    [
        ("llama", (None, None, None)),
        ("qwen2", (None, None, None)),
        ("qwen2_window", (None, WINDOW, WINDOW)),
        ("qwen3_window", (None, None, WINDOW)),
        ("mistral_window", (WINDOW, WINDOW, WINDOW)),
        ("phi3_window", (WINDOW, WINDOW, WINDOW)),
        ("gemma3_text", (WINDOW, WINDOW, None)),
        ("gemma3", (WINDOW, WINDOW, None)),
    ],
)
def test_layer_windows_follow_each_family(name: str, windows: tuple) -> None:
    assert ModelConfig.from_hf(CONFIGS[name]()).layer_windows == windows


def test_mistral_ignores_layer_types_as_hugging_face_does() -> None:
    config = MistralConfig(**COMMON, sliding_window=WINDOW, layer_types=["full_attention"] * 3)
    assert ModelConfig.from_hf(config).layer_windows == (WINDOW,) * 3


def test_gemma3_checkpoint_reads_its_text_part() -> None:
    config = ModelConfig.from_hf(CONFIGS["gemma3"]())
    assert config.model_type == "gemma3"
    assert (config.head_dim, config.hidden_act, config.tie_word_embeddings) == (48, "gelu_pytorch_tanh", True)


def test_gemma_final_logit_softcapping_matches_hf() -> None:
    """Gemma 3 sets no cap, but a config that does gets Hugging Face's capped logits (and logprobs)."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(**(GEMMA_TEXT | {"final_logit_softcapping": 3.0}))
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model = engine_for(hf, num_blocks=8).model
    hidden = torch.randn(3, config.hidden_size)
    with torch.no_grad():
        expected = torch.tanh(hf.lm_head(hidden) / 3.0) * 3.0
    torch.testing.assert_close(model.compute_logits(hidden), expected)


def test_longrope_serves_its_short_context_only() -> None:
    assert ModelConfig.from_hf(CONFIGS["phi3_longrope"]()).max_position_embeddings == 96


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_decode_stack_for_every_dense_family(name: str) -> None:
    """The C++ decode stack computes every dense family's layers (their norms, windows, RoPE tables and KV
    groups); `test_cpu_decode_stack_families` holds it to their per-op path."""
    if engine_for(hf_model("llama"), num_blocks=8).model.decode_stack is None:
        pytest.skip("no decode stack on this platform (no C++ kernels, or not fp32 on the CPU)")
    assert engine_for(hf_model(name), num_blocks=8).model.decode_stack is not None


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (GPT2Config(), "model_type 'gpt2'"),
        (LlamaConfig(**COMMON, hidden_act="relu"), "hidden_act 'relu'"),
        (Gemma3TextConfig(**(GEMMA_TEXT | {"hidden_activation": "relu"})), "hidden_activation 'relu'"),
        (
            LlamaConfig(**COMMON, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
            "rope_type 'dynamic'",
        ),
        (Gemma3TextConfig(**(GEMMA_TEXT | {"attn_logit_softcapping": 50.0})), "attn_logit_softcapping"),
    ],
)
def test_refusals_name_the_field(config, field: str) -> None:
    with pytest.raises(UnsupportedModelError, match=field) as refusal:
        ModelConfig.from_hf(config)
    assert "\n" not in str(refusal.value)


def test_unknown_model_type_lists_what_runs() -> None:
    with pytest.raises(UnsupportedModelError) as refusal:
        ModelConfig.from_hf(GPT2Config())
    assert all(model_type in str(refusal.value) for model_type in FAMILIES)
