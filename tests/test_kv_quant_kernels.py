"""The C++ CPU kernels over a quantized KV cache (int8, fp8 e4m3) against the torch reference: the cache
write quantizes as `torch_reference.quantize_kv` does, and paged attention dequantizes inside the kernel,
over odd shapes (GQA groups of 3, MQA, head dims 80 and 128, blocks of 12) and mixed batches."""

from __future__ import annotations

import pytest
import torch
from conftest import paged_batch

from kernels import torch_reference as ref
from kernels.backend import TorchBackend

QUANTIZED = [torch.int8, torch.float8_e4m3fn]


def quantized_batch(dtype, heads, kv_heads, head_dim, block_size, query_lens, seq_lens, seed):
    """`paged_batch`'s mixed batch with its caches quantized to `dtype`, keys twice as large as values
    (so the two scale caches differ): `(query, (k, v, k_scales, v_scales), meta)`."""
    query, k, v, meta = paged_batch(heads, kv_heads, head_dim, block_size, query_lens, seq_lens, seed)
    k, k_scales = ref.quantize_kv(k * 2, dtype)
    v, v_scales = ref.quantize_kv(v, dtype)
    return query, (k, v, k_scales, v_scales), meta


def cpp_attention(extension, query, caches, meta, scale):
    k, v, k_scales, v_scales = caches
    tables, lens, starts = meta.block_tables, meta.seq_lens, meta.query_start_loc
    return extension.paged_attention(query, k, v, tables, lens, starts, scale, k_scales, v_scales)


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"), [(9, 3, 64, 16), (6, 1, 80, 12), (4, 4, 128, 16)]
)
def test_attention_matches_the_reference_on_mixed_batches(
    extension, dtype, heads, kv_heads, head_dim, block_size
):
    # Decodes at block edges, a whole prompt, a chunk after a cached prefix, and one longer than a row tile.
    query_lens = [1, 1, 7, 1, 23, 40]
    seq_lens = [1, block_size, 7, 3 * block_size + 5, block_size + 23, 97]
    seed = heads * 100 + head_dim + block_size
    query, caches, meta = quantized_batch(
        dtype, heads, kv_heads, head_dim, block_size, query_lens, seq_lens, seed
    )
    scale = head_dim**-0.5
    expected = ref.paged_attention(query, *caches[:2], meta, scale, *caches[2:])
    torch.testing.assert_close(
        cpp_attention(extension, query, caches, meta, scale), expected, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_decode_attention_matches_the_batched_reference(extension, dtype):
    query, caches, meta = quantized_batch(dtype, 9, 3, 64, 16, [1] * 5, [1, 16, 17, 53, 97], seed=7)
    k, v, k_scales, v_scales = caches
    expected = ref.paged_decode_attention(
        query, k, v, meta.block_tables, meta.seq_lens, 0.125, k_scales, v_scales
    )
    torch.testing.assert_close(
        cpp_attention(extension, query, caches, meta, 0.125), expected, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize(("kv_heads", "head_dim", "block_size"), [(3, 64, 16), (1, 80, 12), (2, 5, 3)])
def test_cache_write_quantizes_like_the_reference(extension, dtype, kv_heads, head_dim, block_size):
    """K and V rows as strided views of a fused qkv output; padding slots (-1) write nothing."""
    gen = torch.Generator().manual_seed(kv_heads * head_dim)
    tokens, num_blocks = 21, 8
    qkv = torch.randn(tokens, 4 * kv_heads * head_dim, generator=gen) * 5
    key = qkv[:, 2 * kv_heads * head_dim : 3 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    value = qkv[:, 3 * kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[2, 9]] = -1
    shape = (num_blocks, block_size, kv_heads, head_dim)
    expected = [torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)]
    expected += [torch.zeros(shape[:3]), torch.zeros(shape[:3])]
    got = [t.clone() for t in expected]
    ref.write_kv_cache(key, value, expected[0], expected[1], slots, expected[2], expected[3])
    extension.write_kv_cache(key, value, got[0], got[1], slots, got[2], got[3])
    for stored, want, scales in ((got[0], expected[0], expected[2]), (got[1], expected[1], expected[3])):
        # The build's fast math may round a scale, and so an element at a tie, differently: one step at most
        # (int8: the scale; fp8: 2**-3 of the value, or the subnormal step).
        wanted = ref.dequantize_kv(want, scales)
        if dtype == torch.int8:
            step = scales.unsqueeze(-1).expand_as(wanted)
        else:
            step = wanted.abs() * 2**-3 + scales.unsqueeze(-1) * 2**-9
        assert ((ref.dequantize_kv(stored, scales) - wanted).abs() <= step * 1.001).all()
        assert (stored.view(torch.uint8) != want.view(torch.uint8)).float().mean() < 0.01
    torch.testing.assert_close(got[2], expected[2], rtol=1e-6, atol=0)
    torch.testing.assert_close(got[3], expected[3], rtol=1e-6, atol=0)


def test_the_backend_routes_quantized_caches_through_the_extension(extension, monkeypatch):
    calls = []
    backend = TorchBackend(extension)
    original = backend._extension

    class Spy:
        def paged_attention(self, *args):
            calls.append("attention")
            return original.paged_attention(*args)

        def write_kv_cache(self, *args):
            calls.append("write")
            return original.write_kv_cache(*args)

    monkeypatch.setattr(backend, "_extension", Spy())
    query, caches, meta = quantized_batch(torch.int8, 4, 2, 64, 16, [1, 5], [5, 20], seed=1)
    backend.write_kv_cache(query[:, :2], query[:, 2:], *caches[:2], meta.slot_mapping, *caches[2:])
    backend.attention(query, *caches[:2], meta, 0.125, *caches[2:])
    assert calls == ["write", "attention"]
    out = backend.attention(query.bfloat16(), *caches[:2], meta, 0.125, *caches[2:])
    assert len(calls) == 3, "a bf16 query (a bf16 model's) takes the C++ kernel too"
    expected = ref.paged_attention(query.bfloat16().float(), *caches[:2], meta, 0.125, *caches[2:])
    torch.testing.assert_close(out.float(), expected, atol=2**-8, rtol=2**-8)
    backend.attention(query.half(), *caches[:2], meta, 0.125, *caches[2:])
    assert len(calls) == 3, "an fp16 query takes the torch path"


@pytest.mark.parametrize(
    ("scales", "message"),
    [(None, "needs its K scale cache"), (torch.zeros(4, 16, 1), "scales must be contiguous fp32")],
)
def test_a_quantized_cache_without_fitting_scales_is_refused(extension, scales, message):
    query, caches, meta = quantized_batch(torch.int8, 4, 2, 64, 16, [1], [5], seed=2)
    k, v, _, v_scales = caches
    with pytest.raises(RuntimeError, match=message):
        cpp_attention(extension, query, (k, v, scales, v_scales), meta, 0.1)
    with pytest.raises(RuntimeError, match=message):
        extension.write_kv_cache(query[:, :2], query[:, 2:], k, v, meta.slot_mapping, scales, v_scales)
