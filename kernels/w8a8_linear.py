"""W8A8 int8 linear layers: `kernels.int8_linear`'s weights, with the activations quantized to int8 too.

Weight-only int8 keeps fp32 activations, so every multiply-add is an fp32 FMA, and once a linear layer
has a few dozen rows (a prefill chunk, a large decode batch) the FMA units, not memory, bound it. W8A8
quantizes each row of x as it arrives (symmetric, one fp32 scale per row: vLLM's and SGLang's dynamic
per-token scheme) and multiplies int8 by int8 with exact int32 sums, which the CPU's int8 dot products
run at several times the fp32 rate. llama.cpp's Q8_0 and Q4_K dot products quantize activations the same
way (to 8 bits per block of 32 or 256).

The output differs from the dequantized weights' by the activation rounding (up to half a step of
`max|x| / 127` per element), so it equals `w8a8_linear_reference`, not `F.linear` on `q * scale`. Each row
is quantized alone and the int32 sums are exact, so a row's output is the same whatever else shares
its step.

On the CPU with fp32 activations the C++ extension runs it (`linear_w8a8`: its own int8 GEMV up to
`GEMV_MAX_ROWS` rows, its AVX-512 VNNI GEMM where that wins, oneDNN's int8 GEMM beyond); elsewhere the
torch path does, with `torch._int_mm` where the device takes the shape and exact float64 sums where it
does not. All of them give the same bits.
"""

from __future__ import annotations

from types import ModuleType

import torch

from kernels.int8_linear import Int8Linear, quantize_per_channel

# Largest row count the extension's int8 GEMV takes; beyond it oneDNN's int8 GEMM is faster (figures in
# bench/README.md, "W8A8").
GEMV_MAX_ROWS = 8
# Where the extension's AVX-512 VNNI GEMM beats oneDNN's: up to 32 rows (a decode batch) of a layer with
# at least 1,024 input features (a down projection); elsewhere oneDNN's is as fast or faster.
VNNI_MAX_ROWS = 32
VNNI_MIN_FEATURES = 1024


def _int_mm_takes(xq: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether `torch._int_mm` runs this product: any shape on the CPU; on CUDA more than 16 rows and both
    dimensions multiples of 8."""
    if xq.device.type == "cpu":
        return True
    rows, features = xq.shape
    return xq.device.type == "cuda" and rows > 16 and features % 8 == 0 and qweight.shape[0] % 8 == 0


def _int8_matmul(xq: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """Exact int32 `xq qweight^T`: `torch._int_mm` where it runs, else float64 sums of the integers (exact:
    every partial sum is an integer far below 2^53)."""
    if _int_mm_takes(xq, qweight):
        return torch._int_mm(xq, qweight.t())
    return (xq.double() @ qweight.double().t()).to(torch.int32)


def w8a8_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`float(xq qweight^T) * s * scale + b` in torch, left to right: the numbers every path gives (the
    C++ kernels bit for bit), and the path off the CPU."""
    shape = x.shape
    # Activations take the weights' scheme, one scale per row (here a token, there an output channel).
    xq, row_scale = quantize_per_channel(x.reshape(-1, shape[-1]))
    y = _int8_matmul(xq, qweight).float() * row_scale.unsqueeze(1) * scale.float().unsqueeze(0)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*shape[:-1], qweight.shape[0])


def w8a8_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    extension: ModuleType | None,
    weight_sums: torch.Tensor | None = None,
) -> torch.Tensor:
    """The W8A8 linear on the best path: the extension for fp32 CPU activations (with `weight_sums`, the
    int32 row sums of `qweight`, its VNNI GEMM may run), else `w8a8_linear_reference`."""
    if extension is None or x.device.type != "cpu" or x.dtype != torch.float32:
        return w8a8_linear_reference(x, qweight, scale, bias)
    return extension.linear_w8a8(x, qweight, scale, bias, GEMV_MAX_ROWS, weight_sums, VNNI_MAX_ROWS)


class W8A8Linear(Int8Linear):
    """`Int8Linear`'s weights and loading, computed W8A8 (module doc)."""

    # The int32 sums of the weight rows the VNNI GEMM needs (layers of VNNI_MIN_FEATURES or more), taken
    # at the first call, after loading.
    _weight_sums: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._weight_sums is None and self.in_features >= VNNI_MIN_FEATURES:
            self._weight_sums = self.qweight.sum(dim=1, dtype=torch.int32)
        return w8a8_linear(x, self.qweight, self.scale, self.bias, self._extension, self._weight_sums)
