"""bf16 linear layers on the CPU: the extension's bf16 GEMV for a few rows, oneDNN (torch's bf16 matmul) for
more, and an LM head whose logits are fp32.

A bf16 model keeps its weights as stored (half of fp32's bytes) and its activations bf16 between ops, as
Hugging Face runs it in bf16; every dot product is accumulated in fp32. At decode a linear is bound by
reading its weight once, which the GEMV (`linear_bf16_gemv`: AVX512-BF16 `vdpbf16ps` where the CPU has it)
does at memory speed from the plain row-major weight; torch's bf16 `F.linear` (oneDNN, AMX or AVX512-BF16
inside) serves prefill chunks. Neither keeps a second copy of the weight, so a bf16 model holds its bf16
bytes and nothing beside them.

The LM head always runs the GEMV with fp32 output: rounding logits to bf16 (8 significant bits) would make
near-ties exact ties and lose the sampler's precision; with the GEMV at every row count, a sequence's
logits do not depend on how many rows its step had.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu_linear import GEMV_MAX_ROWS

logger = logging.getLogger(__name__)


class Bf16Linear(nn.Module):
    """`y = x W^T + b` for bf16 on the CPU, fp32 sums; a drop-in for a bf16 `nn.Linear` at inference.

    `x` is 2-D (tokens, features), as the engine's forward passes it. `fp32_out`: return fp32 at every row
    count (the LM head's logits), always from the GEMV.
    """

    def __init__(self, linear: nn.Linear, extension: ModuleType, fp32_out: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._extension = extension
        self.fp32_out = fp32_out
        # The plain weight itself, no copy (shared with the embedding when tied).
        self.weight = linear.weight.detach()
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32_out or x.shape[0] <= GEMV_MAX_ROWS:
            return self._extension.linear_bf16_gemv(x.contiguous(), self.weight, self.bias, self.fp32_out)
        return F.linear(x, self.weight, self.bias)


def use_bf16_linears(model: nn.Module, extension: ModuleType) -> int:
    """Replace every bf16 CPU `nn.Linear` inside `model` by a `Bf16Linear` over `extension`, its `lm_head`
    by one with fp32 logits; return how many."""
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear
        and module.weight.device.type == "cpu"
        and module.weight.dtype == torch.bfloat16
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Bf16Linear(module, extension, fp32_out=name == "lm_head"))
    logger.info(
        "bf16 linear layers on the CPU kernels",
        extra={"count": len(targets), "isa": extension.bf16_gemv_isa(), "gemv_max_rows": GEMV_MAX_ROWS},
    )
    return len(targets)
