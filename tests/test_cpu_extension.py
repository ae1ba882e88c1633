"""The C++ CPU paged-decode kernel equals the torch reference, and the backend uses it."""

from __future__ import annotations

import shutil

import pytest
import torch

from kernels import cpu_extension
from kernels import torch_reference as ref
from kernels.backend import TorchBackend


@pytest.fixture(scope="module")
def extension():
    module = cpu_extension.load()
    if module is None:
        assert shutil.which("c++") is None, "a C++ compiler is installed but the extension did not build"
        pytest.skip("no C++ compiler on this machine: the torch path serves decode attention")
    return module


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (6, 1), (9, 3)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 12])
def test_matches_reference_on_ragged_batches(extension, heads, kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(heads * 1000 + head_dim + block_size)
    lens = [1, block_size, block_size + 1, 3 * block_size + 5, 97]
    num_blocks = 64
    width = max((n + block_size - 1) // block_size for n in lens) + 2
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * width].view(len(lens), width).int()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    query = torch.randn(len(lens), heads, head_dim, generator=gen)
    expected = ref.paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, head_dim**-0.5)
    got = extension.paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, head_dim**-0.5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_backend_routes_fp32_decode_through_the_extension(extension, monkeypatch):
    calls = []
    backend = TorchBackend()
    original = backend._extension

    class Spy:
        def paged_decode_attention(self, *args):
            calls.append(args[0].shape)
            return original.paged_decode_attention(*args)

    monkeypatch.setattr(backend, "_extension", Spy())
    k_cache = torch.randn(8, 16, 2, 64)
    query = torch.randn(3, 4, 64)
    tables = torch.arange(6, dtype=torch.int32).view(3, 2)
    lens = torch.tensor([5, 17, 32], dtype=torch.int32)
    backend._decode(query, k_cache, k_cache, tables, lens, 0.125)
    assert calls == [torch.Size([3, 4, 64])]
    backend._decode(query.bfloat16(), k_cache.bfloat16(), k_cache.bfloat16(), tables, lens, 0.125)
    assert len(calls) == 1, "bf16 must take the torch path"


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv(cpu_extension.DISABLE_ENV, "0")
    cpu_extension.load.cache_clear()
    try:
        assert cpu_extension.load() is None
    finally:
        cpu_extension.load.cache_clear()
