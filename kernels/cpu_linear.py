"""Linear layers through oneDNN on the CPU, with each weight converted to oneDNN's tensor once.

`F.linear` on the CPU goes to MKL sgemm, which handles the skinny matmuls of a decode step (a few
dozen rows against every weight, the widest a 576 x 49152 LM head) far below the machine's
peak. oneDNN's inner-product kernel over a weight reordered once at load into its blocked layout
was 1.3-2.5x faster for every projection of SmolLM2 at 1-64 rows on this 2-core AVX-512 machine
(the LM head at 32 rows: 24.7 -> 9.9 ms), and no slower for 512-row prefill chunks. Only fp32 on
the CPU is switched; `TANDEM_ONEDNN_LINEAR=0` keeps `nn.Linear`.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

logger = logging.getLogger(__name__)

DISABLE_ENV = "TANDEM_ONEDNN_LINEAR"


def available() -> bool:
    """True when this torch build has oneDNN and the linear op this module calls."""
    mkldnn = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_linear_pointwise")
        and hasattr(mkldnn, "_reorder_linear_weight")
    )


class OneDnnLinear(nn.Module):
    """`y = x W^T + b` with W held as a oneDNN tensor; a drop-in for an fp32 `nn.Linear` at inference."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Reordered once into oneDNN's blocked layout, so no call repacks it (1.1-1.5x at decode sizes).
        self.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def use_onednn_linears(model: nn.Module) -> int:
    """Replace every fp32 CPU `nn.Linear` inside `model` by a `OneDnnLinear`; return how many.

    A weight tied to another module (the LM head and the embedding) stays dense where the other
    module uses it; the linear gets its own oneDNN copy.
    """
    if os.environ.get(DISABLE_ENV, "1") == "0" or not available():
        return 0
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
        setattr(parent, child, OneDnnLinear(module))
    logger.info("linear layers on oneDNN", extra={"count": len(targets)})
    return len(targets)
