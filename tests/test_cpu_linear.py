"""oneDNN linear layers compute what `nn.Linear` computes, and only fp32 CPU layers are swapped."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_matches_nn_linear(bias, rows):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias)
    x = torch.randn(rows, 96)
    torch.testing.assert_close(cpu_linear.OneDnnLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


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


def test_swaps_fp32_linears_and_keeps_the_tied_embedding():
    torch.manual_seed(0)
    model = Tied()
    ids = torch.tensor([1, 5, 49])
    expected = model(ids)
    assert cpu_linear.use_onednn_linears(model) == 3
    assert isinstance(model.head, cpu_linear.OneDnnLinear)
    assert type(model.low_precision) is nn.Linear, "a bf16 layer is left alone"
    assert model.embed.weight.layout == torch.strided, "the embedding keeps its dense weight"
    torch.testing.assert_close(model(ids), expected, rtol=1e-5, atol=1e-5)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv(cpu_linear.DISABLE_ENV, "0")
    model = Tied()
    assert cpu_linear.use_onednn_linears(model) == 0
    assert type(model.head) is nn.Linear
