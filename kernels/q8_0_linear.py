"""Linear layers over GGUF Q8_0 weights kept as stored: 32 weights a block, one fp16 scale each.

A Q8_0 row of `in` weights is `in / 32` blocks of 34 bytes (the block's fp16 scale `d`, then 32 int8
`q`), and weight `w = d * q`. The layer holds those bytes as a `[rows, in / 32 * 34]` uint8 tensor that
views the memory-mapped GGUF (nothing copied), so processes that map one file share its pages. The
blocks run along the input dimension, so the rows of a weight are independent: a fused layer (q, k and
v in one `qkv_proj`) holds one segment of rows per checkpoint tensor, each its own view of the file.

llama.cpp's converter stores q/k rows interleaved for its RoPE; rather than copy the rows back into
Hugging Face order, a segment keeps an output order and gathers its output columns (a few hundred
floats a token) after the matmul.

On the CPU with fp32 activations the C++ extension's `linear_q8_0_gemv` reads the blocks in place
(`kernels/cpu/gemv_q8_0.cpp`; AVX-512, AVX2 or portable) at any row count: a step's cost then grows with
its tokens at the rate the engine measures at start (`engine.step_cost` probes steps of up to 32 tokens),
so the token budget it fits holds for larger steps too. Dequantizing a whole weight for one GEMM past
32 rows was that fast only while the weight fit the caches: at 8 B a 64-token step rewrote every weight
in fp32 and ran past the 30 s engine heartbeat. On CUDA the Triton kernels of `kernels.triton_q8_0`
read the blocks in place. Everywhere else the torch reference runs: it dequantizes each segment (`d * q`
in fp32 is exact: an 11-bit by 8-bit product) and multiplies in the activations' dtype, fp32 being the
exact mode. Both compute what `transformers` computes on the dequantized GGUF, up to summation order.

A layer built with `w8a8=True` (`--quantization w8a8_int8` on a GGUF) quantizes its activations per
block of 32 instead, as llama.cpp does (`kernels.q8_0_w8a8`): the extension's `linear_q8_0_w8a8` at any
row count on the CPU, its torch reference elsewhere, the same bits either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from kernels.q8_0_w8a8 import q8_0_w8a8_reference

# Most rows of x the decode stack's one-region path runs on the exact GEMV (`kernels.cpu_decode_stack`).
GEMV_MAX_ROWS = 32
BLOCK_WEIGHTS = 32
BLOCK_BYTES = 34
_SCALE_BYTES = 2


@dataclass(frozen=True)
class Q8_0Weight:
    """One checkpoint weight in Q8_0 blocks: `blocks` is `[rows, cols / 32 * 34]` uint8; `out_order`,
    when given, is the Hugging Face row order as indices into the stored rows."""

    blocks: torch.Tensor
    cols: int
    out_order: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.cols

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight in Hugging Face row order (a new tensor the size of the weight in fp32)."""
        weight = dequantize_q8_0(self.blocks, self.cols)
        return weight if self.out_order is None else weight[self.out_order]


def dequantize_q8_0(blocks: torch.Tensor, cols: int) -> torch.Tensor:
    """`d * q` of every block, as fp32 `[rows, cols]`: what `gguf.quants.dequantize` gives."""
    rows = blocks.shape[0]
    grouped = blocks.reshape(rows, cols // BLOCK_WEIGHTS, BLOCK_BYTES)
    scales = grouped[..., :_SCALE_BYTES].contiguous().view(torch.float16).float()
    quants = grouped[..., _SCALE_BYTES:].view(torch.int8).float()
    return (quants * scales).reshape(rows, cols)


@dataclass
class _Segment:
    offset: int
    weight: Q8_0Weight


class Q8_0Linear(nn.Module):
    """A stand-in for an `nn.Linear` at inference whose weight is Q8_0 blocks viewing the checkpoint.

    Built empty (`empty_like`) when the first Q8_0 tensor for it arrives, then given each checkpoint
    tensor's rows (`load_blocks`); `missing_rows` says what a load never gave.
    """

    def __init__(
        self,
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None,
        device: torch.device | str,
        w8a8: bool = False,
    ) -> None:
        super().__init__()
        self.w8a8 = w8a8
        if in_features % BLOCK_WEIGHTS:
            raise ValueError(f"Q8_0 needs in_features divisible by {BLOCK_WEIGHTS}, not {in_features}")
        self.out_features, self.in_features = out_features, in_features
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.device = torch.device(device)
        self._segments: list[_Segment] = []
        # The C++ CPU kernels (`kernels.platform.Platform.specialize` hands them over); None: torch alone.
        self.extension: ModuleType | None = None

    @classmethod
    def empty_like(cls, linear: nn.Module, w8a8: bool = False) -> Q8_0Linear:
        """An empty layer of `linear`'s shape, device and bias (an `nn.Linear` or a quantized module)."""
        device = linear.weight.device if isinstance(linear, nn.Linear) else next(linear.buffers()).device
        return cls(linear.out_features, linear.in_features, linear.bias, device, w8a8)

    def load_blocks(self, offset: int, weight: Q8_0Weight) -> None:
        """Hold `weight`'s rows as output rows `offset..`: a view of the mapped file on the CPU."""
        rows, cols = weight.shape
        if cols != self.in_features or offset + rows > self.out_features:
            raise ValueError(
                f"Q8_0 rows {offset}..{offset + rows} x {cols} do not fit a {self.out_features} x "
                f"{self.in_features} layer"
            )
        if weight.blocks.device != self.device:
            order = None if weight.out_order is None else weight.out_order.to(self.device)
            weight = Q8_0Weight(weight.blocks.to(self.device), cols, order)
        self._segments = [s for s in self._segments if s.offset != offset] + [_Segment(offset, weight)]
        self._segments.sort(key=lambda segment: segment.offset)

    def missing_rows(self) -> int:
        """How many output rows no segment covers (0 once every checkpoint tensor was loaded)."""
        return self.out_features - sum(segment.weight.shape[0] for segment in self._segments)

    @property
    def segments(self) -> list[tuple[int, Q8_0Weight]]:
        """`(first output row, weight)` of each checkpoint tensor, by row."""
        return [(segment.offset, segment.weight) for segment in self._segments]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda" and not self.w8a8:
            # Imported here: a CPU process never imports Triton for this.
            from kernels import triton_q8_0

            return triton_q8_0.q8_0_layer(x, self.segments, self.out_features, self.bias)
        cpu_kernel = (
            self.extension is not None
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and x.dim() == 2
        )
        if self.w8a8:
            run = self._w8a8 if cpu_kernel else q8_0_w8a8_linear_reference
        else:
            run = self._gemv if cpu_kernel else q8_0_linear_reference
        outputs = [run(x, weight) for _, weight in self.segments]
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def _gemv(self, x: torch.Tensor, weight: Q8_0Weight) -> torch.Tensor:
        out = self.extension.linear_q8_0_gemv(x if x.stride(1) == 1 else x.contiguous(), weight.blocks, None)
        return out if weight.out_order is None else out[:, weight.out_order]

    def _w8a8(self, x: torch.Tensor, weight: Q8_0Weight) -> torch.Tensor:
        out = self.extension.linear_q8_0_w8a8(x if x.stride(1) == 1 else x.contiguous(), weight.blocks, None)
        return out if weight.out_order is None else out[:, weight.out_order]

    def extra_repr(self) -> str:
        segments = len(self._segments)
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, segments={segments}, "
            f"w8a8={self.w8a8}"
        )


def use_cpu_kernels(model: nn.Module, extension: ModuleType) -> int:
    """Give every `Q8_0Linear` in `model` the C++ CPU kernels; return how many there are."""
    layers = [module for module in model.modules() if isinstance(module, Q8_0Linear)]
    for layer in layers:
        layer.extension = extension
    return len(layers)


def q8_0_linear_reference(x: torch.Tensor, weight: Q8_0Weight) -> torch.Tensor:
    """`x W^T` over the dequantized blocks in the activations' dtype, columns in Hugging Face order."""
    out = F.linear(x, dequantize_q8_0(weight.blocks, weight.cols).to(x.dtype))
    return out if weight.out_order is None else out[..., weight.out_order]


def q8_0_w8a8_linear_reference(x: torch.Tensor, weight: Q8_0Weight) -> torch.Tensor:
    """`x` against one Q8_0 weight in w8a8 (`kernels.q8_0_w8a8`), in Hugging Face row order, x's dtype."""
    out = q8_0_w8a8_reference(weight.blocks, weight.cols, x.reshape(-1, weight.cols))
    out = out.to(x.dtype).reshape(*x.shape[:-1], weight.blocks.shape[0])
    return out if weight.out_order is None else out[..., weight.out_order]
