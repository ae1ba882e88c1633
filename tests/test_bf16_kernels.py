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


def assert_bf16_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal to the reference but for rare last-bit flips (an fp32 reduction order or `exp` that a bf16
    rounding shows), never more than one bf16 step apart."""
    assert got.dtype == expected.dtype == torch.bfloat16 and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=1e-6)
    assert (got == expected).float().mean() >= 0.99


@pytest.mark.parametrize("rows", [1, 5, 70])
@pytest.mark.parametrize("with_residual", [False, True])
def test_bf16_rms_norm_matches_the_reference(extension, rows, with_residual):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 200, generator=gen).bfloat16()[:, :96]  # strided rows, as a view would be
    weight = torch.randn(96, generator=gen).bfloat16()
    residual = torch.randn(rows, 96, generator=gen).bfloat16() if with_residual else None
    got = extension.rms_norm_bf16(x, weight, 1e-5, residual)
    expected = ref.rms_norm(x, weight, 1e-5, residual)
    assert_bf16_close(got[0], expected[0])
    assert torch.equal(got[1], expected[1])  # the residual sum is one rounding on both sides


@pytest.mark.parametrize("tokens", [1, 37])
def test_bf16_rope_matches_the_reference_exactly(extension, tokens):
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (6 + 2 + 2) * 64, generator=gen).bfloat16()
    q, k = qkv[:, : 6 * 64].view(tokens, 6, 64), qkv[:, 6 * 64 : 8 * 64].view(tokens, 2, 64)
    angles = torch.randn(tokens, 64, generator=gen)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    got = extension.apply_rope_bf16(q, k, cos, sin)
    for a, b in zip(got, ref.apply_rope(q, k, cos, sin), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rows", [1, 9])
def test_bf16_silu_and_mul_matches_the_reference(extension, rows):
    gate_up = (torch.randn(rows, 2 * 300, generator=torch.Generator().manual_seed(rows)) * 4).bfloat16()
    assert_bf16_close(extension.silu_and_mul_bf16(gate_up), ref.silu_and_mul(gate_up))


def test_backend_routes_bf16_small_ops_through_the_extension(extension, monkeypatch):
    from kernels.backend import TorchBackend

    calls = []
    backend = TorchBackend(extension)

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(extension, name)

    monkeypatch.setattr(backend, "_extension", Spy())
    x = torch.randn(3, 32).bfloat16()
    backend.rms_norm(x, torch.ones(32).bfloat16(), 1e-5, x)
    backend.silu_and_mul(x)
    q = x.view(3, 2, 16)
    backend.apply_rope(q, q, x[:, :16], x[:, :16])
    backend.rms_norm(x.half(), torch.ones(32).half(), 1e-5)
    assert calls == ["rms_norm_bf16", "silu_and_mul_bf16", "apply_rope_bf16"]
