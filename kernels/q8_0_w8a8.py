"""The w8a8 mode of GGUF Q8_0 linears, what llama.cpp computes: activations quantized per block of 32.

Q8_0 weights are already int8 in blocks of 32 with one scale each; quantizing each block of 32
activations the same way (symmetric, one fp32 scale) lets every block's dot product run as an exact
int32 sum on the CPU's int8 dot products, one multiply by the two scales per block. The output then
differs from the exact mode's (fp32 activations against the dequantized weight) by the activation
rounding, up to half a step of `max|x_block| / 127` per element.

`q8_0_w8a8_reference` is the torch definition the C++ kernel (`kernels/cpu/gemv_q8_0_w8a8.cpp`) equals
bit for bit: the integer block sums are exact, and the fp32 steps after them run in one fixed order
(eight lanes, lane i summing blocks i, i + 8, ...; then a fixed tree over the lanes), each an IEEE
operation torch performs the same way. It is also the path off the CPU or for non-fp32 activations.
"""

from __future__ import annotations

import torch

from kernels.int8_linear import QMAX

BLOCK = 32
LANES = 8
BLOCK_BYTES = 34
# Elements of the [rows, out, blocks] block sums the reference holds at once.
_CHUNK_ELEMENTS = 1 << 24


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q, s)` of fp32 `x [rows, k]`: int8 `q [rows, k / 32, 32]` and fp32 `s [rows, k / 32]`, with
    `s = max|block| / 127` and `q = round_half_even(x / s)` clamped to ±127 (0 where s is 0)."""
    rows, k = x.shape
    if k % BLOCK:
        raise ValueError(f"Q8_0 w8a8 quantizes activations in blocks of {BLOCK}; x has {k} features")
    blocks = x.float().reshape(rows, k // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=2) / QMAX
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(blocks / divisor.unsqueeze(2)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def _block_sums(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """Exact `xq . wq` per block, `[rows, out, blocks]` fp32: each is an integer below 2^24 (32 products
    of magnitude at most 127 * 128), so fp32 matmul sums it exactly in any order."""
    blocks = xq.shape[1]
    x = xq.float().permute(1, 0, 2)  # [blocks, rows, 32]
    w = wq.float().permute(1, 2, 0)  # [blocks, 32, out]
    step = max(1, _CHUNK_ELEMENTS // max(1, xq.shape[0] * blocks))
    parts = [torch.bmm(x, w[..., n : n + step]) for n in range(0, wq.shape[0], step)]
    return torch.cat(parts, dim=2).permute(1, 2, 0)


def q8_0_w8a8_reference(blocks: torch.Tensor, cols: int, x: torch.Tensor) -> torch.Tensor:
    """`x [rows, cols]` against Q8_0 `blocks [out, cols / 32 * 34]` in w8a8 (module doc), fp32 `[rows, out]`
    in stored row order, without bias."""
    out = blocks.shape[0]
    grouped = blocks.reshape(out, cols // BLOCK, BLOCK_BYTES)
    dw = grouped[..., :2].contiguous().view(torch.float16).squeeze(-1).float()  # [out, blocks]
    wq = grouped[..., 2:].contiguous().view(torch.int8)  # [out, blocks, 32]
    xq, sx = quantize_blocks(x.reshape(-1, cols))
    terms = _block_sums(xq, wq) * (dw.unsqueeze(0) * sx.unsqueeze(1))  # [rows, out, blocks]
    pad = -terms.shape[2] % LANES
    if pad:
        terms = torch.cat([terms, terms.new_zeros(*terms.shape[:2], pad)], dim=2)
    lanes = terms.new_zeros(*terms.shape[:2], LANES)
    for group in terms.split(LANES, dim=2):
        lanes = lanes + group
    a = lanes.unbind(dim=2)
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
