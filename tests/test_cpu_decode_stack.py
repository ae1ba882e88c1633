"""The C++ decoder stack computes exactly what the per-layer path computes on decode-only CPU steps, and the
model hands it those steps only; the C++ cache write equals the torch reference."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from conftest import engine_for, random_prompts, tiny_hf_model
from test_model_families import WINDOW, hf_model

from base.settings import CPU_DECODE_STACK_ENV, ONEDNN_LINEAR_ENV
from engine.model_runner import ScheduledChunk
from engine.params import SamplingParams, StoppingParams
from kernels import torch_reference as ref
from kernels.backend import TorchBackend
from kernels.cpu_decode_stack import MAX_QUERY_LEN
from kernels.cpu_linear import GEMV_MAX_ROWS
from kernels.int8_linear import GEMV_MAX_ROWS as INT8_GEMV_MAX_ROWS


def engine_with_prompts(
    kind: str, heads: int, kv_heads: int, head_dim: int, num_prompts: int, seed: int, **config_kwargs
):
    """An fp32 CPU engine whose sequences' prompts are prefilled, each with room for decode tokens."""
    hf = tiny_hf_model(seed, kind=kind, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
    engine = engine_for(hf, block_size=16, num_blocks=200, shuffle_seed=seed, device="cpu", **config_kwargs)
    seqs = []
    for prompt in random_prompts(num_prompts, seed, min_len=3, max_len=60):
        seq = engine.make_sequence(prompt, SamplingParams(temperature=0.0), StoppingParams(max_tokens=8))
        engine.allocate(seq, seq.num_tokens + 8)
        engine.step([ScheduledChunk(seq, seq.num_tokens)])
        seqs.append(seq)
    return engine, seqs


def forward_both_ways(engine, chunks) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states of one step from the stack and from the layer loop (both write the same K/V rows)."""
    model, stack = engine.model, engine.model.decode_stack
    inputs = engine.runner.prepare(chunks)
    fused = model(*inputs[:2], engine.kv_cache, inputs[2])
    model.decode_stack = None
    try:
        per_layer = model(*inputs[:2], engine.kv_cache, inputs[2])
    finally:
        model.decode_stack = stack
    return fused, per_layer


@pytest.mark.parametrize(
    ("kind", "heads", "kv_heads", "head_dim", "num_seqs"),
    [
        ("llama", 4, 2, 64, 1),
        ("llama", 6, 1, 128, 5),
        ("qwen2", 4, 2, 64, 3),
        ("qwen2", 2, 2, 80, 16),
        ("llama", 4, 2, 64, 40),  # past the GEMV's rows: oneDNN over the blocked weights
        ("qwen2", 4, 2, 64, 24),
    ],
)
def test_decode_step_equals_the_per_layer_path(extension, kind, heads, kv_heads, head_dim, num_seqs):
    """Same kernels in the same order: equal to the last bit, with and without qkv bias, GQA/MQA/MHA,
    on the GEMV's rows and past them."""
    engine, seqs = engine_with_prompts(kind, heads, kv_heads, head_dim, num_seqs, seed=num_seqs)
    assert engine.model.decode_stack is not None
    for _ in range(3):
        fused, per_layer = forward_both_ways(engine, [ScheduledChunk(seq, 1) for seq in seqs])
        assert torch.equal(fused, per_layer)
        engine.step([ScheduledChunk(seq, 1) for seq in seqs])


@pytest.mark.parametrize(
    ("quantization", "kv_cache_dtype"), [("int8", "auto"), ("int8", "int8"), ("int8", "fp8_e4m3")]
)
def test_int8_weights_with_each_kv_cache_take_the_stack_and_equal_the_per_layer_path(
    extension, quantization, kv_cache_dtype
):
    """Both halves of quantized serving at once: int8 GEMVs over a quantized KV cache, bit for bit."""
    engine, seqs = engine_with_prompts(
        "llama", 4, 2, 64, 3, seed=7, quantization=quantization, kv_cache_dtype=kv_cache_dtype
    )
    assert engine.model.decode_stack is not None
    for _ in range(3):
        fused, per_layer = forward_both_ways(engine, [ScheduledChunk(seq, 1) for seq in seqs])
        assert torch.equal(fused, per_layer)
        engine.step([ScheduledChunk(seq, 1) for seq in seqs])


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def takes_one_region(engine, rows: int) -> bool:
    """Whether the extension runs a step of `rows` rows in one parallel region (`decode_region`)."""
    stack, kv = engine.model.decode_stack, engine.kv_cache
    hidden = torch.zeros(rows, engine.model_config.hidden_size)
    return stack._extension.decode_region_applies(
        hidden, stack._layers, kv.k, kv.v, kv.k_scales, kv.v_scales, GEMV_MAX_ROWS, INT8_GEMV_MAX_ROWS
    )


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    ("kind", "heads", "kv_heads", "head_dim", "quantization", "num_seqs"),
    [
        ("llama", 4, 2, 64, "none", 1),
        ("llama", 9, 3, 64, "int8", 1),
        ("qwen2", 3, 1, 128, "none", 1),
        ("qwen2", 6, 3, 80, "int8", 5),
        ("llama", 4, 2, 64, "none", GEMV_MAX_ROWS),
        ("llama", 4, 2, 64, "int8", INT8_GEMV_MAX_ROWS),
    ],
)
def test_steps_on_the_gemvs_run_in_one_region_and_equal_the_per_layer_path(
    extension, kind, heads, kv_heads, head_dim, quantization, num_seqs, threads
):
    """A step whose rows all run on the GEMVs runs every layer in one parallel region: each thread's share of
    the GEMVs' rows, of the query heads and of the KV rows it writes gives the per-layer path's values to the
    last bit, for any split over the threads (three threads split 9 heads 3/3/3 and 6 heads 2/2/2), with a
    decode token and its draft beside other sequences' tokens."""
    engine, seqs = engine_with_prompts(
        kind, heads, kv_heads, head_dim, num_seqs, seed=heads, quantization=quantization
    )
    assert takes_one_region(engine, num_seqs)
    with torch_threads(threads):
        for _ in range(3):
            fused, per_layer = forward_both_ways(engine, [ScheduledChunk(seq, 1) for seq in seqs])
            assert torch.equal(fused, per_layer)
            engine.step([ScheduledChunk(seq, 1) for seq in seqs])
        if num_seqs < 4:
            engine.allocate(seqs[0], seqs[0].num_tokens + 4)
            drafted = [ScheduledChunk(seqs[0], 1, (5, 6, 7))] + [ScheduledChunk(seq, 1) for seq in seqs[1:]]
            assert takes_one_region(engine, num_seqs + 3)
            fused, per_layer = forward_both_ways(engine, drafted)
            assert torch.equal(fused, per_layer)


def test_one_sequence_past_its_sliding_window_equals_the_per_layer_path(extension):
    """A windowed layer's share of the heads reads only the blocks its window reaches, as the per-op path."""
    engine = engine_for(hf_model("mistral_window"), block_size=4, num_blocks=64, shuffle_seed=5, device="cpu")
    seq = engine.make_sequence(
        list(range(3, 3 + 3 * WINDOW)), SamplingParams(temperature=0.0), StoppingParams(max_tokens=8)
    )
    engine.allocate(seq, seq.num_tokens + 8)
    engine.step([ScheduledChunk(seq, seq.num_tokens)])
    assert takes_one_region(engine, 1)
    for _ in range(3):
        fused, per_layer = forward_both_ways(engine, [ScheduledChunk(seq, 1)])
        assert torch.equal(fused, per_layer)
        engine.step([ScheduledChunk(seq, 1)])


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize(("quantization", "num_seqs"), [("int8", 1), ("none", 3)])
def test_a_quantized_cache_in_one_region_equals_the_per_layer_path(
    extension, kv_cache_dtype, quantization, num_seqs, threads
):
    """Over an int8 or fp8 cache the region quantizes each (token, KV head) row as it writes it and rotates
    queries and keys with torch's matmul on one thread, so it still gives the per-layer path's bits."""
    engine, seqs = engine_with_prompts(
        "llama", 9, 3, 64, num_seqs, seed=num_seqs, quantization=quantization, kv_cache_dtype=kv_cache_dtype
    )
    assert engine.kv_cache.rotation is not None and takes_one_region(engine, num_seqs)
    with torch_threads(threads):
        for _ in range(3):
            fused, per_layer = forward_both_ways(engine, [ScheduledChunk(seq, 1) for seq in seqs])
            assert torch.equal(fused, per_layer)
            engine.step([ScheduledChunk(seq, 1) for seq in seqs])


@pytest.mark.parametrize(
    ("quantization", "rows"), [("none", GEMV_MAX_ROWS + 1), ("int8", INT8_GEMV_MAX_ROWS + 1)]
)
def test_rows_past_the_gemvs_keep_the_per_op_kernels(extension, quantization, rows):
    engine, _ = engine_with_prompts("llama", 4, 2, 64, 1, seed=2, quantization=quantization)
    assert not takes_one_region(engine, rows)


class StackSpy:
    def __init__(self, stack) -> None:
        self.stack, self.rows = stack, []

    def accepts(self, hidden, meta) -> bool:
        return self.stack.accepts(hidden, meta)

    def __call__(self, hidden, *args):
        self.rows.append(hidden.shape[0])
        return self.stack(hidden, *args)


@pytest.mark.parametrize(("onednn", "rows_taken"), [(True, [2, GEMV_MAX_ROWS + 1, 4]), (False, [2, 4])])
def test_only_decode_and_verification_steps_take_the_stack(extension, monkeypatch, onednn, rows_taken):
    """Any step of decode tokens and drafts with oneDNN linears; without them (nn.Linear) only what the GEMV
    serves. A prefill chunk longer than a draft's verification keeps the per-op path."""
    if not onednn:
        monkeypatch.setenv(ONEDNN_LINEAR_ENV, "0")
    engine, seqs = engine_with_prompts("llama", 4, 2, 64, GEMV_MAX_ROWS + 1, seed=3)
    spy = StackSpy(engine.model.decode_stack)
    engine.model.decode_stack = spy
    engine.step([ScheduledChunk(seq, 1) for seq in seqs[:2]])
    engine.step([ScheduledChunk(seq, 1) for seq in seqs])  # more rows than the GEMV takes
    engine.allocate(seqs[0], seqs[0].num_tokens + 3)
    engine.step([ScheduledChunk(seqs[0], 1, (5, 6, 7))])  # a decode token and its draft
    prompt = list(range(5, 6 + MAX_QUERY_LEN))
    mixed = engine.make_sequence(prompt, SamplingParams(), StoppingParams(max_tokens=2))
    engine.allocate(mixed, len(prompt) + 1)
    engine.step(
        [ScheduledChunk(seqs[1], 1), ScheduledChunk(mixed, len(prompt))]
    )  # a prefill chunk beside a decode
    assert spy.rows == rows_taken


def test_not_built_for_bf16_or_when_disabled(extension, monkeypatch):
    monkeypatch.setenv(CPU_DECODE_STACK_ENV, "0")
    assert engine_for(tiny_hf_model(1), device="cpu").model.decode_stack is None
    monkeypatch.delenv(CPU_DECODE_STACK_ENV)
    bf16 = engine_for(tiny_hf_model(1), dtype=torch.bfloat16, device="cpu")
    assert bf16.model.decode_stack is None


def kv_case(tokens: int, kv_heads: int, head_dim: int, seed: int):
    """K and V as strided views into a fused qkv output, and empty caches."""
    gen = torch.Generator().manual_seed(seed)
    q_size, kv_size = 3 * kv_heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=gen)
    _, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)
    shape = (tokens, kv_heads, head_dim)
    caches = [torch.zeros(8, 4, kv_heads, head_dim) for _ in range(4)]
    return key.view(shape), value.view(shape), caches


def test_cache_write_equals_the_reference_and_skips_padding_rows(extension):
    key, value, (k_got, v_got, k_ref, v_ref) = kv_case(5, 2, 64, seed=0)
    slots = torch.tensor([7, -1, 0, 31, 12])
    extension.write_kv_cache(key, value, k_got, v_got, slots)
    ref.write_kv_cache(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_got, k_ref) and torch.equal(v_got, v_ref)
    assert k_got.view(32, 2, 64).abs().sum(dim=(1, 2)).count_nonzero() == 4


@pytest.mark.parametrize(
    ("slots", "message"),
    [
        (torch.tensor([0, 32]), "slot 32 is outside the cache's 32 slots"),
        (torch.tensor([0, 1], dtype=torch.int32), "int64"),
        (torch.tensor([0]), "int64 \\[T\\]"),
    ],
)
def test_cache_write_refuses_slots_it_cannot_write(extension, slots, message):
    key, value, (k_cache, v_cache, _, _) = kv_case(2, 2, 64, seed=1)
    with pytest.raises(RuntimeError, match=message):
        extension.write_kv_cache(key, value, k_cache, v_cache, slots)


def test_backend_writes_fp32_and_bf16_in_cpp_and_other_dtypes_through_the_reference(extension, monkeypatch):
    calls = []
    backend = TorchBackend(extension)
    original = backend._extension

    class Spy:
        def write_kv_cache(self, *args):
            calls.append(args[0].dtype)
            return original.write_kv_cache(*args)

    monkeypatch.setattr(backend, "_extension", Spy())
    key, value, (k_cache, v_cache, _, _) = kv_case(2, 2, 64, seed=2)
    slots = torch.tensor([3, 9])
    backend.write_kv_cache(key, value, k_cache, v_cache, slots)
    k16, v16 = k_cache.bfloat16(), v_cache.bfloat16()
    backend.write_kv_cache(key.bfloat16(), value.bfloat16(), k16, v16, slots)
    assert torch.equal(k16.view(32, 2, 64)[9], key[1].bfloat16())
    half = k_cache.half(), v_cache.half()
    backend.write_kv_cache(key.half(), value.half(), *half, slots)
    assert calls == [torch.float32, torch.bfloat16]
    assert torch.equal(half[0].view(32, 2, 64)[9], key[1].half())
