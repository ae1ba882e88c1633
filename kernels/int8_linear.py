"""Weight-only int8 linear layers: symmetric, one fp32 scale per output channel.

A batch-1 decode step is bound by reading the weights, and int8 streams a quarter of fp32's bytes. Each
row of W is stored as `q = round(W / scale)` (round half to even), clamped to ±127, with
`scale = max|W_row| / 127` in fp32, and the layer computes `x (q * scale)^T + b`: the activations stay
in the model's dtype, so the output is what the dequantized weights give, with no activation rounding.

On the CPU with fp32 activations the C++ extension runs it: `linear_int8_gemv` (int8 rows widened in
registers, streamed at memory speed) up to `GEMV_MAX_ROWS` rows, `linear_int8_gemm` (panels of W converted
to fp32 for a register-tiled GEMM) beyond. Everywhere else — GPUs, other dtypes, no compiler — the torch
reference runs: it dequantizes the weight and calls `F.linear`, correct but with no bandwidth saved.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

QMAX = 127
# Largest row count the int8 GEMV takes; beyond it the GEMM does, which is the faster of the two from
# there on (`tandem bench linear-kernels`; figures in bench/README.md, "CPU kernels").
GEMV_MAX_ROWS = 20


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q, scale)` of a `[out, in]` weight: int8 `q` and one fp32 scale per output row (module doc).

    An all-zero row gets scale 0 and q 0, which dequantizes to the same zeros.
    """
    # One fp32 copy worked on in place: quantizing at load is a pass over every weight of the checkpoint,
    # and each temporary of the size of the weight was another pass over memory.
    w = weight.detach().to(torch.float32, copy=True)
    low, high = torch.aminmax(w, dim=1)
    scale = torch.maximum(-low, high) / QMAX
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = w.div_(divisor.unsqueeze(1)).round_().clamp_(-QMAX, QMAX).to(torch.int8)
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
    """A weight-only int8 stand-in for an `nn.Linear` at inference (2-D input: tokens x features).

    Built empty (`empty_like`) and filled a block of rows at a time (`load_weight_rows`), so a model
    loads its checkpoint straight into int8: the full-precision weight is never stored in the layer.
    """

    def __init__(
        self,
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None,
        extension: ModuleType | None,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        qweight = torch.zeros(out_features, in_features, dtype=torch.int8, device=device)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", torch.zeros(out_features, dtype=torch.float32, device=device))
        # A parameter, as in nn.Linear, so the checkpoint's bias loads by the same name.
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self._extension = extension

    @classmethod
    def empty_like(cls, linear: nn.Linear, extension: ModuleType | None) -> Int8Linear:
        """An all-zero int8 layer of `linear`'s shape and device, keeping its bias (the extension serves
        fp32 CPU inputs); its weight is then loaded with `load_weight_rows`."""
        return cls(linear.out_features, linear.in_features, linear.bias, extension, linear.weight.device)

    @classmethod
    def from_linear(cls, linear: nn.Linear, extension: ModuleType | None) -> Int8Linear:
        """`linear` quantized (its bias as it is)."""
        layer = cls.empty_like(linear, extension)
        layer.load_weight_rows(0, linear.weight)
        return layer

    @torch.no_grad()
    def load_weight_rows(self, offset: int, weight: torch.Tensor) -> None:
        """Quantize `weight` into output rows `offset...`: rows are quantized independently, so a fused
        layer (q/k/v, gate/up) loads each checkpoint tensor as it comes."""
        qweight, scale = quantize_per_channel(weight.to(self.qweight.device))
        self.qweight[offset : offset + qweight.shape[0]] = qweight
        self.scale[offset : offset + qweight.shape[0]] = scale

    def _uses_extension(self, x: torch.Tensor) -> bool:
        return self._extension is not None and x.device.type == "cpu" and x.dtype == torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._uses_extension(x):
            return int8_linear_reference(x, self.qweight, self.scale, self.bias)
        if x.shape[0] <= GEMV_MAX_ROWS:
            return self._extension.linear_int8_gemv(x, self.qweight, self.scale, self.bias)
        return self._extension.linear_int8_gemm(x, self.qweight, self.scale, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )
