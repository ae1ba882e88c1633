"""The Q8_0 Triton kernels (`kernels.triton_q8_0`) against the torch reference, run on the CPU by Triton's
interpreter (conftest turns it on before anything imports Triton), or compiled on a GPU with
`TANDEM_TEST_DEVICE=cuda TRITON_INTERPRET=0`, as bench/gpu_check.sh runs them.

Tolerance: the reference is `block_linear_reference` in float64, where the dequantized weights (exact in
fp32: an 11-bit scale times an 8-bit integer) and their products and sums are exact. A kernel's result
may differ from it by, element by element, with `S = sum_k |x_k w_k| + |b|` and `u` the unit roundoff
of x's dtype:

- fp32 accumulation of K products and the bias, in any order: at most `(K + 1) 2^-24 S`;
- the GEMM rounding the dequantized weight tile to x's dtype for `tl.dot` on a GPU (what the torch
  reference does to the whole weight): at most `u S`;
- each rounding of the output to x's dtype: at most `2u |y|` (the interpreter truncates fp32 to bf16
  where a GPU rounds to nearest), and `|y| <= S`.

These are worst-case bounds, not statistical ones; they stay far below what a misread block does (an
error the size of a whole product `|x_k w_k|`). Random scales of both signs put bytes of 0x80 and up
in the high byte of the fp16 scale, so a sign-extended or misassembled scale shows.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TEST_DEVICE

from kernels import triton_q8_0
from kernels.block_linear import BlockLinear, block_linear_reference
from kernels.gguf_blocks import BlockWeight
from kernels.triton_common import DEFAULT_NUM_SMS, recorded_launches
from kernels.triton_q8_0 import BLOCK_BYTES, BLOCK_WEIGHTS

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# (N, K): N no multiple of either kernel's N tile; K a multiple of 32 but of neither K tile (64, 128).
# K = 96 is one GEMV step, so K is not split; K = 416 is four steps, split four ways on 132 SMs.
SHAPES = [(72, 96), (200, 416)]


def random_blocks(rows: int, cols: int, gen: torch.Generator, offset: int = 0) -> torch.Tensor:
    """Q8_0 blocks of `rows x cols` random weights (scales of both signs, quants in [-127, 127]) as a
    `[rows, cols / 32 * 34]` uint8 view starting `offset` bytes into its buffer."""
    count = cols // BLOCK_WEIGHTS
    scales = (torch.randn(rows, count, generator=gen) * 0.5 / cols**0.5 / 64).half()
    quants = torch.randint(-127, 128, (rows, count, BLOCK_WEIGHTS), generator=gen, dtype=torch.int8)
    blocks = torch.cat([scales.view(torch.uint8).view(rows, count, 2), quants.view(torch.uint8)], dim=-1)
    buffer = torch.zeros(offset + rows * count * BLOCK_BYTES, dtype=torch.uint8)
    buffer[offset:] = blocks.reshape(-1)
    return buffer[offset:].view(rows, count * BLOCK_BYTES).to(TEST_DEVICE)


def exact(x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The reference (dequantize, then matmul) in float64: exact for these sizes."""
    out = block_linear_reference(x.double(), weight)
    return out if bias is None else out + bias.double()


def error_bound(
    x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None, output_roundings: int = 1
) -> torch.Tensor:
    """The elementwise bound of the module doc, for `output_roundings` roundings of the output."""
    magnitude = block_linear_reference(x.double().abs(), _absolute(weight))
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    u = UNIT_ROUNDOFF[x.dtype]
    return ((weight.cols + 1) * 2.0**-24 + u + 2 * u * output_roundings) * magnitude


def _absolute(weight: BlockWeight) -> BlockWeight:
    """`weight` with every scale and quant made non-negative: its dequantization is `|W|`."""
    rows, cols = weight.shape
    grouped = weight.blocks.reshape(rows, cols // BLOCK_WEIGHTS, BLOCK_BYTES).clone()
    grouped[..., 1] &= 0x7F  # the fp16 scale's sign bit (little-endian: the second byte)
    quants = grouped[..., 2:].view(torch.int8)
    grouped[..., 2:] = quants.abs().view(torch.uint8)
    return BlockWeight(grouped.reshape(rows, -1), cols, "Q8_0", weight.out_order)


def assert_within(got: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> None:
    error = (got.double() - expected).abs()
    worst = int((error - bound).argmax())
    assert bool((error <= bound).all()), (
        f"error {error.flatten()[worst]:.3g} over bound {bound.flatten()[worst]:.3g} at {worst}"
    )


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 17, 64])
def test_q8_0_linear_matches_the_reference(m, dtype, with_bias, n, k):
    """Decode rows (1, 3: the GEMV) and prefill rows (17, 64: the GEMM, one partial and one full tile)."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    weight = BlockWeight(random_blocks(n, k, gen), k, "Q8_0")
    x = torch.randn(m, k, generator=gen).to(dtype).to(TEST_DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype).to(TEST_DEVICE) if with_bias else None
    got = triton_q8_0.q8_0_linear(x, weight.blocks, k, bias)
    assert got.shape == (m, n) and got.dtype == dtype
    assert_within(got, exact(x, weight, bias), error_bound(x, weight, bias))


def test_blocks_at_an_odd_address_and_strided_rows_of_x():
    """Scales and quants are read a byte at a time, so blocks need no alignment (a view of a mapped file
    may start anywhere); x may be a column slice of a wider tensor."""
    gen = torch.Generator().manual_seed(5)
    weight = BlockWeight(random_blocks(40, 160, gen, offset=1), 160, "Q8_0")
    assert weight.blocks.data_ptr() % 2 == 1
    for m in (2, 20):
        wide = torch.randn(m, 200, generator=gen).to(TEST_DEVICE)
        x = wide[:, 8:168]
        got = triton_q8_0.q8_0_linear(x, weight.blocks, 160)
        assert_within(got, exact(x, weight, None), error_bound(x, weight, None))


def test_rows_choose_the_kernel():
    """Up to GEMV_MAX_ROWS rows the GEMV, beyond it the GEMM with the smallest M tile that holds them (at
    most 32 rows for fp32 x, whose 64-row tile spills)."""
    blocks = torch.empty((4096, 4096 // BLOCK_WEIGHTS * BLOCK_BYTES), dtype=torch.uint8, device="meta")
    seen = {}
    for dtype in (torch.bfloat16, torch.float32):
        for m in (1, 2, 5, 8, 9, 16, 17, 33, 512):
            with recorded_launches() as launches:
                triton_q8_0.q8_0_linear(torch.empty((m, 4096), dtype=dtype, device="meta"), blocks, 4096)
            seen[dtype, m] = (launches[0].kernel.__name__, launches[0].constexprs["BLOCK_M"])
    gemv, gemm = "_q8_0_gemv_kernel", "_q8_0_gemm_kernel"
    for dtype in (torch.bfloat16, torch.float32):
        assert [seen[dtype, m] for m in (1, 2, 5, 8, 9, 16, 17)] == [
            (gemv, 1),
            (gemv, 2),
            (gemv, 8),
            (gemv, 8),
            (gemm, 16),
            (gemm, 16),
            (gemm, 32),
        ]
    assert seen[torch.bfloat16, 33] == seen[torch.bfloat16, 512] == (gemm, 64)
    assert seen[torch.float32, 33] == seen[torch.float32, 512] == (gemm, 32)


@pytest.mark.parametrize("num_blocks", [1, 3, 4, 5, 13, 128, 448])
@pytest.mark.parametrize("n", [8, 576, 4096, 28672])
def test_gemv_splits_cover_k_without_empty_splits(n, num_blocks):
    splits, per_split = triton_q8_0.gemv_splits(n, num_blocks, DEFAULT_NUM_SMS)
    steps = -(-num_blocks // triton_q8_0.GEMV_BLOCK_BLOCKS)
    assert splits >= 1 and (splits - 1) * per_split < steps <= splits * per_split
    tiles = -(-n // triton_q8_0.GEMV_BLOCK_N)
    if tiles >= triton_q8_0.PROGRAMS_PER_SM * DEFAULT_NUM_SMS:
        assert splits == 1


def test_a_split_gemv_launches_the_reduction_and_one_that_is_not_does_not():
    for cols, expected in (
        (4096, ["_q8_0_gemv_kernel", "_q8_0_reduce_kernel"]),
        (128, ["_q8_0_gemv_kernel"]),
    ):
        blocks = torch.empty((64, cols // BLOCK_WEIGHTS * BLOCK_BYTES), dtype=torch.uint8, device="meta")
        with recorded_launches() as launches:
            triton_q8_0.q8_0_linear(torch.empty((1, cols), device="meta"), blocks, cols)
        assert [launch.kernel.__name__ for launch in launches] == expected


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 19])
def test_fused_layer_with_an_output_order_matches_the_torch_layer(dtype, tokens):
    """A qkv-like layer of three segments, the first two with llama.cpp's row order, and a bias: one
    launch per segment into one output (`BlockLinear.forward` on CUDA), against the layer's torch path."""
    gen = torch.Generator().manual_seed(tokens)
    hidden, sizes = 96, (48, 24, 24)
    bias = torch.randn(sum(sizes), generator=gen).to(dtype)
    layer = BlockLinear(sum(sizes), hidden, bias, TEST_DEVICE)
    offset = 0
    for index, rows in enumerate(sizes):
        order = torch.randperm(rows, generator=gen) if index < 2 else None
        layer.load_blocks(offset, BlockWeight(random_blocks(rows, hidden, gen), hidden, "Q8_0", order))
        offset += rows
    x = torch.randn(2, tokens, hidden, generator=gen).to(dtype).to(TEST_DEVICE)
    got = triton_q8_0.q8_0_layer(x, layer.segments, layer.out_features, layer.bias)
    assert got.shape == (2, tokens, sum(sizes))
    for (offset, weight), rows in zip(layer.segments, sizes, strict=True):
        columns = slice(offset, offset + rows)
        expected = exact(x, weight, layer.bias[columns])
        # A segment with an output order has its bias added after the gather: two roundings, as the
        # torch path has for every segment.
        roundings = 1 if weight.out_order is None else 2
        assert_within(got[..., columns], expected, error_bound(x, weight, layer.bias[columns], roundings))
        assert_within(layer(x)[..., columns], expected, error_bound(x, weight, layer.bias[columns], 2))


def test_k_not_a_multiple_of_32_is_refused():
    blocks = torch.zeros((8, 3 * BLOCK_BYTES), dtype=torch.uint8, device=TEST_DEVICE)
    x = torch.zeros((1, 100), device=TEST_DEVICE)
    with pytest.raises(ValueError, match="K=100 is not a multiple"):
        triton_q8_0.q8_0_linear(x, blocks, 100)


def test_blocks_of_the_wrong_width_and_x_of_the_wrong_dtype_are_refused():
    blocks = torch.zeros((8, 3 * BLOCK_BYTES), dtype=torch.uint8, device=TEST_DEVICE)
    with pytest.raises(ValueError, match=r"must be uint8 \[rows, 136\]"):
        triton_q8_0.q8_0_linear(torch.zeros((1, 128), device=TEST_DEVICE), blocks, 128)
    with pytest.raises(ValueError, match="x must be fp16, bf16 or fp32"):
        triton_q8_0.q8_0_linear(torch.zeros((1, 96), dtype=torch.float64, device=TEST_DEVICE), blocks, 96)
