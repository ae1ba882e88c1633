"""Sliding-window attention on the CPU paths: the torch reference and the C++ kernels (fp32, int8, fp8 e4m3
caches, and the fused decode stack) against the row-by-row definition, on mixed batches with GQA, windows
shorter than the context, across block edges and wider than every context (which must change nothing);
blocks below every query's window hold NaN and sit behind garbage table entries, and are never read.
The Triton kernels' window tests live with the other Triton tests (tests/test_triton_kernels.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import paged_batch
from window_cases import hidden_blocks, poison_hidden_blocks, windowed_attention

from kernels import torch_reference as ref
from kernels.backend import TorchBackend
from kernels.cpu_decode_stack import CpuDecodeStack, LayerNorms
from kernels.window import InvalidWindowError

QUANTIZED = [torch.int8, torch.float8_e4m3fn]
TOL = {"rtol": 1e-5, "atol": 1e-5}


def mixed_batch(block_size: int) -> tuple[list[int], list[int]]:
    """(query_lens, seq_lens): decodes at block edges, a whole prompt, chunks after a cached prefix (one
    longer than the C++ kernel's row tile, one starting mid-block)."""
    return [1, 1, 7, 1, 40, 23], [1, block_size, 7, 3 * block_size + 5, 97, block_size + 23]


# Shorter than any chunk, one block, across block edges, longer than a chunk, wider than every context.
WINDOWS = [1, 5, 16, 21, 50, 500]


def cpp_attention(extension, query, caches, meta, scale, window):
    tables, lens, starts = meta.block_tables, meta.seq_lens, meta.query_start_loc
    return extension.paged_attention(
        query, *caches[:2], tables, lens, starts, scale, *caches[2:], window=window
    )


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(("heads", "kv_heads", "block_size"), [(8, 2, 16), (6, 1, 12)])
def test_reference_matches_the_definition_and_reads_no_hidden_block(window, heads, kv_heads, block_size):
    query_lens, seq_lens = mixed_batch(block_size)
    query, k, v, meta = paged_batch(heads, kv_heads, 32, block_size, query_lens, seq_lens, seed=window)
    expected = windowed_attention(query, k, v, meta, 0.2, window)
    (k_bad, v_bad), bad_meta = poison_hidden_blocks((k, v), meta, window)
    got = ref.paged_attention(query, k_bad, v_bad, bad_meta, 0.2, window=window)
    torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize("window", WINDOWS)
def test_batched_decode_reference_and_its_split_stages(window):
    seq_lens = [1, 16, 17, 53, 97, 0]
    query, k, v, meta = paged_batch(9, 3, 32, 16, [1] * 6, seq_lens, seed=window)
    (k_bad, v_bad), bad_meta = poison_hidden_blocks((k, v), meta, window)
    tables, lens = bad_meta.block_tables, meta.seq_lens
    expected = windowed_attention(query[:5], k, v, _first(meta, 5), 0.2, window)
    got = ref.paged_decode_attention(query, k_bad, v_bad, tables, lens, 0.2, window=window)
    torch.testing.assert_close(got[:5], expected, **TOL)
    partial, lse = ref.decode_attention_partials(query, k_bad, v_bad, tables, lens, 0.2, 8, 13, window=window)
    merged = ref.merge_attention_partials(partial, lse)
    torch.testing.assert_close(merged[:5], expected, **TOL)
    assert torch.equal(merged[5], torch.zeros_like(merged[5]))


def _first(meta, count):
    """The metadata of the first `count` decode sequences of `meta`."""
    return type(meta)(
        query_start_loc=meta.query_start_loc[: count + 1],
        seq_lens=meta.seq_lens[:count],
        block_tables=meta.block_tables[:count],
        slot_mapping=meta.slot_mapping[:count],
        query_lens_host=meta.query_lens_host[:count],
        seq_lens_host=meta.seq_lens_host[:count],
    )


def test_a_window_wider_than_every_context_changes_nothing(extension):
    query_lens, seq_lens = mixed_batch(16)
    query, k, v, meta = paged_batch(8, 2, 64, 16, query_lens, seq_lens, seed=3)
    wide = max(seq_lens)
    assert torch.equal(
        ref.paged_attention(query, k, v, meta, 0.125, window=wide),
        ref.paged_attention(query, k, v, meta, 0.125),
    )
    assert torch.equal(
        cpp_attention(extension, query, (k, v), meta, 0.125, wide),
        cpp_attention(extension, query, (k, v), meta, 0.125, 0),
    )
    decode, k, v, meta = paged_batch(8, 2, 64, 16, [1] * 4, [1, 16, 33, 97], seed=4)
    args = (decode, k, v, meta.block_tables, meta.seq_lens, 0.125)
    assert torch.equal(ref.paged_decode_attention(*args, window=97), ref.paged_decode_attention(*args))


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), [(8, 2, 64, 16), (6, 1, 80, 12)])
def test_cpp_kernel_matches_the_definition(extension, window, heads, kv_heads, head_dim, block_size):
    query_lens, seq_lens = mixed_batch(block_size)
    query, k, v, meta = paged_batch(heads, kv_heads, head_dim, block_size, query_lens, seq_lens, seed=window)
    expected = windowed_attention(query, k, v, meta, head_dim**-0.5, window)
    caches, bad_meta = poison_hidden_blocks((k, v), meta, window)
    got = cpp_attention(extension, query, caches, bad_meta, head_dim**-0.5, window)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize("window", [5, 21])
def test_cpp_kernel_over_a_quantized_cache(extension, dtype, window):
    query_lens, seq_lens = mixed_batch(16)
    query, k, v, meta = paged_batch(9, 3, 64, 16, query_lens, seq_lens, seed=window)
    k, k_scales = ref.quantize_kv(k * 2, dtype)
    v, v_scales = ref.quantize_kv(v, dtype)
    expected = windowed_attention(query, k, v, meta, 0.125, window, k_scales, v_scales)
    caches, bad_meta = poison_hidden_blocks((k, v, k_scales, v_scales), meta, window)
    got = cpp_attention(extension, query, caches, bad_meta, 0.125, window)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, **TOL)
    torch.testing.assert_close(
        ref.paged_attention(query, *caches[:2], bad_meta, 0.125, *caches[2:], window), expected, **TOL
    )


@pytest.mark.parametrize("native", [True, False], ids=["cpp", "torch"])
@pytest.mark.parametrize("query_lens", [[1, 1, 1], [1, 9, 1]], ids=["decode", "mixed"])
def test_backend_passes_the_window_to_every_path(extension, native, query_lens):
    seq_lens = [40, 45, 70]
    query, k, v, meta = paged_batch(4, 2, 64, 16, query_lens, seq_lens, seed=9)
    (k_bad, v_bad), bad_meta = poison_hidden_blocks((k, v), meta, 19)
    assert hidden_blocks(meta, 16, 19), "the case must hide blocks"
    backend = TorchBackend(extension if native else None)
    got = backend.attention(query, k_bad, v_bad, bad_meta, 0.125, window=19)
    torch.testing.assert_close(got, windowed_attention(query, k, v, meta, 0.125, 19), **TOL)


@pytest.mark.parametrize("window", [0, -4, 2.5, True])
def test_a_window_that_is_not_a_positive_token_count_is_refused(extension, window):
    query, k, v, meta = paged_batch(4, 2, 64, 16, [1], [20], seed=1)
    for backend in (TorchBackend(extension), TorchBackend(None)):
        with pytest.raises(InvalidWindowError):
            backend.attention(query, k, v, meta, 0.125, window=window)
    with pytest.raises(RuntimeError, match="window"):
        cpp_attention(extension, query, (k, v), meta, 0.125, -1)


# ---------------------------------------------------------------- the fused decode stack


class _Norm(torch.nn.Module):
    def __init__(self, size: int, gen: torch.Generator) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(size, generator=gen), requires_grad=False)
        self.eps = 1e-5

    def kernel_weight(self) -> torch.Tensor:
        return self.weight.detach()


def _linear(rows: int, cols: int, gen: torch.Generator) -> torch.nn.Linear:
    linear = torch.nn.Linear(cols, rows, bias=False)
    linear.weight.data = torch.randn(rows, cols, generator=gen) * cols**-0.5
    return linear


_NORMS = LayerNorms(input="input_layernorm", mlp="post_attention_layernorm")


class _Layer(torch.nn.Module):
    """What `CpuDecodeStack` reads of a decoder layer, with random weights."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, gen: torch.Generator) -> None:
        super().__init__()
        self.input_layernorm = _Norm(hidden, gen)
        self.post_attention_layernorm = _Norm(hidden, gen)
        self.self_attn = torch.nn.Module()
        self.self_attn.num_heads, self.self_attn.head_dim, self.self_attn.scale = (
            heads,
            head_dim,
            head_dim**-0.5,
        )
        self.self_attn.q_norm = self.self_attn.k_norm = None
        self.self_attn.kv_group = 0
        self.self_attn.qkv_proj = _linear((heads + 2 * kv_heads) * head_dim, hidden, gen)
        self.self_attn.o_proj = _linear(hidden, heads * head_dim, gen)
        self.mlp = torch.nn.Module()
        self.mlp.activation = "silu"
        self.mlp.gate_up_proj = _linear(2 * 96, hidden, gen)
        self.mlp.down_proj = _linear(hidden, 96, gen)


def _per_op_layers(extension, layers, windows, hidden, caches, cos, sin, meta, heads, kv_heads, head_dim):
    """The decoder layers op by op with the extension's kernels, each layer's attention with its window."""
    residual = None
    for layer, window, (k_cache, v_cache) in zip(layers, windows, caches, strict=True):
        normed, summed = extension.rms_norm(hidden, layer.input_layernorm.weight, 1e-5, residual)
        qkv = extension.linear_gemv(normed, layer.self_attn.qkv_proj.weight, None)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q, k = extension.apply_rope(q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim), cos, sin)
        v = v.reshape(-1, kv_heads, head_dim)
        extension.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        attended = cpp_attention(extension, q, (k_cache, v_cache), meta, head_dim**-0.5, window or 0)
        out = extension.linear_gemv(attended.view(len(hidden), -1), layer.self_attn.o_proj.weight, None)
        mlp_in, residual = extension.rms_norm(out, layer.post_attention_layernorm.weight, 1e-5, summed)
        gate_up = extension.linear_gemv(mlp_in, layer.mlp.gate_up_proj.weight, None)
        hidden = extension.linear_gemv(extension.silu_and_mul(gate_up), layer.mlp.down_proj.weight, None)
    return hidden, residual


def test_decode_stack_applies_each_layers_window(extension):
    """One KV group (one block table), windowed layers around a global one: the stack equals the per-op
    kernels bit for bit, and never reads the windowed layers' blocks below the window (they hold NaN)."""
    heads, kv_heads, head_dim, hidden_size, window = 4, 2, 64, 128, 20
    gen = torch.Generator().manual_seed(5)
    layers = torch.nn.ModuleList(_Layer(hidden_size, heads, kv_heads, head_dim, gen) for _ in range(3))
    windows = [window, None, window]
    seq_lens = [3, 40, 61, 97]
    _, k, _, meta = paged_batch(heads, kv_heads, head_dim, 16, [1] * 4, seq_lens, seed=6)
    slots = [int(meta.block_tables[i, (n - 1) // 16]) * 16 + (n - 1) % 16 for i, n in enumerate(seq_lens)]
    meta.slot_mapping = torch.tensor(slots)
    hidden_ids = [int(meta.block_tables[seq, col]) for seq, col in hidden_blocks(meta, 16, window)]
    assert hidden_ids, "the case must hide blocks"
    caches = []
    for layer_window in windows:
        k_cache, v_cache = torch.randn(k.shape, generator=gen), torch.randn(k.shape, generator=gen)
        if layer_window is not None:
            k_cache[hidden_ids], v_cache[hidden_ids] = float("nan"), float("nan")
        caches.append((k_cache, v_cache))
    copies = [(k_cache.clone(), v_cache.clone()) for k_cache, v_cache in caches]
    hidden = torch.randn(4, hidden_size, generator=gen)
    cos, sin = torch.randn(4, head_dim, generator=gen), torch.randn(4, head_dim, generator=gen)
    kv = SimpleNamespace(
        k=[c[0] for c in caches], v=[c[1] for c in caches], k_scales=[], v_scales=[], rotation=None
    )

    stack = CpuDecodeStack(layers, extension, _NORMS, windows)
    fused, fused_residual = stack(hidden, {None: (cos, sin)}, kv, meta)
    shape = (heads, kv_heads, head_dim)
    expected, residual = _per_op_layers(extension, layers, windows, hidden, copies, cos, sin, meta, *shape)
    assert torch.isfinite(fused).all()
    assert torch.equal(fused, expected) and torch.equal(fused_residual, residual)


def test_decode_stack_refuses_a_window_list_of_the_wrong_length(extension):
    layers = torch.nn.ModuleList([_Layer(64, 2, 1, 32, torch.Generator().manual_seed(0))])
    with pytest.raises(ValueError, match="2 layer windows for 1 layers"):
        CpuDecodeStack(layers, extension, _NORMS, [None, 8])
