"""The C++ decode stack runs every dense family's layers, not only Llama's, and computes what their per-op
path computes, bit for bit: Qwen3's q/k norms, Gemma 3's four norms, GELU-tanh, `query_pre_attn_scalar`,
sliding and full layers with their own RoPE tables and KV groups (several block tables a step), and
Phi-3's partial rotary, over fp32 and int8 weights.

GELU-tanh is ATen's own vectorised kernel on both paths (the region calls it directly, in the one chunk the
per-op path runs it in at those sizes), so Gemma 3 is held to equality too, not to a tolerance. Greedy
tokens through the engine, which takes the stack for every decode step, equal Hugging Face's.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, engine_for, hf_greedy, random_prompts
from test_cpu_decode_stack import StackSpy, forward_both_ways, takes_one_region, torch_threads
from test_model_families import COMMON, GREEDY, WINDOW, hf_model
from test_moe_families import tiny_moe
from transformers import AutoModelForCausalLM, Phi3Config

from engine.engine import GenerateRequest
from engine.model_runner import ScheduledChunk
from engine.params import SamplingParams, StoppingParams
from kernels.cpu_linear import GEMV_MAX_ROWS
from kernels.int8_linear import GEMV_MAX_ROWS as INT8_GEMV_MAX_ROWS

# Gemma 3 with sliding and full layers (three KV groups), Qwen3 with one sliding layer (two groups), Qwen3
# and Phi-3 (half-rotary, every layer windowed) over one group, and a Phi-4-mini-like 0.75 partial rotary.
FAMILIES = ["gemma3_text", "gemma3", "qwen3", "qwen3_window", "phi3_window", "phi4_mini"]


def family_model(name: str) -> torch.nn.Module:
    """`test_model_families`' tiny model of the family, or a Phi-4-mini-shaped one (rotary 0.75)."""
    if name != "phi4_mini":
        return hf_model(name)
    torch.manual_seed(11)
    rope = {"rope_theta": 10_000.0, "partial_rotary_factor": 0.75}
    config = Phi3Config(**COMMON, rope_parameters=rope)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()


def engine_with_prompts(name: str, num_prompts: int, seed: int, **config_kwargs):
    """An fp32 CPU engine over the family's tiny model whose prompts (3 to 60 tokens: most past the window
    of 20) are prefilled, each with room for decode tokens; blocks of 4 so sliding groups free some."""
    engine = engine_for(
        family_model(name), block_size=4, num_blocks=1500, shuffle_seed=seed, device="cpu", **config_kwargs
    )
    seqs = []
    for prompt in random_prompts(num_prompts, seed, min_len=3, max_len=60):
        seq = engine.make_sequence(prompt, SamplingParams(temperature=0.0), StoppingParams(max_tokens=8))
        engine.allocate(seq, seq.num_tokens + 8)
        engine.step([ScheduledChunk(seq, seq.num_tokens)])
        seqs.append(seq)
    return engine, seqs


def decode_both_ways(engine, seqs, steps: int = 3) -> None:
    """`steps` decode steps of every sequence, each equal on the stack and on the per-op path."""
    for _ in range(steps):
        chunks = [ScheduledChunk(seq, 1) for seq in seqs]
        fused, per_layer = forward_both_ways(engine, chunks)
        assert torch.equal(fused, per_layer)
        engine.step(chunks)


def test_every_dense_family_takes_the_stack(extension):
    """Each family's model is given the stack, and decode steps go through it (no silent fallback); a
    mixture of experts keeps the per-op path."""
    for name in FAMILIES:
        engine, seqs = engine_with_prompts(name, 2, seed=1)
        spy = StackSpy(engine.model.decode_stack)
        engine.model.decode_stack = spy
        engine.step([ScheduledChunk(seq, 1) for seq in seqs])
        assert spy.rows == [2], name
    for kind in ("mixtral", "qwen3_moe"):
        assert engine_for(tiny_moe(kind, seed=0), num_blocks=8, device="cpu").model.decode_stack is None


def test_the_layers_say_what_each_family_computes(extension):
    """What C++ reads: Gemma's KV groups, RoPE tables, scale and windows per layer; a partial rotary."""
    gemma = engine_with_prompts("gemma3_text", 1, seed=2)[0].model.decode_stack
    assert [w.kv_group for w in gemma._layers] == [1, 2, 0]  # full attention's group first
    assert [w.rope for w in gemma._layers] == [0, 0, 1] and len(gemma._rope_keys) == 2
    assert [w.window for w in gemma._layers] == [WINDOW, WINDOW, 0]
    assert all(w.scale == 40**-0.5 for w in gemma._layers)
    phi = engine_with_prompts("phi4_mini", 1, seed=2)[0].model.decode_stack
    assert [w.rotary_dim for w in phi._layers] == [24] * 3  # 0.75 of 32


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("name", FAMILIES)
def test_decode_steps_equal_the_per_op_path(extension, name, quantization):
    """Several sequences of different lengths, most past their window, over several decode steps."""
    engine, seqs = engine_with_prompts(name, 5, seed=len(name), quantization=quantization)
    assert takes_one_region(engine, len(seqs))
    decode_both_ways(engine, seqs)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    ("name", "quantization", "kv_cache_dtype"),
    [("gemma3_text", "int8", "auto"), ("gemma3_text", "int8", "int8"), ("qwen3_window", "none", "fp8_e4m3")],
)
def test_one_region_equals_the_per_op_path_for_any_thread_split(
    extension, name, quantization, kv_cache_dtype, threads
):
    """Any split of the heads and rows over threads, a quantized cache (one thread ropes and rotates every
    head, norms included), and a decode token's draft beside other sequences' tokens."""
    engine, seqs = engine_with_prompts(
        name, 3, seed=threads, quantization=quantization, kv_cache_dtype=kv_cache_dtype
    )
    assert takes_one_region(engine, len(seqs))
    with torch_threads(threads):
        decode_both_ways(engine, seqs, steps=2)
        engine.allocate(seqs[0], seqs[0].num_tokens + 4)
        drafted = [ScheduledChunk(seqs[0], 1, (5, 6, 7))] + [ScheduledChunk(seq, 1) for seq in seqs[1:]]
        fused, per_layer = forward_both_ways(engine, drafted)
        assert torch.equal(fused, per_layer)


@pytest.mark.parametrize(
    ("quantization", "rows"), [("none", GEMV_MAX_ROWS + 4), ("int8", INT8_GEMV_MAX_ROWS + 4)]
)
def test_rows_past_the_gemvs_run_the_per_op_kernels_and_equal_the_per_op_path(extension, quantization, rows):
    """Past the GEMVs' rows (oneDNN, the int8 GEMM) the stack runs the kernels one op at a time, GELU too."""
    engine, seqs = engine_with_prompts("gemma3_text", rows, seed=4, quantization=quantization)
    assert not takes_one_region(engine, rows)
    decode_both_ways(engine, seqs, steps=2)


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("name", ["gemma3_text", "qwen3_window", "phi4_mini"])
def test_greedy_tokens_through_the_stack_equal_hugging_face(extension, name, quantization):
    """The engine decodes through the stack; fp32 weights give Hugging Face's tokens, int8 weights the tokens
    of the same engine without the stack."""
    prompts = random_prompts(3, seed=9, min_len=25, max_len=50, vocab=TINY_VOCAB)
    stopping = StoppingParams(max_tokens=10, ignore_eos=True)
    requests = [GenerateRequest(p, GREEDY, stopping) for p in prompts]
    engine = engine_for(
        family_model(name), block_size=4, num_blocks=400, device="cpu", quantization=quantization
    )
    spy = StackSpy(engine.model.decode_stack)
    engine.model.decode_stack = spy
    outputs = [seq.output_token_ids for seq in engine.generate(requests, max_num_seqs=3)]
    assert len(spy.rows) >= 9
    if quantization == "none":
        expected = [hf_greedy(family_model(name), prompt, 10) for prompt in prompts]
    else:
        reference = engine_for(
            family_model(name), block_size=4, num_blocks=400, device="cpu", quantization="int8"
        )
        reference.model.decode_stack = None
        expected = [seq.output_token_ids for seq in reference.generate(requests, max_num_seqs=3)]
    assert outputs == expected
