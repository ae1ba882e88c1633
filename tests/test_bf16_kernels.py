"""The C++ bf16 kernels against their torch references: the bf16 GEMV on every instruction set this CPU
has, paged attention over a bf16 cache, and the cache write into one; and `Bf16Linear`'s choice of kernel."""

from __future__ import annotations

import pytest
import torch
from conftest import paged_batch
from torch import nn

from kernels import torch_reference as ref
from kernels.cpu_bf16_linear import Bf16Linear, use_bf16_linears
from kernels.cpu_linear import GEMV_MAX_ROWS

# Widths that leave tails on each path (32 bf16 per AVX512-BF16 step, 16 per AVX-512, 8 per AVX2), rows of
# W that leave a partial group of 4, rows of x that leave a partial tile of 4.
SHAPES = [(1, 1, 1), (1, 5, 31), (2, 13, 33), (3, 4, 64), (4, 7, 100), (5, 9, 577), (7, 3, 15), (9, 130, 48)]


@pytest.fixture(scope="module")
def isas(extension):
    """Every instruction set the bf16 GEMV can run here; the widest is restored after the tests."""
    names = extension.bf16_gemv_isas()
    yield names
    extension.set_bf16_gemv_isa(names[0])


def gemv_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The exact sums of the bf16 values' products, in fp64."""
    y = x.double() @ w.double().T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_gemv_matches_fp64_sums_on_every_isa(extension, isas, m, n, k, with_bias):
    gen = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    expected = gemv_reference(x, w, bias)
    # fp32 rounding of k sums, each at most the sum of |products|.
    bound = 1e-6 * (x.double().abs() @ w.double().abs().T) * (k + 1) + 1e-6
    for isa in isas:
        extension.set_bf16_gemv_isa(isa)
        logits = extension.linear_bf16_gemv(x, w, bias, fp32_out=True)
        assert logits.dtype == torch.float32 and logits.shape == (m, n)
        assert ((logits.double() - expected).abs() <= bound).all(), isa
        rounded = extension.linear_bf16_gemv(x, w, bias)
        assert rounded.dtype == torch.bfloat16
        # Rounded once from the fp32 sum: within half a bf16 ulp of it.
        assert torch.equal(rounded, logits.bfloat16()), isa


def test_bf16_gemv_reads_strided_rows_and_refuses_fp32(extension):
    x = torch.randn(3, 80).bfloat16()[:, :40]
    w = torch.randn(6, 40).bfloat16()
    assert torch.equal(extension.linear_bf16_gemv(x, w), extension.linear_bf16_gemv(x.contiguous(), w))
    with pytest.raises(RuntimeError, match="bf16 x and bf16 weight"):
        extension.linear_bf16_gemv(x.float(), w)


@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [0, 5])
def test_paged_attention_over_a_bf16_cache_matches_the_reference(extension, query_dtype, window):
    # A GQA group of 3, a prefill chunk beside decodes, blocks placed at random.
    query, k_cache, v_cache, meta = paged_batch(6, 2, 64, 16, [1, 19, 1], [40, 19, 3], seed=3)
    query, k_cache, v_cache = query.to(query_dtype), k_cache.bfloat16(), v_cache.bfloat16()
    scale = 64**-0.5
    out = extension.paged_attention(
        query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, window=window
    )
    expected = ref.paged_attention(query.float(), k_cache, v_cache, meta, scale, window=window or None)
    assert out.dtype == query_dtype
    # fp32 softmax and sums on both sides; a bf16 output is one rounding of them.
    tolerance = 1e-5 if query_dtype == torch.float32 else 2**-8
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def test_write_kv_cache_stores_bf16_rows_as_they_are_and_rounds_fp32_ones(extension):
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 3 * 2 * 24, generator=gen)  # k and v are strided views into it, as in the model
    slots = torch.tensor([7, -1, 0, 33, 12])
    for rows in (qkv, qkv.bfloat16()):
        key, value = rows[:, :48].view(5, 2, 24), rows[:, 48:96].view(5, 2, 24)
        caches = [torch.zeros(3, 16, 2, 24, dtype=torch.bfloat16) for _ in range(4)]
        extension.write_kv_cache(key, value, caches[0], caches[1], slots)
        ref.write_kv_cache(key, value, caches[2], caches[3], slots)
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
        assert caches[0].view(-1, 2, 24)[1].abs().sum() == 0  # slot -1 wrote nothing


def test_bf16_linear_takes_the_gemv_for_few_rows_and_onednn_beyond(extension):
    linear = nn.Linear(40, 24).bfloat16()
    layer = Bf16Linear(linear, extension)
    assert layer.weight.data_ptr() == linear.weight.data_ptr()  # the weight as loaded, no copy
    for rows in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 40):
        x = torch.randn(rows, 40).bfloat16()
        expected = gemv_reference(x, linear.weight, linear.bias)
        out = layer(x)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.double(), expected, atol=2**-7, rtol=2**-7)
        if rows <= GEMV_MAX_ROWS:
            assert torch.equal(out, extension.linear_bf16_gemv(x, linear.weight, linear.bias))


def test_use_bf16_linears_gives_the_head_fp32_logits_and_keeps_the_tie(extension):
    model = nn.Module()
    model.proj = nn.Linear(16, 16, bias=False)
    model.embed_tokens = nn.Embedding(50, 16)
    model.lm_head = nn.Linear(16, 50, bias=False)
    model.lm_head.weight = model.embed_tokens.weight
    model = model.bfloat16()
    assert use_bf16_linears(model, extension) == 2
    assert isinstance(model.proj, Bf16Linear) and not model.proj.fp32_out
    assert model.lm_head.fp32_out and model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    logits = model.lm_head(torch.randn(GEMV_MAX_ROWS + 3, 16).bfloat16())
    assert logits.dtype == torch.float32
