"""The fp32 LM head on the CPU: the logits when the sampler needs them, the greedy tokens when it does not.

The LM head is the one linear layer whose output is vocabulary-wide. For an all-greedy step (the
common case, and every benchmark's) only each row's argmax matters, and the C++ `greedy_lm_head`
finds it a vocabulary slice at a time without writing the logits out: 4.7 vs 10.6 ms for 128 rows
of a 64-wide model's 49,152-token head, 23 vs 32 ms for 64 rows of SmolLM2-135M's, on one core of
the 2-core development machine. When the logits are wanted, more than a few rows use GEMM on the
transposed weight, which is faster here than oneDNN's blocked inner product at these shapes (5.1 vs
7.6 ms and 27 vs 30 ms) and costs the same memory (the transposed copy replaces the blocked one).
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
from torch import nn

from kernels import cpu_extension
from kernels.cpu_linear import DISABLE_ENV, GEMV_MAX_ROWS, enabled

logger = logging.getLogger(__name__)


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


def use_cpu_lm_head(model: nn.Module) -> bool:
    """Replace `model.lm_head` by a `CpuLmHead` when it is a bias-free fp32 CPU linear and the C++
    extension is here; True when it did. Call before `cpu_linear.use_cpu_linears`, which then skips it."""
    head = getattr(model, "lm_head", None)
    if (
        type(head) is not nn.Linear
        or head.bias is not None
        or head.weight.device.type != "cpu"
        or head.weight.dtype != torch.float32
        or not enabled()
    ):
        return False
    extension = cpu_extension.load()
    if extension is None:
        return False
    model.lm_head = CpuLmHead(head, extension)
    logger.info("LM head on the CPU kernels", extra={"greedy_without_logits": True, "disable": DISABLE_ENV})
    return True
