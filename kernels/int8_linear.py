"""Weight-only int8 linear layers: symmetric, one fp32 scale per output channel.

A batch-1 decode step is bound by reading the weights, and int8 streams a quarter of fp32's bytes. Each
row of W is stored as `q = round(W / scale)` (round half to even), clamped to ±127, with
`scale = max|W_row| / 127` in fp32, and the layer computes `x (q * scale)^T + b`: the activations stay
in the model's dtype, so the output is what the dequantized weights give, with no activation rounding.

On the CPU with fp32 activations the C++ extension runs it: `linear_int8_gemv` (int8 rows widened in
registers, streamed at memory speed) up to `GEMV_MAX_ROWS` rows, `linear_int8_tiled` (tiles of W
dequantized into the BLAS GEMM) beyond. Everywhere else — GPUs, other dtypes, no compiler — the torch
reference runs: it dequantizes the weight and calls `F.linear`, correct but with no bandwidth saved.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

QMAX = 127
# Largest row count the int8 GEMV takes; beyond it the tiled GEMM path does. Measured on SmolLM2-135M's
# four projections, one core, weights rotating through DRAM: the GEMV (rows past 4 widened once per
# group of W rows) is 3-4x the fp32 GEMV at 1-4 rows, ahead of the tiled path up to 32 rows and level
# with it at 64; the tiled path is within 10% of oneDNN's fp32 GEMM from 64 rows on.
GEMV_MAX_ROWS = 32


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q, scale)` of a `[out, in]` weight: int8 `q` and one fp32 scale per output row (module doc).

    An all-zero row gets scale 0 and q 0, which dequantizes to the same zeros.
    """
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / QMAX
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / divisor.unsqueeze(1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 weight `q * scale` the quantized layer stands for (what the HF reference runs)."""
    return qweight.float() * scale.float().unsqueeze(1)


def int8_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`x (q * scale)^T + b` in torch: the reference the kernels are tested against, and the GPU path."""
    return F.linear(x, dequantize(qweight, scale).to(x.dtype), bias)


class Int8Linear(nn.Module):
    """A weight-only int8 stand-in for an `nn.Linear` at inference (2-D input: tokens x features)."""

    def __init__(
        self,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None,
        extension: ModuleType | None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous())
        self._extension = extension

    @classmethod
    def from_linear(cls, linear: nn.Linear, extension: ModuleType | None) -> Int8Linear:
        """Quantize `linear`'s weight (its bias stays as it is); the extension serves fp32 CPU inputs."""
        qweight, scale = quantize_per_channel(linear.weight)
        return cls(qweight, scale, linear.bias, extension)

    def _uses_extension(self, x: torch.Tensor) -> bool:
        return self._extension is not None and x.device.type == "cpu" and x.dtype == torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._uses_extension(x):
            return int8_linear_reference(x, self.qweight, self.scale, self.bias)
        if x.shape[0] <= GEMV_MAX_ROWS:
            return self._extension.linear_int8_gemv(x, self.qweight, self.scale, self.bias)
        return self._extension.linear_int8_tiled(x, self.qweight, self.scale, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )
