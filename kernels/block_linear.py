"""Linear layers over GGUF block-quantized weights kept as stored (`kernels.gguf_blocks`).

A row of `in` weights is `in / weights` blocks of its type (Q8_0: an fp16 scale `d` and 32 int8 `q`, so
`w = d * q`; the 4-, 5- and 6-bit types pack their quants and sub-block scales tighter). The layer holds
those bytes as `[rows, bytes]` uint8 tensors that view the memory-mapped GGUF (nothing copied), so
processes that map one file share its pages. The blocks run along the input dimension, so the rows of a
weight are independent: a fused layer (q, k and v in one `qkv_proj`) holds one segment of rows per
checkpoint tensor, each its own view of the file and of its own type (a Q4_K_M file mixes Q4_K and Q6_K
in one layer).

llama.cpp's converter stores q/k rows interleaved for its RoPE; rather than copy the rows back into
Hugging Face order, a segment keeps an output order and gathers its output columns (a few hundred
floats a token) after the matmul.

On the CPU with fp32 activations the C++ extension reads the blocks in place: Q8_0 with
`linear_q8_0_gemv` (`kernels/cpu/gemv_q8_0.cpp`; AVX-512, AVX2 or portable) at any row count, so a step's
cost grows with its tokens at the rate the engine measures at start (`engine.step_cost` probes steps of up
to 32 tokens); dequantizing a whole weight for one GEMM past 32 rows was that fast only while the weight
fit the caches. The other types run the extension's `linear_gguf_gemv` where it has one. On CUDA the
Triton kernels of `kernels.triton_q8_0` read Q8_0 blocks in place. Everywhere else the torch reference
runs: it dequantizes each segment (exact in fp32: `kernels.gguf_blocks.dequantize`) and multiplies in the
activations' dtype, fp32 being the exact mode. All compute what `transformers` computes on the
dequantized GGUF, up to summation order.

A layer built with `w8a8=True` (`--quantization w8a8_int8` on a GGUF) quantizes its activations per
block of 32 against its Q8_0 segments, as llama.cpp does (`kernels.q8_0_w8a8`): the extension's
`linear_q8_0_w8a8` at any row count on the CPU, its torch reference elsewhere, the same bits either way.
Its segments of other types run exactly as above: their weights are not 8-bit, so there is no int8 dot
product to match.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from kernels.gguf_blocks import BlockWeight, dequantize, layout
from kernels.q8_0_w8a8 import q8_0_w8a8_reference

# Most rows of x the decode stack's one-region path runs on the exact Q8_0 GEMV (`kernels.cpu_decode_stack`).
GEMV_MAX_ROWS = 32


@dataclass
class _Segment:
    offset: int
    weight: BlockWeight


class BlockLinear(nn.Module):
    """A stand-in for an `nn.Linear` at inference whose weight is GGUF blocks viewing the checkpoint.

    Built empty (`empty_like`) when the first block-quantized tensor for it arrives, then given each
    checkpoint tensor's rows (`load_blocks`); `missing_rows` says what a load never gave.
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
        self.out_features, self.in_features = out_features, in_features
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.device = torch.device(device)
        self._segments: list[_Segment] = []
        # The C++ CPU kernels (`kernels.platform.Platform.specialize` hands them over); None: torch alone.
        self.extension: ModuleType | None = None

    @classmethod
    def empty_like(cls, linear: nn.Module, w8a8: bool = False) -> BlockLinear:
        """An empty layer of `linear`'s shape, device and bias (an `nn.Linear` or a quantized module)."""
        device = linear.weight.device if isinstance(linear, nn.Linear) else next(linear.buffers()).device
        return cls(linear.out_features, linear.in_features, linear.bias, device, w8a8)

    def load_blocks(self, offset: int, weight: BlockWeight) -> None:
        """Hold `weight`'s rows as output rows `offset..`: a view of the mapped file on the CPU."""
        rows, cols = weight.shape
        if cols != self.in_features or offset + rows > self.out_features:
            raise ValueError(
                f"{weight.kind} rows {offset}..{offset + rows} x {cols} do not fit a {self.out_features} x "
                f"{self.in_features} layer"
            )
        if weight.blocks.device != self.device:
            order = None if weight.out_order is None else weight.out_order.to(self.device)
            weight = BlockWeight(weight.blocks.to(self.device), cols, weight.kind, order)
        self._segments = [s for s in self._segments if s.offset != offset] + [_Segment(offset, weight)]
        self._segments.sort(key=lambda segment: segment.offset)

    def missing_rows(self) -> int:
        """How many output rows no segment covers (0 once every checkpoint tensor was loaded)."""
        return self.out_features - sum(segment.weight.shape[0] for segment in self._segments)

    @property
    def segments(self) -> list[tuple[int, BlockWeight]]:
        """`(first output row, weight)` of each checkpoint tensor, by row."""
        return [(segment.offset, segment.weight) for segment in self._segments]

    @property
    def kinds(self) -> set[str]:
        """The block types of the segments."""
        return {segment.weight.kind for segment in self._segments}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda" and not self.w8a8 and self.kinds == {"Q8_0"}:
            # Imported here: a CPU process never imports Triton for this.
            from kernels import triton_q8_0

            return triton_q8_0.q8_0_layer(x, self.segments, self.out_features, self.bias)
        outputs = [self._segment_output(x, weight) for _, weight in self.segments]
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def _segment_output(self, x: torch.Tensor, weight: BlockWeight) -> torch.Tensor:
        """`x` against one segment, columns in Hugging Face order, by the fastest path that has its type."""
        extension = self.extension
        cpu_kernel = (
            extension is not None and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2
        )
        if weight.kind == "Q8_0" and self.w8a8:
            if not cpu_kernel:
                return q8_0_w8a8_linear_reference(x, weight)
            out = extension.linear_q8_0_w8a8(_unit_stride(x), weight.blocks, None)
        elif cpu_kernel and weight.kind == "Q8_0":
            out = extension.linear_q8_0_gemv(_unit_stride(x), weight.blocks, None)
        elif cpu_kernel and hasattr(extension, "linear_gguf_gemv"):
            out = extension.linear_gguf_gemv(
                _unit_stride(x), weight.blocks, layout(weight.kind).ggml_type, None
            )
        else:
            return block_linear_reference(x, weight)
        return out if weight.out_order is None else out[:, weight.out_order]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"segments={len(self._segments)}, types={','.join(sorted(self.kinds))}, w8a8={self.w8a8}"
        )


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    """`x` with unit stride along its rows, as the C++ kernels read it."""
    return x if x.stride(1) == 1 else x.contiguous()


def use_cpu_kernels(model: nn.Module, extension: ModuleType) -> int:
    """Give every `BlockLinear` in `model` the C++ CPU kernels; return how many there are."""
    layers = [module for module in model.modules() if isinstance(module, BlockLinear)]
    for layer in layers:
        layer.extension = extension
    return len(layers)


def block_linear_reference(x: torch.Tensor, weight: BlockWeight) -> torch.Tensor:
    """`x W^T` over the dequantized blocks in the activations' dtype, columns in Hugging Face order."""
    out = F.linear(x, dequantize(weight.blocks, weight.kind, weight.cols).to(x.dtype))
    return out if weight.out_order is None else out[..., weight.out_order]


def q8_0_w8a8_linear_reference(x: torch.Tensor, weight: BlockWeight) -> torch.Tensor:
    """`x` against one Q8_0 weight in w8a8 (`kernels.q8_0_w8a8`), in Hugging Face row order, x's dtype."""
    out = q8_0_w8a8_reference(weight.blocks, weight.cols, x.reshape(-1, weight.cols))
    out = out.to(x.dtype).reshape(*x.shape[:-1], weight.blocks.shape[0])
    return out if weight.out_order is None else out[..., weight.out_order]
