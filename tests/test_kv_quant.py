"""A quantized KV cache (`--kv-cache-dtype int8 | fp8_e4m3`): the quantization's error bounds, the blocks a
memory budget holds, the flag on every front door, start-up refusals, and an engine that serves from it
(prefix caching, forks and the C++ decode stack included) close to one with a full-precision cache."""

from __future__ import annotations

import argparse

import pytest
import torch
from conftest import engine_for, random_prompts, tiny_hf_model
from test_cpu_decode_stack import forward_both_ways

from base.errors import ConfigError
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.engine import Engine, GenerateRequest
from engine.kv_cache import KVCache
from engine.model_runner import ScheduledChunk
from engine.params import SamplingParams, StoppingParams
from kernels import kv_quant
from kernels import torch_reference as ref
from serving.flags import add_engine_arguments, engine_config_from_args
from tandem.cli import build_parser
from tandem.up import tier_specs

GREEDY = SamplingParams(temperature=0.0)
QUANTIZED = [torch.int8, torch.float8_e4m3fn]


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model(7, num_heads=6, num_kv_heads=2, head_dim=64)


def rows(seed: int, shape: tuple[int, int, int] = (40, 3, 80)) -> torch.Tensor:
    """Rows with a spread of magnitudes, an outlier row and an all-zero row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.rand(shape[:-1], generator=gen).unsqueeze(-1) * 10
    x[3, 1] *= 1000
    x[5, 0] = 0
    return x


# --- quantization ----------------------------------------------------------------------------------


def test_int8_round_trip_is_within_half_a_step_and_keeps_each_row_maximum():
    x = rows(1)
    stored, scales = ref.quantize_kv(x, torch.int8)
    assert stored.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == x.shape[:-1]
    back = ref.dequantize_kv(stored, scales)
    assert ((back - x).abs() <= scales.unsqueeze(-1) * 0.5 * (1 + 1e-5)).all()
    assert stored.abs().amax(-1)[scales > 0].eq(127).all()
    assert scales[5, 0] == 0 and stored[5, 0].eq(0).all() and back[5, 0].eq(0).all()


def test_int8_rounds_half_to_even_like_torch_round():
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 3.49]])  # scale exactly 1
    stored, scales = ref.quantize_kv(x, torch.int8)
    assert scales.item() == 1.0 and stored.tolist() == [[127, 0, 2, 2, 0, -2, 3]]


def test_fp8_round_trip_is_within_its_relative_precision():
    x = rows(2)
    stored, scales = ref.quantize_kv(x, torch.float8_e4m3fn)
    back = ref.dequantize_kv(stored, scales)
    # 3 mantissa bits: half an ulp is 2**-4 of the value; below 2**-6 (subnormals) steps are 2**-9.
    bound = x.abs() * 2**-4 + scales.unsqueeze(-1) * 2**-10
    assert ((back - x).abs() <= bound * (1 + 1e-5)).all()
    assert back.abs().amax(-1).sub(x.abs().amax(-1)).abs().le(1e-5 * x.abs().amax(-1)).all()


def test_the_error_is_relative_to_each_row_not_to_the_outlier():
    """Per-token scales: the outlier row does not coarsen the other rows of its block."""
    x = rows(3)
    back = ref.dequantize_kv(*ref.quantize_kv(x, torch.int8))
    ordinary = torch.ones(x.shape[:-1], dtype=torch.bool)
    ordinary[3, 1] = False
    relative = (back - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-6)
    assert relative[ordinary].max() < 0.02


def test_the_reference_write_quantizes_into_the_slots_and_skips_padding():
    cache = torch.zeros(4, 3, 2, 8, dtype=torch.int8)
    scales = torch.zeros(4, 3, 2)
    key = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(4)) * 3
    slots = torch.tensor([7, -1, 2])
    ref.write_kv_cache(key, key, cache, cache.clone(), slots, scales, scales.clone())
    stored, expected = ref.quantize_kv(key, torch.int8)
    flat, flat_scales = cache.view(12, 2, 8), scales.view(12, 2)
    assert torch.equal(flat[7], stored[0]) and torch.equal(flat[2], stored[2])
    assert torch.equal(flat_scales[[7, 2]], expected[[0, 2]])
    assert flat.count_nonzero() == stored[[0, 2]].count_nonzero()


# --- the flag, the budget, start-up -----------------------------------------------------------------


def smollm2() -> ModelConfig:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
    )
    return ModelConfig.from_hf(config)


def test_int8_fits_at_least_3_5x_the_blocks_of_float32_in_a_memory_budget():
    model = smollm2()
    budget = CacheConfig(memory_bytes=2 << 30)
    fp32 = budget.resolve_num_blocks(model, torch.float32)
    bf16 = budget.resolve_num_blocks(model, torch.bfloat16)
    for dtype in QUANTIZED:
        blocks = budget.resolve_num_blocks(model, dtype)
        # 64 bytes of elements and a 4-byte scale per token and head against 256 bytes of fp32.
        assert blocks / fp32 >= 3.5 and blocks / fp32 == pytest.approx(256 / 68, rel=1e-3)
        assert blocks / bf16 == pytest.approx(128 / 68, rel=1e-3)
    assert budget.block_bytes(model, torch.int8) == 2 * 30 * 16 * 3 * (64 + 4)


def test_the_default_pool_holds_what_the_running_sequences_can_fill():
    """Without --kv-cache-memory the pool is the 2 GiB budget capped at --max-model-len x --max-num-seqs
    tokens (as llama.cpp's -c); a budget given is taken whole, and a large context keeps the budget."""
    from engine.model_facts import ModelFacts

    model = smollm2()

    def blocks(*argv: str) -> int:
        return ModelFacts.of(model, parse_engine_flags(*argv), None, "m").num_blocks

    fit = ("--max-model-len", "2048", "--max-num-seqs", "16")
    assert blocks(*fit, "--kv-cache-dtype", "int8") == 2048 * 16 // 16
    assert blocks(*fit) == 2048
    assert blocks("--max-model-len", "100", "--max-num-seqs", "3") == 19  # 300 tokens: 18.75 blocks
    budget_only = (2 << 30) // CacheConfig().block_bytes(model, torch.float32)
    assert blocks("--max-num-seqs", "16") == budget_only  # 8,192 x 16 fp32 tokens pass 2 GiB
    assert blocks(*fit, "--kv-cache-memory", "2GiB") == budget_only
    assert blocks(*fit, "--kv-cache-memory", "64MiB") == (64 << 20) // CacheConfig().block_bytes(
        model, torch.float32
    )


def test_an_engine_allocates_the_fitted_pool_and_says_so(hf_model, caplog):
    """The engine holds the blocks a fitted default pool resolves to, and its ready line names the pool's
    tokens beside what the sequences can fill, so an operator sees why the pool is that size."""
    config = EngineConfig(
        cache=CacheConfig(block_size=4, memory_bytes=64 << 20, fit_to_sequences=True),
        max_model_len=40,
        max_num_seqs=3,
    )
    with caplog.at_level("INFO", logger="engine.engine"):
        engine = Engine(ModelConfig.from_hf(hf_model.config), hf_model.state_dict(), None, config)
    assert engine.block_manager.num_blocks == 30  # 40 x 3 tokens over blocks of 4
    [ready] = [record for record in caplog.records if record.getMessage() == "engine ready"]
    assert (ready.kv_pool_tokens, ready.max_model_len, ready.max_num_seqs) == (120, 40, 3)


def test_an_engine_allocates_what_the_budget_counts(hf_model):
    config = ModelConfig.from_hf(hf_model.config)
    budget = CacheConfig(block_size=16, memory_bytes=8 << 20)
    engines = {
        kv: Engine(config, hf_model.state_dict(), None, EngineConfig(cache=budget, kv_cache_dtype=kv))
        for kv in ("auto", "int8")
    }
    fp32, int8 = (engines[kv].block_manager.num_blocks for kv in ("auto", "int8"))
    assert int8 / fp32 >= 3.5
    cache = engines["int8"].kv_cache
    used = sum(t.numel() * t.element_size() for t in (*cache.k, *cache.v, *cache.k_scales, *cache.v_scales))
    assert used == int8 * budget.block_bytes(config, torch.int8) <= budget.memory_bytes
    assert (
        engines["int8"].kv_dtype == torch.int8 and cache.quantized and not engines["auto"].kv_cache.quantized
    )


def parse_engine_flags(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=64)
    return engine_config_from_args(parser.parse_args(list(argv)))


def test_the_flag_sets_the_cache_dtype_and_auto_follows_the_model_dtype(capsys):
    assert parse_engine_flags().kv_dtype == torch.float32
    assert parse_engine_flags("--dtype", "bfloat16").kv_dtype == torch.bfloat16
    assert parse_engine_flags("--kv-cache-dtype", "int8").kv_dtype == torch.int8
    assert (
        parse_engine_flags("--kv-cache-dtype", "fp8_e4m3", "--dtype", "float16").kv_dtype
        == torch.float8_e4m3fn
    )
    with pytest.raises(SystemExit):
        parse_engine_flags("--kv-cache-dtype", "int4")
    assert "--kv-cache-dtype: invalid choice" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--kv-cache-dtype must be one of auto, int8, fp8_e4m3"):
        _ = EngineConfig(kv_cache_dtype="int4").kv_dtype


def test_tandem_up_gives_both_tiers_the_same_kv_cache_dtype():
    args = build_parser().parse_args(["up", "--model", "/m", "--kv-cache-dtype", "int8"])
    for spec in tier_specs(args, args.model):
        assert spec.argv[spec.argv.index("--kv-cache-dtype") + 1] == "int8"
    plain = build_parser().parse_args(["up", "--model", "/m"])
    assert all("--kv-cache-dtype" not in spec.argv for spec in tier_specs(plain, plain.model))


def test_a_dtype_the_device_cannot_do_fails_at_start(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(
        ConfigError, match=r"--kv-cache-dtype fp8_e4m3 needs a GPU of compute capability 8\.9"
    ):
        kv_quant.check_device_supports(torch.float8_e4m3fn, cuda, "triton")
    kv_quant.check_device_supports(torch.int8, cuda, "triton")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    kv_quant.check_device_supports(torch.float8_e4m3fn, cuda, "triton")
    with pytest.raises(ConfigError, match="--kv-cache-dtype int8 is not supported on device mps"):
        kv_quant.check_device_supports(torch.int8, torch.device("mps"), "torch")
    for dtype in (*QUANTIZED, torch.float32):
        kv_quant.check_device_supports(dtype, torch.device("cpu"), "torch")


# --- an engine over a quantized cache ---------------------------------------------------------------


def greedy_replies(engine: Engine, prompts: list[list[int]], max_tokens: int = 16) -> list[list[int]]:
    stopping = StoppingParams(max_tokens=max_tokens, ignore_eos=True)
    requests = [GenerateRequest(p, GREEDY, stopping) for p in prompts]
    return [seq.output_token_ids for seq in engine.generate(requests, max_num_batched_tokens=96)]


def prefill_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    seq = engine.make_sequence(prompt, GREEDY, StoppingParams(max_tokens=1))
    engine.allocate(seq, seq.num_tokens)
    hidden = engine.runner.execute([ScheduledChunk(seq, seq.num_tokens - seq.num_computed_tokens)])
    engine.free(seq)
    return engine.model.compute_logits(hidden)[0]


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_logits_over_a_quantized_cache_stay_close_to_full_precision(hf_model, kv):
    full = engine_for(hf_model, num_blocks=64)
    quantized = engine_for(hf_model, num_blocks=64, kv_cache_dtype=kv)
    # Measured on these prompts: about 1% for int8 (7 bits against each row's maximum), 4-8% for fp8 e4m3
    # (3 mantissa bits).
    tolerance = {"int8": 0.03, "fp8_e4m3": 0.12}[kv]
    for prompt in random_prompts(4, seed=11, min_len=20, max_len=90):
        expected, got = prefill_logits(full, prompt), prefill_logits(quantized, prompt)
        assert (got - expected).norm() <= tolerance * expected.norm()


def test_int8_greedy_agrees_with_full_precision_on_most_prompts(hf_model):
    """A random tiny model has near-ties a real one rarely has; still most replies agree token for token."""
    prompts = random_prompts(12, seed=3, min_len=5, max_len=60)
    full = greedy_replies(engine_for(hf_model, num_blocks=256), prompts)
    int8 = greedy_replies(engine_for(hf_model, num_blocks=256, kv_cache_dtype="int8"), prompts)
    assert sum(a == b for a, b in zip(full, int8, strict=True)) >= 8


def test_prefix_caching_over_int8_is_identical_on_and_off(hf_model):
    system = random_prompts(1, seed=5, min_len=40, max_len=40)[0]
    turns = random_prompts(3, seed=6, min_len=3, max_len=9)
    replies = {}
    for caching in (True, False):
        engine = engine_for(
            hf_model, block_size=8, num_blocks=128, kv_cache_dtype="int8", enable_prefix_caching=caching
        )
        history, replies[caching] = list(system), []
        for user in turns:
            history += user
            (reply,) = greedy_replies(engine, [history], max_tokens=6)
            replies[caching].append(reply)
            history += reply
        assert (engine.block_manager.num_hit_tokens > 0) == caching
    assert replies[True] == replies[False]


def test_a_copied_block_takes_its_scales_along():
    config = ModelConfig.from_hf(tiny_hf_model(1).config)
    cache = KVCache.allocate(config, 4, 8, torch.int8, torch.device("cpu"))
    assert len(cache.k_scales) == config.num_layers and cache.scales(0)[0].shape == (
        4,
        8,
        config.num_kv_heads,
    )
    for tensor in (*cache.k, *cache.v):
        tensor[1].fill_(7)
    for tensor in (*cache.k_scales, *cache.v_scales):
        tensor[1].fill_(0.5)
    cache.copy_block(1, 3)
    assert all(t[3].eq(7).all() for t in (*cache.k, *cache.v))
    assert all(t[3].eq(0.5).all() for t in (*cache.k_scales, *cache.v_scales))
    assert KVCache.allocate(config, 4, 8, torch.float32, torch.device("cpu")).scales(0) == (None, None)


def test_the_decode_stack_over_int8_equals_the_per_layer_path(extension, hf_model):
    engine = engine_for(hf_model, num_blocks=128, shuffle_seed=2, device="cpu", kv_cache_dtype="int8")
    assert engine.model.decode_stack is not None
    seqs = []
    for prompt in random_prompts(3, seed=9, min_len=3, max_len=50):
        seq = engine.make_sequence(prompt, GREEDY, StoppingParams(max_tokens=8))
        engine.allocate(seq, seq.num_tokens + 4)
        engine.step([ScheduledChunk(seq, seq.num_tokens)])
        seqs.append(seq)
    for _ in range(3):
        fused, per_layer = forward_both_ways(engine, [ScheduledChunk(seq, 1) for seq in seqs])
        assert torch.equal(fused, per_layer)
        engine.step([ScheduledChunk(seq, 1) for seq in seqs])


def test_the_torch_and_cpp_paths_serve_int8_alike(extension, hf_model, monkeypatch):
    """The same int8 replies from the C++ kernels and from the torch reference (no extension)."""
    prompts = random_prompts(4, seed=13, min_len=5, max_len=40)
    native = greedy_replies(engine_for(hf_model, num_blocks=64, kv_cache_dtype="int8"), prompts)
    monkeypatch.setattr("kernels.cpu_extension.load", lambda: None)
    reference = engine_for(hf_model, num_blocks=64, kv_cache_dtype="int8")
    assert reference.backend._extension is None and reference.model.decode_stack is None
    assert greedy_replies(reference, prompts) == native


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_the_key_rotation_is_orthonormal_and_keeps_every_score(head_dim):
    rotation = kv_quant.kv_rotation(head_dim)
    torch.testing.assert_close(rotation @ rotation.T, torch.eye(head_dim), rtol=0, atol=1e-6)
    assert torch.equal(rotation, kv_quant.kv_rotation(head_dim))
    gen = torch.Generator().manual_seed(head_dim)
    q, k = torch.randn(5, head_dim, generator=gen), torch.randn(7, head_dim, generator=gen)
    torch.testing.assert_close((q @ rotation) @ (k @ rotation).T, q @ k.T, rtol=1e-5, atol=1e-5)


def test_a_quantized_cache_holds_rotated_keys_and_plain_values(hf_model):
    """What the int8 cache holds, rotated back, is the fp32 cache's K (V as it is) up to half a step, in
    the first layer (later layers' inputs already differ by the quantized attention before them)."""
    prompt = random_prompts(1, seed=17, min_len=30, max_len=30)[0]
    engines = {kv: engine_for(hf_model, num_blocks=16, kv_cache_dtype=kv) for kv in ("auto", "int8")}
    for engine in engines.values():
        prefill_logits(engine, prompt)
    full, int8 = engines["auto"].kv_cache, engines["int8"].kv_cache
    assert full.rotation is None and torch.equal(int8.rotation, kv_quant.kv_rotation(64))
    k_scales, v_scales = int8.scales(0)
    keys = ref.dequantize_kv(int8.k[0], k_scales) @ int8.rotation.T
    values = ref.dequantize_kv(int8.v[0], v_scales)
    # A rotated row's error (at most half a step in each of 64 elements) has at most 8 half steps' length.
    assert ((keys - full.k[0]).norm(dim=-1) <= k_scales * 0.5 * 64**0.5 + 1e-5).all()
    assert ((values - full.v[0]).abs() <= v_scales.unsqueeze(-1) * 0.5 + 1e-5).all()
    assert (keys - full.k[0]).abs().max() > 0
