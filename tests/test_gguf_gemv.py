"""The C++ GEMV over GGUF 4/5/6-bit blocks read in place equals the float64 product with gguf's dequantized
weights on every instruction set, each weight exactly gguf's fp32 value, and refuses what it cannot read."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GgmlType
from gguf import quants

BLOCK_TYPES = [
    GgmlType.Q4_0,
    GgmlType.Q4_1,
    GgmlType.Q5_0,
    GgmlType.Q5_1,
    GgmlType.Q4_K,
    GgmlType.Q5_K,
    GgmlType.Q6_K,
]
ISAS = ["avx512", "avx2", "portable"]
# Where each type keeps its fp16 scales (d, and dmin or m where it has one): random bytes elsewhere are valid.
FP16_SCALE_OFFSETS = {
    GgmlType.Q4_0: [0],
    GgmlType.Q4_1: [0, 2],
    GgmlType.Q5_0: [0],
    GgmlType.Q5_1: [0, 2],
    GgmlType.Q4_K: [0, 2],
    GgmlType.Q5_K: [0, 2],
    GgmlType.Q6_K: [208],
}
FP32_UNIT_ROUNDOFF = 2.0**-24


@contextlib.contextmanager
def gemv_isa(extension, isa: str) -> Iterator[None]:
    """Run the GEMVs on `isa` inside the block (skipped where this CPU lacks it), then on the widest again."""
    best = extension.gemv_isa()
    try:
        extension.set_gemv_isa(isa)
    except RuntimeError as exc:
        assert "cannot run" in str(exc)
        pytest.skip(f"this CPU has no {isa}")
    try:
        yield
    finally:
        extension.set_gemv_isa(best)


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def random_blocks(ggml_type: GgmlType, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, bytes per row] blocks: gguf's quantization of normal weights where gguf can quantize the type,
    else random bytes with small finite fp16 scales (every other byte pattern is a valid block)."""
    try:
        return quants.quantize(rng.standard_normal((n, k)).astype(np.float32), ggml_type)
    except NotImplementedError:
        block_weights, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
        raw = rng.integers(0, 256, size=(n, k // block_weights, block_bytes), dtype=np.uint8)
        for offset in FP16_SCALE_OFFSETS[ggml_type]:
            scale = rng.uniform(-0.02, 0.02, size=(n, k // block_weights, 1)).astype(np.float16)
            raw[..., offset : offset + 2] = scale.view(np.uint8)
        return raw.reshape(n, -1)


def assert_close_to_float64(
    got: torch.Tensor, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None
) -> None:
    """Within the worst case of fp32 rounding of a k-term dot product in any order: (k + 2) u sum |x w|."""
    exact = x.astype(np.float64) @ weight.astype(np.float64).T
    magnitude = np.abs(x).astype(np.float64) @ np.abs(weight).astype(np.float64).T
    if bias is not None:
        exact = exact + bias
        magnitude = magnitude + np.abs(bias)
    bound = (x.shape[1] + 2) * FP32_UNIT_ROUNDOFF * magnitude + 1e-30
    error = np.abs(got.numpy().astype(np.float64) - exact)
    assert np.all(error <= bound), f"worst error {np.max(error / bound):.2f}x the fp32 bound"


def blocks_of(row_bytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    return torch.zeros(4, row_bytes, dtype=dtype)


def run(extension, x: np.ndarray, blocks: np.ndarray, ggml_type: GgmlType, bias: np.ndarray | None):
    return extension.linear_gguf_gemv(
        torch.from_numpy(x),
        torch.from_numpy(blocks),
        int(ggml_type),
        None if bias is None else torch.from_numpy(bias),
    )


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("ggml_type", BLOCK_TYPES, ids=lambda t: t.name)
def test_matches_the_float64_product_with_gguf_dequantized_weights(extension, ggml_type, isa):
    block_weights = gguf.GGML_QUANT_SIZES[ggml_type][0]
    rng = np.random.default_rng(int(ggml_type))
    with gemv_isa(extension, isa), torch_threads(3):
        # One block, a few, and enough rows (~170 KiB) that three threads split them at odd rows.
        for n, k in [(13, block_weights), (37, 3 * block_weights), (301, 1024)]:
            blocks = random_blocks(ggml_type, n, k, rng)
            weight = quants.dequantize(blocks, ggml_type)
            for rows in [1, 2, 3, 4, 5, 9]:
                x = rng.standard_normal((rows, k)).astype(np.float32)
                bias = rng.standard_normal(n).astype(np.float32) if rows % 2 else None
                assert_close_to_float64(run(extension, x, blocks, ggml_type, bias), x, weight, bias)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("ggml_type", BLOCK_TYPES, ids=lambda t: t.name)
def test_each_weight_is_exactly_gguf_dequantized_value(extension, ggml_type, isa):
    # One-hot rows of x pick single weights out: the products are exact, so y is W's column bit for bit.
    block_weights = gguf.GGML_QUANT_SIZES[ggml_type][0]
    k = 2 * block_weights
    blocks = random_blocks(ggml_type, 11, k, np.random.default_rng(7))
    weight = quants.dequantize(blocks, ggml_type)
    columns = [0, 1, 15, 16, 17, block_weights - 1, block_weights + 1, k - 2, k - 1]
    x = np.zeros((len(columns), k), dtype=np.float32)
    x[np.arange(len(columns)), columns] = 1.0
    with gemv_isa(extension, isa):
        got = run(extension, x, blocks, ggml_type, None).numpy()
    np.testing.assert_array_equal(got, weight[:, columns].T)


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("ggml_type", [GgmlType.Q4_0, GgmlType.Q4_K, GgmlType.Q6_K], ids=lambda t: t.name)
def test_a_row_of_x_gives_the_same_bits_whatever_rows_share_its_step(extension, ggml_type, isa):
    block_weights = gguf.GGML_QUANT_SIZES[ggml_type][0]
    rng = np.random.default_rng(3)
    k = 4 * block_weights
    blocks = random_blocks(ggml_type, 21, k, rng)
    x = rng.standard_normal((9, k)).astype(np.float32)
    with gemv_isa(extension, isa):
        together = run(extension, x, blocks, ggml_type, None)
        for i in range(len(x)):
            alone = run(extension, x[i : i + 1], blocks, ggml_type, None)
            assert torch.equal(alone[0], together[i])


def test_reads_strided_rows_of_x(extension):
    rng = np.random.default_rng(11)
    blocks = random_blocks(GgmlType.Q4_K, 9, 512, rng)
    wide = torch.from_numpy(rng.standard_normal((3, 600)).astype(np.float32))
    x = wide[:, 40:552]
    got = extension.linear_gguf_gemv(x, torch.from_numpy(blocks), int(GgmlType.Q4_K), None)
    assert_close_to_float64(got, x.numpy(), quants.dequantize(blocks, GgmlType.Q4_K), None)


def test_with_no_rows_returns_an_empty_result(extension):
    blocks = blocks_of(144)
    assert extension.linear_gguf_gemv(torch.empty(0, 256), blocks, int(GgmlType.Q4_K), None).shape == (0, 4)


@pytest.mark.parametrize(
    ("x", "blocks", "ggml_type", "bias", "message"),
    [
        (torch.randn(2, 256), blocks_of(34), 8, None, "ggml_type 8 is not a block type"),
        (torch.randn(2, 256), blocks_of(144), 99, None, "ggml_type 99"),
        (torch.randn(2, 96), blocks_of(144), 12, None, "not a multiple of the Q4_K block"),
        (torch.randn(2, 64), blocks_of(40), 2, None, "Q4_0 rows of 64 features are 36"),
        (torch.randn(2, 256).double(), blocks_of(210), 14, None, "x must be fp32"),
        (torch.randn(256, 2).t(), blocks_of(210), 14, None, "contiguous rows"),
        (torch.randn(2, 256), blocks_of(210, torch.int8), 14, None, "uint8"),
        (torch.randn(2, 256), blocks_of(176), 13, torch.randn(3), "bias"),
    ],
)
def test_refuses_what_it_cannot_compute(extension, x, blocks, ggml_type, bias, message):
    with pytest.raises(RuntimeError, match=message):
        extension.linear_gguf_gemv(x, blocks, ggml_type, bias)
