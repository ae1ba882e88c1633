"""Weight-only int8: the quantizer follows the spec to the rounding mode, and the C++ kernels (the GEMV and
the GEMM, each on every instruction set this CPU has) compute what the torch reference computes over odd
shapes; `Int8Linear` picks its path by row count and falls back to the reference."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from kernels import int8_linear
from kernels.int8_linear import Int8Linear, dequantize, int8_linear_reference, quantize_per_channel

# (out_features, in_features): below and above one vector, no multiple of 8, 16 or 64, and a model's.
SHAPES = [(5, 3), (17, 13), (45, 77), (130, 200), (67, 1000), (960, 576)]
ISAS = ["avx512", "avx2", "portable"]


def int8_case(rows: int, out_features: int, in_features: int, bias: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    qweight, scale = quantize_per_channel(weight)
    return x, qweight, scale, torch.randn(out_features, generator=gen) if bias else None


def exact(x, qweight, scale, bias) -> torch.Tensor:
    """`x (q * scale)^T + b` in fp64, so each kernel is held to fp32 rounding, not to another's order."""
    weight = qweight.double() * scale.double().unsqueeze(1)
    return nn.functional.linear(x.double(), weight, None if bias is None else bias.double()).float()


def test_quantizer_scales_by_the_row_maximum_and_rounds_half_to_even():
    weight = torch.tensor(
        [
            [127.0, 63.5, -0.5, 1.5, 2.5, -2.5],  # scale 1: the halves go to the even neighbour
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # an all-zero row stays zero
            [-2.54, 0.01, 0.03, 1.27, 0.0, 0.0],  # scale 0.02, the maximum is negative
        ]
    )
    qweight, scale = quantize_per_channel(weight)
    assert qweight.dtype == torch.int8 and scale.dtype == torch.float32
    assert qweight[0].tolist() == [127, 64, 0, 2, 2, -2]
    assert qweight[1].tolist() == [0] * 6 and scale[1] == 0
    assert qweight[2].tolist() == [-127, 0, 2, 64, 0, 0]
    torch.testing.assert_close(scale, torch.tensor([1.0, 0.0, 0.02]))


def test_quantizer_error_is_at_most_half_a_step_and_codes_stay_within_127():
    weight = torch.randn(64, 300, generator=torch.Generator().manual_seed(1)) * 3
    qweight, scale = quantize_per_channel(weight)
    assert qweight.abs().max() == 127 and qweight.min() >= -127
    step = scale.unsqueeze(1)
    assert ((dequantize(qweight, scale) - weight).abs() <= step / 2 + 1e-6).all()
    expected = torch.round(weight / step).clamp(-127, 127)
    assert torch.equal(qweight.float(), expected)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 31, 32])
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_gemv_matches_the_reference(extension, rows, out_features, in_features):
    x, qweight, scale, bias = int8_case(
        rows, out_features, in_features, rows % 2 == 1, seed=rows + in_features
    )
    got = extension.linear_int8_gemv(x, qweight, scale, bias)
    torch.testing.assert_close(got, exact(x, qweight, scale, bias), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got, int8_linear_reference(x, qweight, scale, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("isa", ISAS)
def test_gemv_every_instruction_set_matches_the_reference(extension, isa):
    """Each ISA's tiles, including the one- and two-row ones that stream W row by row with several sums
    per row, over K long enough to unroll and with a tail."""
    best = extension.gemv_isa()
    try:
        extension.set_gemv_isa(isa)
    except RuntimeError as exc:
        assert "cannot run" in str(exc)
        pytest.skip(f"this CPU has no {isa}")
    try:
        assert extension.gemv_isa() == isa
        few_rows = [(1, (67, 1000)), (2, (130, 200)), (2, (17, 77))]
        cases = [*zip([1, 3, 4, 7, 20, 40], SHAPES, strict=True), *few_rows]
        for rows, (out_features, in_features) in cases:
            x, qweight, scale, bias = int8_case(rows, out_features, in_features, bias=True, seed=rows)
            got = extension.linear_int8_gemv(x, qweight, scale, bias)
            torch.testing.assert_close(got, exact(x, qweight, scale, bias), rtol=1e-5, atol=1e-4)
    finally:
        extension.set_gemv_isa(best)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 2])
def test_decode_rows_read_w_in_groups_with_a_partial_last_one(extension, isa, rows):
    """A decode step's one or two rows of x against 4-row groups of W (AVX-512) and a last partial group,
    over K with a tail past the unrolled steps and long rows of x (5000 features, 20 KiB)."""
    best = extension.gemv_isa()
    try:
        extension.set_gemv_isa(isa)
    except RuntimeError as exc:
        assert "cannot run" in str(exc)
        pytest.skip(f"this CPU has no {isa}")
    try:
        for out_features, in_features in [(11, 5000), (7, 93)]:
            x, qweight, scale, bias = int8_case(rows, out_features, in_features, bias=True, seed=in_features)
            got = extension.linear_int8_gemv(x, qweight, scale, bias)
            torch.testing.assert_close(got, exact(x, qweight, scale, bias), rtol=1e-5, atol=1e-4)
    finally:
        extension.set_gemv_isa(best)


# Around the GEMM's register tiles (12 rows on AVX-512, 6 on AVX2, 4 portable) and the GEMV's limit.
GEMM_ROWS = [1, 5, 6, 7, 12, 13, 25, int8_linear.GEMV_MAX_ROWS + 1, 100]


@pytest.mark.parametrize("rows", GEMM_ROWS)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_gemm_matches_the_reference(extension, rows, out_features, in_features):
    x, qweight, scale, bias = int8_case(rows, out_features, in_features, rows % 2 == 0, seed=rows * 31)
    got = extension.linear_int8_gemm(x, qweight, scale, bias)
    torch.testing.assert_close(got, exact(x, qweight, scale, bias), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got, int8_linear_reference(x, qweight, scale, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("isa", ISAS)
def test_gemm_every_instruction_set_matches_the_reference(extension, isa):
    """Each ISA's panels and tiles, with and without bias, over shapes whose N, K and rows are no
    multiple of its panel width, vector width or tile height, and a weight many conversion chunks tall."""
    best = extension.gemv_isa()
    try:
        extension.set_gemv_isa(isa)
    except RuntimeError as exc:
        assert "cannot run" in str(exc)
        pytest.skip(f"this CPU has no {isa}")
    try:
        cases = [*zip([7, 13, 49, 26, 5, 61], SHAPES, strict=True), (37, (3000, 96)), (50, (40, 2050))]
        for i, (rows, (out_features, in_features)) in enumerate(cases):
            x, qweight, scale, bias = int8_case(rows, out_features, in_features, bias=i % 2 == 0, seed=i)
            got = extension.linear_int8_gemm(x, qweight, scale, bias)
            torch.testing.assert_close(got, exact(x, qweight, scale, bias), rtol=1e-5, atol=1e-4)
    finally:
        extension.set_gemv_isa(best)


@pytest.mark.parametrize("entry", ["linear_int8_gemv", "linear_int8_gemm"])
def test_kernels_read_strided_rows_of_x_and_take_no_rows(extension, entry):
    kernel = getattr(extension, entry)
    wide = torch.randn(6, 90, generator=torch.Generator().manual_seed(5))
    x = wide[:, 7:80]
    _, qweight, scale, _ = int8_case(1, 21, 73, bias=False, seed=6)
    torch.testing.assert_close(
        kernel(x, qweight, scale, None), exact(x, qweight, scale, None), rtol=1e-5, atol=1e-4
    )
    assert kernel(torch.empty(0, 73), qweight, scale, None).shape == (0, 21)


@pytest.mark.parametrize("entry", ["linear_int8_gemv", "linear_int8_gemm"])
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"x": torch.randn(2, 8).double()}, "fp32 activations"),
        ({"qweight": torch.zeros(4, 8, dtype=torch.int16)}, "int8 weight"),
        ({"qweight": torch.zeros(4, 6, dtype=torch.int8)}, "has 8 features, weight expects 6"),
        ({"qweight": torch.zeros(8, 4, dtype=torch.int8).t()}, "contiguous"),
        ({"scale": torch.ones(3)}, "scale must be"),
        ({"scale": torch.ones(4).double()}, "scale must be"),
        ({"bias": torch.ones(5)}, "bias must be"),
        ({"x": torch.randn(8, 2).t()}, "contiguous rows"),
    ],
)
def test_kernels_refuse_what_they_cannot_compute(extension, entry, change, message):
    args = {"x": torch.randn(2, 8), "qweight": torch.zeros(4, 8, dtype=torch.int8), "scale": torch.ones(4)}
    args["bias"] = None
    args.update(change)
    with pytest.raises(RuntimeError, match=message):
        getattr(extension, entry)(args["x"], args["qweight"], args["scale"], args["bias"])


class KernelSpy:
    def __init__(self, extension) -> None:
        self.extension, self.calls = extension, []

    def linear_int8_gemv(self, x, *args):
        self.calls.append(("gemv", x.shape[0]))
        return self.extension.linear_int8_gemv(x, *args)

    def linear_int8_gemm(self, x, *args):
        self.calls.append(("gemm", x.shape[0]))
        return self.extension.linear_int8_gemm(x, *args)


def test_layer_takes_the_gemv_for_few_rows_and_the_gemm_for_more(extension):
    torch.manual_seed(0)
    linear = nn.Linear(48, 40)
    spy = KernelSpy(extension)
    layer = Int8Linear.from_linear(linear, spy)
    limit = int8_linear.GEMV_MAX_ROWS
    for rows in (1, limit, limit + 1, 200):
        x = torch.randn(rows, 48)
        expected = int8_linear_reference(x, layer.qweight, layer.scale, layer.bias)
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    assert spy.calls == [("gemv", 1), ("gemv", limit), ("gemm", limit + 1), ("gemm", 200)]


def test_layer_without_the_extension_or_in_bf16_runs_the_reference():
    torch.manual_seed(1)
    linear = nn.Linear(24, 10)
    layer = Int8Linear.from_linear(linear, None)
    x = torch.randn(3, 24)
    weight = dequantize(layer.qweight, layer.scale)
    torch.testing.assert_close(layer(x), nn.functional.linear(x, weight, linear.bias), rtol=0, atol=0)
    low = Int8Linear.from_linear(copy.deepcopy(linear).bfloat16(), None)
    assert low(x.bfloat16()).dtype == torch.bfloat16
    assert layer.qweight.dtype == torch.int8 and layer.qweight.shape == (10, 24)
    assert "in_features=24, out_features=10, bias=True" in repr(layer)


def test_rows_load_independently_into_a_fused_layer():
    """q, k and v (or gate and up) quantized apart into one layer equal the fused matrix quantized whole."""
    gen = torch.Generator().manual_seed(7)
    parts = [torch.randn(rows, 40, generator=gen) * scale for rows, scale in ((24, 0.1), (8, 2.0), (8, 0.01))]
    fused = nn.Linear(40, 40, bias=False)
    layer = Int8Linear.empty_like(fused, None)
    offset = 0
    for part in parts:
        layer.load_weight_rows(offset, part)
        offset += part.shape[0]
    qweight, scale = quantize_per_channel(torch.cat(parts))
    assert torch.equal(layer.qweight, qweight) and torch.equal(layer.scale, scale)


def test_linear_kernels_bench_measures_every_kernel(extension):
    from bench.linear_kernels import KERNELS, measure

    shapes = {"qkv": (48, 32), "o": (32, 32), "gate_up": (96, 32), "down": (32, 48)}
    results = measure(shapes, rows=[1, 40], copies=2, repeats=1)
    assert [r["rows"] for r in results] == [1, 40]
    for result in results:
        assert set(result["us_per_layer"]) == set(KERNELS)
        assert all(us > 0 for us in result["us_per_layer"].values())
        assert result["gemv_weight_gbs"]["int8_gemv"] > 0


def test_quantizing_leaves_the_weight_as_it_was():
    """The quantizer works in place on its own fp32 copy, never on the caller's fp32 tensor."""
    weight = torch.randn(6, 64, generator=torch.Generator().manual_seed(11))
    kept = weight.clone()
    q, scale = quantize_per_channel(weight)
    assert torch.equal(weight, kept)
    assert torch.equal(q, torch.round(kept / scale.unsqueeze(1)).to(torch.int8))
