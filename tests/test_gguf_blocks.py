"""The torch dequantization reference of every GGUF block type read as stored (`kernels.gguf_blocks`)
against `gguf.quants.dequantize` (llama.cpp's package; used only here, as the oracle): bit-equal fp32
over random bytes with finite fp16 scales, at odd row and block counts."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from tiny_gguf import HALF_FIELDS

from kernels.gguf_blocks import BLOCK_LAYOUTS, BLOCK_TYPES, BlockWeight, UnknownBlockTypeError, dequantize


def random_blocks(kind: str, rows: int, blocks: int, seed: int) -> np.ndarray:
    """`rows` rows of `blocks` random `kind` blocks whose fp16 fields are finite (any bits elsewhere)."""
    rng = np.random.default_rng(seed)
    nbytes = BLOCK_LAYOUTS[kind].nbytes
    raw = rng.integers(0, 256, (rows, blocks, nbytes), dtype=np.uint8)
    for start in HALF_FIELDS[kind]:
        halves = rng.standard_normal((rows, blocks, 1)) * 10.0 ** rng.integers(-6, 3, (rows, blocks, 1))
        raw[..., start : start + 2] = halves.astype(np.float16).view(np.uint8)
    return raw.reshape(rows, blocks * nbytes)


@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_every_block_type_has_ggml_layout_and_number(kind: str):
    ggml = GGMLQuantizationType[kind]
    block = BLOCK_LAYOUTS[kind]
    assert (block.weights, block.nbytes) == gguf.GGML_QUANT_SIZES[ggml]
    assert block.ggml_type == ggml.value
    assert kind in HALF_FIELDS


@pytest.mark.parametrize("kind", BLOCK_TYPES)
@pytest.mark.parametrize(("rows", "blocks", "seed"), [(1, 1, 0), (7, 3, 1), (13, 5, 2)])
def test_reference_equals_gguf_dequantize_bit_for_bit(kind: str, rows: int, blocks: int, seed: int):
    raw = random_blocks(kind, rows, blocks, seed)
    expected = gguf.quants.dequantize(raw, GGMLQuantizationType[kind])
    cols = blocks * BLOCK_LAYOUTS[kind].weights
    got = dequantize(torch.from_numpy(raw), kind, cols)
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    assert np.array_equal(got.numpy(), expected)


@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_a_weight_dequantizes_in_its_output_order(kind: str):
    raw = torch.from_numpy(random_blocks(kind, 6, 2, 3))
    order = torch.tensor([5, 0, 3, 1, 4, 2])
    weight = BlockWeight(raw, 2 * BLOCK_LAYOUTS[kind].weights, kind, order)
    assert torch.equal(weight.dequantize(), dequantize(raw, kind, weight.cols)[order])
    assert weight.shape == (6, weight.cols) and weight.nbytes == raw.nbytes


def test_a_weight_whose_bytes_do_not_fit_its_type_is_refused():
    raw = torch.zeros((2, 2 * 34), dtype=torch.uint8)
    with pytest.raises(ValueError, match="Q4_0 rows of 64 weights are 36 bytes"):
        BlockWeight(raw, 64, "Q4_0")
    with pytest.raises(UnknownBlockTypeError, match="IQ4_XS"):
        BlockWeight(raw, 64, "IQ4_XS")
