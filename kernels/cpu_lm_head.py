"""The fp32 LM head on the CPU for narrow models: the logits when the sampler needs them, the greedy
tokens straight from the hidden states when it does not.

For an all-greedy step (the common case, and every benchmark's) only each row's argmax matters, and the
C++ `greedy_lm_head` finds it a vocabulary slice at a time without writing the logits out. What that
saves is the logits' round trip through memory, which weighs against the GEMM's hidden-size-deep
work per logit: it is well ahead of oneDNN's linear and the argmax for a narrow model, but level or
behind for SmolLM2-135M (576 wide). So only heads at most `MAX_HIDDEN_SIZE` wide are swapped; wider
ones stay `cpu_linear.CpuLinear` (oneDNN, then the sampler's argmax). A swapped head's logits, when
wanted for more than a few rows, come from GEMM on the same transposed copy the greedy path reads
(faster than oneDNN's for a narrow head), which replaces oneDNN's blocked copy: no more memory than a
`CpuLinear`. The measurements are in bench/README.md, "CPU kernels".
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
from torch import nn

from kernels.cpu_linear import GEMV_MAX_ROWS

logger = logging.getLogger(__name__)

# Widest hidden size whose LM head is swapped (see the module docstring): 64 wide gains, 576 does not.
MAX_HIDDEN_SIZE = 256


class CpuLmHead(nn.Module):
    """`x W^T` for a bias-free fp32 LM head, plus `greedy(x)`: the argmax of each row of it."""

    def __init__(self, linear: nn.Linear, extension: ModuleType) -> None:
        super().__init__()
        self._extension = extension
        self.weight = linear.weight.detach().contiguous()  # shared with the embedding when tied
        self.weight_t = self.weight.t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= GEMV_MAX_ROWS:
            return self._extension.linear_gemv(x, self.weight, None)
        return torch.mm(x, self.weight_t)

    def greedy(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's greedy token (int64): the first index of its largest logit, NaN counting as largest."""
        return self._extension.greedy_lm_head(x, self.weight, self.weight_t, GEMV_MAX_ROWS)


def use_cpu_lm_head(model: nn.Module, extension: ModuleType) -> bool:
    """Replace `model.lm_head` by a `CpuLmHead` over `extension` when it is a bias-free fp32 CPU linear
    at most `MAX_HIDDEN_SIZE` wide; True when it did. Call before `cpu_linear.use_cpu_linears`, which
    then skips it."""
    head = getattr(model, "lm_head", None)
    if (
        type(head) is not nn.Linear
        or head.bias is not None
        or head.in_features > MAX_HIDDEN_SIZE
        or head.weight.device.type != "cpu"
        or head.weight.dtype != torch.float32
    ):
        return False
    model.lm_head = CpuLmHead(head, extension)
    logger.info("LM head on the CPU kernels", extra={"greedy_without_logits": True})
    return True
