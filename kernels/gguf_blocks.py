"""GGUF block types read as stored: each type's block layout, the weight that holds a tensor's blocks, and
the torch reference that dequantizes them.

A block-quantized GGUF row of `cols` weights is `cols / weights` blocks of `nbytes` bytes each: fp16
scales (and, for the `_1` and K types, minimums) beside packed 4-, 5-, 6- or 8-bit quants. The blocks run
along the input dimension, so rows are independent and a tensor is held as a `[rows, blocks * nbytes]`
uint8 view of the memory-mapped file (`BlockWeight`), which a layer computes on without copying it.

`dequantize` is the exact reference: it unpacks the bits and multiplies in fp32 in the order llama.cpp's
`gguf` package does (`gguf.quants.dequantize`), so its fp32 results are those bit for bit. The K types pack
256 weights a block in 8 or 16 sub-blocks, each with its own scale (6-bit, or int8 for Q6_K) times the
block's fp16 one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockLayout:
    """How one block type packs a row: `weights` per block, `nbytes` per block; `ggml_type` is GGML's
    number for the type (`enum ggml_type`), what the C++ kernels are told."""

    weights: int
    nbytes: int
    ggml_type: int


# GGML's name for each block type tandem reads as stored -> its layout.
BLOCK_LAYOUTS: dict[str, BlockLayout] = {
    "Q4_0": BlockLayout(32, 18, 2),
    "Q4_1": BlockLayout(32, 20, 3),
    "Q5_0": BlockLayout(32, 22, 6),
    "Q5_1": BlockLayout(32, 24, 7),
    "Q8_0": BlockLayout(32, 34, 8),
    "Q4_K": BlockLayout(256, 144, 12),
    "Q5_K": BlockLayout(256, 176, 13),
    "Q6_K": BlockLayout(256, 210, 14),
}
BLOCK_TYPES = tuple(BLOCK_LAYOUTS)


class UnknownBlockTypeError(ValueError):
    """A block type with no layout here (`BLOCK_TYPES` names those there are)."""


def layout(kind: str) -> BlockLayout:
    """The layout of block type `kind`; UnknownBlockTypeError for a type not read as stored."""
    try:
        return BLOCK_LAYOUTS[kind]
    except KeyError:
        raise UnknownBlockTypeError(
            f"GGUF block type {kind!r} is not read as stored; tandem reads {', '.join(BLOCK_TYPES)}"
        ) from None


@dataclass(frozen=True)
class BlockWeight:
    """One checkpoint weight as GGUF blocks of type `kind`: `blocks` is `[rows, cols / weights * nbytes]`
    uint8; `out_order`, when given, is the Hugging Face row order as indices into the stored rows."""

    blocks: torch.Tensor
    cols: int
    kind: str
    out_order: torch.Tensor | None = None

    def __post_init__(self) -> None:
        block = layout(self.kind)
        if self.cols % block.weights or self.blocks.shape[-1] != self.cols // block.weights * block.nbytes:
            raise ValueError(
                f"{self.kind} rows of {self.cols} weights are {self.cols // block.weights * block.nbytes} "
                f"bytes of {block.weights}-weight blocks; got {self.blocks.shape[-1]} bytes"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.cols

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight in Hugging Face row order (a new tensor the size of the weight in fp32)."""
        weight = dequantize(self.blocks, self.kind, self.cols)
        return weight if self.out_order is None else weight[self.out_order]


def dequantize(blocks: torch.Tensor, kind: str, cols: int) -> torch.Tensor:
    """Rows of `kind` blocks (`[rows, bytes]` uint8) as fp32 `[rows, cols]`: what `gguf.quants.dequantize`
    gives for the same bytes."""
    block = layout(kind)
    rows = blocks.shape[0]
    grouped = blocks.reshape(-1, block.nbytes)
    return _DEQUANTIZERS[kind](grouped).reshape(rows, cols)


def _half(grouped: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte `start` of every block, as fp32 `[blocks, 1]`."""
    return grouped[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """`[blocks, n]` bytes as `[blocks, 2n]` 4-bit values: the n low nibbles, then the n high ones."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """`[blocks, n]` bytes as `[blocks, 8n]` bits, little-endian: bit j of the n-byte word at j."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).reshape(packed.shape[0], -1)


def _q4_0(grouped: torch.Tensor) -> torch.Tensor:
    quants = _nibbles(grouped[:, 2:18]).float() - 8
    return _half(grouped, 0) * quants


def _q4_1(grouped: torch.Tensor) -> torch.Tensor:
    quants = _nibbles(grouped[:, 4:20]).float()
    return _half(grouped, 0) * quants + _half(grouped, 2)


def _q5_0(grouped: torch.Tensor) -> torch.Tensor:
    quants = (_nibbles(grouped[:, 6:22]) | (_bits(grouped[:, 2:6]) << 4)).float() - 16
    return _half(grouped, 0) * quants


def _q5_1(grouped: torch.Tensor) -> torch.Tensor:
    quants = (_nibbles(grouped[:, 8:24]) | (_bits(grouped[:, 4:8]) << 4)).float()
    return _half(grouped, 0) * quants + _half(grouped, 2)


def _q8_0(grouped: torch.Tensor) -> torch.Tensor:
    return _half(grouped, 0) * grouped[:, 2:].view(torch.int8).float()


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 sub-block scales and minimums (6 bits each) of Q4_K/Q5_K's 12 packed bytes, as fp32
    `[blocks, 8]`: bytes 0-3 hold scales 0-3 and the top bits of scales 4-7, bytes 4-7 the same for the
    minimums, bytes 8-11 the low 4 bits of scales (low nibble) and minimums (high nibble) 4-7."""
    low_scales, low_mins, rest = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([low_scales & 0x3F, (rest & 0x0F) | ((low_scales >> 2) & 0x30)], dim=-1)
    mins = torch.cat([low_mins & 0x3F, (rest >> 4) | ((low_mins >> 2) & 0x30)], dim=-1)
    return scales.float(), mins.float()


def _k_low_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K's 128 quant bytes as `[blocks, 8, 32]` 4-bit values: each run of 32 bytes holds two
    sub-blocks, its low nibbles then its high ones."""
    runs = packed.reshape(-1, 4, 1, 32)
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=packed.device).reshape(1, 1, 2, 1)
    return ((runs >> shifts) & 0x0F).reshape(-1, 8, 32)


def _k_dequantize(grouped: torch.Tensor, quants: torch.Tensor) -> torch.Tensor:
    scales, mins = _k_scales(grouped[:, 4:16])
    scale = (_half(grouped, 0) * scales).unsqueeze(-1)
    offset = (_half(grouped, 2) * mins).unsqueeze(-1)
    return (scale * quants.float() - offset).reshape(-1, 256)


def _q4_k(grouped: torch.Tensor) -> torch.Tensor:
    return _k_dequantize(grouped, _k_low_nibbles(grouped[:, 16:144]))


def _q5_k(grouped: torch.Tensor) -> torch.Tensor:
    high = grouped[:, 16:48].reshape(-1, 1, 32)
    shifts = torch.arange(8, dtype=torch.uint8, device=grouped.device).reshape(1, 8, 1)
    return _k_dequantize(grouped, _k_low_nibbles(grouped[:, 48:176]) | (((high >> shifts) & 1) << 4))


def _q6_k(grouped: torch.Tensor) -> torch.Tensor:
    """256 6-bit quants (low 4 bits in 128 bytes, high 2 in 64) minus 32, times one of 16 int8 sub-block
    scales times the block's fp16 scale."""
    device = grouped.device
    nibble_shifts = torch.tensor([0, 4], dtype=torch.uint8, device=device).reshape(1, 1, 2, 1)
    low = ((grouped[:, 0:128].reshape(-1, 2, 1, 64) >> nibble_shifts) & 0x0F).reshape(-1, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=device).reshape(1, 1, 4, 1)
    high = ((grouped[:, 128:192].reshape(-1, 2, 1, 32) >> shifts) & 0x03).reshape(-1, 8, 32)
    quants = ((low | (high << 4)).to(torch.int8) - 32).reshape(-1, 16, 16).float()
    scale = (_half(grouped, 208) * grouped[:, 192:208].view(torch.int8).float()).unsqueeze(-1)
    return (scale * quants).reshape(-1, 256)


_DEQUANTIZERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}
