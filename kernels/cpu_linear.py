"""fp32 linear layers on the CPU: a streaming GEMV for a few rows, oneDNN's blocked kernel for more.

At one to a few rows (single-stream decode) a linear layer only has to read its weight once, and the
best kernel is the one that streams it at memory speed: the C++ extension's `linear_gemv` reads the
plain row-major weight front to back, ahead of oneDNN's inner product at a few rows. Past that, oneDNN
over a weight reordered once into its blocked layout wins: ahead of `F.linear` (MKL) at decode sizes,
no slower for prefill chunks (bench/README.md, "CPU kernels", has the figures).
So each layer keeps both copies — the plain one is the GEMV's, the blocked one oneDNN's — and picks
by row count. Where the extension is missing the blocked oneDNN path serves every row count; where
oneDNN is missing too, `nn.Linear` stays. `TANDEM_ONEDNN_LINEAR=0` keeps `nn.Linear` everywhere.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Largest row count the GEMV takes: up to it the GEMV is ahead of oneDNN or level, past it behind
# (bench/README.md, "CPU kernels").
GEMV_MAX_ROWS = 16


def available() -> bool:
    """True when this torch build has oneDNN and the linear op this module calls."""
    mkldnn = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_linear_pointwise")
        and hasattr(mkldnn, "_reorder_linear_weight")
    )


class CpuLinear(nn.Module):
    """`y = x W^T + b` for fp32 on the CPU; a drop-in for an fp32 `nn.Linear` at inference.

    `x` is 2-D (tokens, features), as the engine's forward passes it.
    """

    def __init__(self, linear: nn.Linear, extension: ModuleType | None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._extension = extension
        # The GEMV reads the plain weight itself (shared with the embedding when tied).
        self.weight = linear.weight.detach().contiguous() if extension is not None else None
        # Reordered once into oneDNN's blocked layout, so no call repacks it.
        self.blocked_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None and x.shape[0] <= GEMV_MAX_ROWS:
            return self._extension.linear_gemv(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.blocked_weight, self.bias, "none", [], "")


def use_cpu_linears(model: nn.Module, extension: ModuleType | None) -> int:
    """Replace every fp32 CPU `nn.Linear` inside `model` by a `CpuLinear` over `extension` (its GEMV;
    None: oneDNN at every row count); return how many. Needs oneDNN (`available()`).

    A weight tied to another module (the LM head and the embedding) stays dense where the other
    module uses it; the linear gets its own copies.
    """
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear
        and module.weight.device.type == "cpu"
        and module.weight.dtype == torch.float32
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, CpuLinear(module, extension))
    logger.info(
        "fp32 linear layers on the CPU kernels",
        extra={"count": len(targets), "gemv": extension is not None, "gemv_max_rows": GEMV_MAX_ROWS},
    )
    return len(targets)
