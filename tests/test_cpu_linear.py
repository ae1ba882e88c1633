"""CPU linear layers compute what `nn.Linear` computes on both paths (the GEMV for a few rows, oneDNN
for more), pick the path by row count, and only fp32 CPU layers are swapped."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, cpu_linear.GEMV_MAX_ROWS, cpu_linear.GEMV_MAX_ROWS + 1, 64])
@pytest.mark.parametrize("with_extension", [True, False])
def test_matches_nn_linear(extension, bias, rows, with_extension):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 203, bias=bias)
    x = torch.randn(rows, 96)
    layer = cpu_linear.CpuLinear(linear, extension if with_extension else None)
    torch.testing.assert_close(layer(x), linear(x), rtol=1e-5, atol=1e-5)


class GemvSpy:
    def __init__(self, extension) -> None:
        self.extension, self.rows = extension, []

    def linear_gemv(self, x, weight, bias):
        self.rows.append(x.shape[0])
        return self.extension.linear_gemv(x, weight, bias)


def test_few_rows_take_the_gemv_and_more_take_onednn(extension):
    spy = GemvSpy(extension)
    layer = cpu_linear.CpuLinear(nn.Linear(32, 48), spy)
    for rows in (1, cpu_linear.GEMV_MAX_ROWS, cpu_linear.GEMV_MAX_ROWS + 1, 100):
        layer(torch.randn(rows, 32))
    assert spy.rows == [1, cpu_linear.GEMV_MAX_ROWS]


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.block = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16, bias=False))
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight
        self.low_precision = nn.Linear(16, 16).to(torch.bfloat16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(ids)))


@pytest.mark.parametrize("tokens", [[1, 5, 49], list(range(40))])
def test_swaps_fp32_linears_and_keeps_the_tied_embedding(tokens):
    torch.manual_seed(0)
    model = Tied()
    ids = torch.tensor(tokens)
    expected = model(ids)
    assert cpu_linear.use_cpu_linears(model, None) == 3
    assert isinstance(model.head, cpu_linear.CpuLinear)
    assert type(model.low_precision) is nn.Linear, "a bf16 layer is left alone"
    assert model.embed.weight.layout == torch.strided, "the embedding keeps its dense weight"
    torch.testing.assert_close(model(ids), expected, rtol=1e-5, atol=1e-5)
