"""The C++ CPU paged-attention kernel equals the torch reference on mixed batches, and the backend uses it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import paged_batch

from kernels import cpu_extension
from kernels import torch_reference as ref
from kernels.backend import TorchBackend


def run_extension(extension, query, k_cache, v_cache, meta, scale):
    return extension.paged_attention(
        query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale
    )


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (6, 1), (9, 3)])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("block_size", [16, 12])
def test_matches_reference_on_mixed_batches(extension, heads, kv_heads, head_dim, block_size):
    # Decodes at block edges, a whole prompt, a chunk after a cached prefix, and a chunk longer than
    # the kernel's row tile that starts mid-block.
    query_lens = [1, 1, 7, 1, 40, 23]
    seq_lens = [1, block_size, 7, 3 * block_size + 5, 97, block_size + 23]
    query, k_cache, v_cache, meta = paged_batch(
        heads, kv_heads, head_dim, block_size, query_lens, seq_lens, heads * 1000 + head_dim + block_size
    )
    scale = head_dim**-0.5
    expected = ref.paged_attention(query, k_cache, v_cache, meta, scale)
    got = run_extension(extension, query, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_matches_reference_on_a_decode_only_batch(extension):
    query_lens, seq_lens = [1] * 5, [1, 16, 17, 53, 97]
    query, k_cache, v_cache, meta = paged_batch(9, 3, 64, 16, query_lens, seq_lens, seed=7)
    expected = ref.paged_decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.125)
    got = run_extension(extension, query, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_large_logits_stay_finite(extension):
    """The online softmax rescales with a finite floor (the build assumes no infinities)."""
    query, k_cache, v_cache, meta = paged_batch(4, 2, 64, 16, [3, 1], [40, 33], seed=3)
    query *= 40.0
    expected = ref.paged_attention(query, k_cache, v_cache, meta, 0.125)
    got = run_extension(extension, query, k_cache, v_cache, meta, 0.125)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_backend_routes_fp32_and_bf16_through_the_extension(extension, monkeypatch):
    calls = []
    backend = TorchBackend(extension)
    original = backend._extension

    class Spy:
        def paged_attention(self, *args):
            calls.append(args[0].shape)
            return original.paged_attention(*args)

    monkeypatch.setattr(backend, "_extension", Spy())
    query, k_cache, v_cache, meta = paged_batch(4, 2, 64, 16, [1, 5, 1], [5, 20, 32], seed=1)
    backend.attention(query, k_cache, v_cache, meta, 0.125)
    assert calls == [torch.Size([7, 4, 64])]
    backend.attention(query.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), meta, 0.125)
    assert len(calls) == 2, "a bf16 query over a bf16 cache takes the C++ kernel too"
    backend.attention(query.half(), k_cache.half(), v_cache.half(), meta, 0.125)
    assert len(calls) == 2, "fp16 must take the torch path"


@pytest.mark.parametrize("rows", [1, 5, 70])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(extension, rows, with_residual):
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 96, generator=gen), torch.randn(96, generator=gen)
    residual = torch.randn(rows, 96, generator=gen) if with_residual else None
    got = extension.rms_norm(x, weight, 1e-5, residual)
    expected = ref.rms_norm(x, weight, 1e-5, residual)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 37])
def test_rope_matches_reference_on_strided_views_of_fused_qkv(extension, tokens):
    gen = torch.Generator().manual_seed(tokens)
    heads, kv_heads, head_dim = 6, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 100
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    got = extension.apply_rope(q, k, cos, sin)
    expected = ref.apply_rope(q, k, cos, sin)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_silu_and_mul_matches_reference(extension):
    gate_up = torch.randn(9, 2 * 160, generator=torch.Generator().manual_seed(2)) * 6
    expected = ref.silu_and_mul(gate_up)
    torch.testing.assert_close(extension.silu_and_mul(gate_up), expected, rtol=1e-5, atol=1e-5)


def test_backend_fused_ops_fall_back_for_bf16(extension):
    backend = TorchBackend(extension)
    x = torch.randn(3, 64).bfloat16()
    normed, _ = backend.rms_norm(x, torch.ones(64).bfloat16(), 1e-5)
    assert normed.dtype == torch.bfloat16
    assert backend.silu_and_mul(torch.randn(3, 128).bfloat16()).dtype == torch.bfloat16


def test_refuses_head_dims_beyond_its_accumulator(extension):
    query, k_cache, v_cache, meta = paged_batch(2, 1, 272, 16, [1], [5], seed=4)
    with pytest.raises(RuntimeError, match="head_dim above 256"):
        run_extension(extension, query, k_cache, v_cache, meta, 0.1)


GEMV_SHAPES = [(960, 576), (1, 1), (5, 3), (13, 17), (37, 33), (50, 100), (7, 1536)]


def gemv_case(rows, out_features, in_features, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    return x, weight, torch.randn(out_features, generator=gen) if bias else None


def linear_in_fp64(x, weight, bias):
    """The exact product, so the kernel is held to fp32 rounding, not to another kernel's order."""
    b = None if bias is None else bias.double()
    return torch.nn.functional.linear(x.double(), weight.double(), b).float()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 16])
@pytest.mark.parametrize(("out_features", "in_features"), GEMV_SHAPES)
def test_gemv_matches_torch(extension, rows, out_features, in_features):
    bias = rows % 2 == 1
    x, weight, b = gemv_case(rows, out_features, in_features, bias, seed=rows * 7919 + out_features)
    got = extension.linear_gemv(x, weight, b)
    torch.testing.assert_close(got, linear_in_fp64(x, weight, b), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
def test_gemv_every_instruction_set_matches_torch(extension, isa):
    best = extension.gemv_isa()
    try:
        extension.set_gemv_isa(isa)
    except RuntimeError as exc:
        assert "cannot run" in str(exc)
        pytest.skip(f"this CPU has no {isa}")
    try:
        for rows, (out_features, in_features) in zip([1, 3, 6, 2, 5], GEMV_SHAPES[2:], strict=True):
            x, weight, b = gemv_case(rows, out_features, in_features, bias=True, seed=rows)
            got = extension.linear_gemv(x, weight, b)
            torch.testing.assert_close(got, linear_in_fp64(x, weight, b), rtol=1e-5, atol=1e-4)
    finally:
        extension.set_gemv_isa(best)


def test_gemv_picks_the_widest_instruction_set_of_this_cpu(extension):
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if not flags:
        pytest.skip("no /proc/cpuinfo flags here")
    expected = (
        "avx512" if {"avx512f", "avx512dq"} <= flags else "avx2" if {"avx2", "fma"} <= flags else "portable"
    )
    assert extension.gemv_isa() == expected


def test_gemv_reads_strided_rows_of_x(extension):
    wide = torch.randn(4, 80, generator=torch.Generator().manual_seed(5))
    x = wide[:, 8:72]  # rows 80 floats apart
    weight = torch.randn(21, 64, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(
        extension.linear_gemv(x, weight, None), linear_in_fp64(x, weight, None), rtol=1e-5, atol=1e-4
    )


def test_gemv_with_no_rows_returns_an_empty_result(extension):
    out = extension.linear_gemv(torch.empty(0, 32), torch.randn(8, 32), None)
    assert out.shape == (0, 8)


@pytest.mark.parametrize(
    ("x", "weight", "bias", "message"),
    [
        (torch.randn(2, 8).double(), torch.randn(4, 8), None, "fp32 only"),
        (torch.randn(2, 8), torch.randn(4, 6), None, "has 8 features, weight expects 6"),
        (torch.randn(2, 8), torch.randn(8, 4).t(), None, "contiguous"),
        (torch.randn(2, 8), torch.randn(4, 8), torch.randn(3), "bias"),
        (torch.randn(8, 2).t(), torch.randn(4, 8), None, "contiguous rows"),
    ],
)
def test_gemv_refuses_what_it_cannot_compute(extension, x, weight, bias, message):
    with pytest.raises(RuntimeError, match=message):
        extension.linear_gemv(x, weight, bias)


def test_set_gemv_isa_refuses_an_unknown_name(extension):
    with pytest.raises(RuntimeError, match="unknown GEMV instruction set"):
        extension.set_gemv_isa("sse9")


def test_build_name_changes_with_the_sources(tmp_path, monkeypatch):
    source = tmp_path / "kernel.cpp"
    source.write_text("int f() { return 1; }\n")
    monkeypatch.setattr(cpu_extension, "SOURCES", [source])
    first = cpu_extension.build_name()
    assert first == cpu_extension.build_name()
    assert first.startswith("tandem_cpu_kernels_")
    source.write_text("int f() { return 2; }\n")
    assert cpu_extension.build_name() != first


def test_a_compile_is_announced_and_a_cached_build_is_not(tmp_path, monkeypatch, caplog):
    import torch.utils.cpp_extension as cpp

    monkeypatch.setattr(cpp, "_get_build_directory", lambda name, verbose: str(tmp_path))
    monkeypatch.setattr(cpp, "load", lambda **kwargs: kwargs["name"])
    caplog.set_level("INFO", logger=cpu_extension.__name__)
    assert cpu_extension.load.__wrapped__() == cpu_extension.build_name()
    assert [r.getMessage() for r in caplog.records if "compiling the C++ CPU kernels" in r.getMessage()]
    caplog.clear()
    (tmp_path / f"{cpu_extension.build_name()}.so").write_bytes(b"")
    cpu_extension.load.__wrapped__()
    assert not [r for r in caplog.records if "compiling" in r.getMessage()]


def test_build_name_differs_between_checkouts_with_the_same_sources(tmp_path, monkeypatch):
    names = []
    for checkout in ("one", "two"):
        source = tmp_path / checkout / "kernel.cpp"
        source.parent.mkdir()
        source.write_text("int f() { return 1; }\n")
        monkeypatch.setattr(cpu_extension, "SOURCES", [source])
        names.append(cpu_extension.build_name())
    assert names[0] != names[1]


def test_a_lock_left_by_a_killed_build_is_removed_not_waited_on(tmp_path, monkeypatch, caplog):
    import torch.utils.cpp_extension as cpp

    def build(**kwargs):
        assert not (tmp_path / "lock").exists(), "torch's build would wait on this lock forever"
        return kwargs["name"]

    (tmp_path / "lock").write_bytes(b"")
    monkeypatch.setattr(cpp, "_get_build_directory", lambda name, verbose: str(tmp_path))
    monkeypatch.setattr(cpp, "load", build)
    caplog.set_level("WARNING", logger=cpu_extension.__name__)
    assert cpu_extension.load.__wrapped__() == cpu_extension.build_name()
    assert [r for r in caplog.records if "interrupted build" in r.getMessage()]


def test_a_build_in_progress_elsewhere_is_waited_for(tmp_path, monkeypatch):
    import fcntl
    import threading

    import torch.utils.cpp_extension as cpp

    monkeypatch.setattr(cpp, "_get_build_directory", lambda name, verbose: str(tmp_path))
    monkeypatch.setattr(cpp, "load", lambda **kwargs: kwargs["name"])
    holder = open(tmp_path / "build.flock", "a")  # another process's build holds the flock
    fcntl.flock(holder, fcntl.LOCK_EX)
    (tmp_path / "lock").write_bytes(b"")
    results = []
    loader = threading.Thread(target=lambda: results.append(cpu_extension.load.__wrapped__()))
    loader.start()
    loader.join(timeout=0.5)
    assert loader.is_alive() and (tmp_path / "lock").exists(), "a live build's lock must be left alone"
    (tmp_path / "lock").unlink()
    fcntl.flock(holder, fcntl.LOCK_UN)
    holder.close()
    loader.join(timeout=30)
    assert results == [cpu_extension.build_name()]
