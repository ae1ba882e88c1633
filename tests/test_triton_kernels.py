"""Every Triton kernel against its torch reference, run on the CPU by Triton's interpreter, or
compiled on a GPU with `TANDEM_TEST_DEVICE=cuda TRITON_INTERPRET=0` (as bench/gpu_check.sh runs them).

`TRITON_INTERPRET=1` must be in the environment when a kernel module is imported (the decorator
decides there) and while kernels run (the interpreter imports parts of Triton lazily and checks
it again). So on the CPU it is set around the import below and, through an autouse module
fixture, around this module's tests only; the other test modules keep their environment and the
torch backend. On a GPU the same fixture makes the GPU torch's default device instead, so every
tensor the tests build is born there.

Tolerances: fp32 inputs with fp32 accumulation differ from the reference only in summation
order (a few ulp over at most ~1000 terms), hence 2e-5; bf16 outputs are one bf16 rounding
(2**-8 relative) away from the fp32-computed reference.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from conftest import TEST_DEVICE, engine_for, random_prompts, tiny_hf_model
from window_cases import hidden_blocks, poison_hidden_blocks, windowed_attention

from base.settings import ATTENTION_BACKEND_ENV, CPU_EXTENSION_ENV, SettingsError
from engine.engine import GenerateRequest
from engine.params import SamplingParams, StoppingParams
from kernels import torch_reference as ref
from kernels.backend import TorchBackend
from kernels.metadata import AttentionMetadata
from kernels.platform import choose_platform

ON_CPU = TEST_DEVICE == "cpu"
_saved_interpret = os.environ.get("TRITON_INTERPRET")
if ON_CPU:
    os.environ["TRITON_INTERPRET"] = "1"
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels import (  # noqa: E402
    triton_backend,
    triton_cache,
    triton_common,
    triton_decode,
    triton_fused,
    triton_prefill,
)

if ON_CPU and not triton_common.is_interpreted(triton_decode._decode_kernel):
    # Imported earlier without the interpreter: re-decorate the kernels under it, dependencies first.
    for _module in (triton_common, triton_decode, triton_prefill, triton_cache, triton_fused, triton_backend):
        importlib.reload(_module)


# Decorated here, with the interpreter on: kernels defined after the environment is restored would not run.
@triton.jit
def _offset_probe_kernel(
    table_ptr, slots_ptr, token_out_ptr, slot_out_ptr, block_size, stride_block, stride_token, N: tl.constexpr
):
    positions = tl.arange(0, N)
    mask = positions < N
    token = triton_common.kv_token_offsets(table_ptr, positions, mask, block_size, stride_block, stride_token)
    tl.store(token_out_ptr + positions, token)
    slots = tl.load(slots_ptr + positions)
    slot = triton_common.slot_offsets(slots, block_size, stride_block, stride_token)
    tl.store(slot_out_ptr + positions, slot)


if _saved_interpret is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _saved_interpret

FP32_TOL = {"atol": 2e-5, "rtol": 2e-5}
BF16_TOL = {"atol": 8e-3, "rtol": 1.6e-2}
HEAD_CONFIGS = [(4, 4), (8, 2), (6, 1)]  # MHA, GQA, MQA with a group that is not a power of two


@pytest.fixture(scope="module", autouse=True)
def kernel_device() -> Iterator[None]:
    """The interpreter on the CPU; on a GPU, the GPU as torch's default device."""
    if not ON_CPU:
        torch.set_default_device(TEST_DEVICE)
        yield
        torch.set_default_device("cpu")
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        yield


def sweep():
    for heads, kv_heads in HEAD_CONFIGS:
        for head_dim in (64, 128):
            for block_size in (16, 32):
                name = f"h{heads}kv{kv_heads}d{head_dim}b{block_size}"
                yield pytest.param(heads, kv_heads, head_dim, block_size, id=name)


SWEEP = list(sweep())


def paged_cache(
    seq_lens: list[int], block_size: int, kv_heads: int, head_dim: int, seed: int, dtype=torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches and a block table giving each sequence randomly placed, distinct blocks.

    Spare blocks are left over so a kernel that reads the wrong block reads other random data.
    Table rows are padded with block 0, as the engine pads them.
    """
    gen = torch.Generator(TEST_DEVICE).manual_seed(seed)
    needed = [triton.cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(needed) + 8
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros((len(seq_lens), max(needed)), dtype=torch.int32)
    used = 0
    for row, count in enumerate(needed):
        table[row, :count] = order[used : used + count]
        used += count
    return k_cache, v_cache, table


def metadata(query_lens: list[int], seq_lens: list[int], table: torch.Tensor) -> AttentionMetadata:
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=table,
        slot_mapping=torch.full((starts[-1],), -1, dtype=torch.int64),
        query_lens_host=list(query_lens),
        seq_lens_host=list(seq_lens),
    )


# ---------------------------------------------------------------- decode


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SWEEP)
def test_decode_matches_reference(heads, kv_heads, head_dim, block_size):
    """Ragged lengths: 1, exactly a block, a block + 1, and one long enough for ≥ 3 splits."""
    seq_lens = [1, block_size, block_size + 1, 3 * triton_decode.MIN_SPLIT_TOKENS + 40]
    seed = head_dim + block_size
    k_cache, v_cache, table = paged_cache(seq_lens, block_size, kv_heads, head_dim, seed=seed)
    query = torch.randn(len(seq_lens), heads, head_dim)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim**-0.5

    plan = triton_decode.plan_splits(
        len(seq_lens),
        kv_heads,
        table.shape[1] * block_size,
        triton_common.DEFAULT_NUM_SMS,
        triton_decode.kv_tile_size(head_dim, k_cache.dtype),
    )
    assert plan.num_splits >= 3 and plan.split_size * (plan.num_splits - 1) < seq_lens[-1]
    out = triton_decode.paged_decode_attention(query, k_cache, v_cache, table, lens, scale)
    expected = ref.paged_decode_attention(query, k_cache, v_cache, table, lens, scale)
    torch.testing.assert_close(out, expected, **FP32_TOL)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 13])
def test_decode_result_does_not_depend_on_the_split_count(num_splits):
    seq_lens = [7, 200, 64, 129]
    k_cache, v_cache, table = paged_cache(seq_lens, 16, 2, 64, seed=1)
    query = torch.randn(len(seq_lens), 8, 64)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    split_size = triton.cdiv(triton.cdiv(max(seq_lens), num_splits), 64) * 64
    plan = triton_decode.SplitPlan(triton.cdiv(table.shape[1] * 16, split_size), split_size)
    out = triton_decode.paged_decode_attention(query, k_cache, v_cache, table, lens, 0.125, plan=plan)
    expected = ref.paged_decode_attention(query, k_cache, v_cache, table, lens, 0.125)
    torch.testing.assert_close(out, expected, **FP32_TOL)


def test_decode_stages_match_their_references():
    """The split kernel's partial outputs and lse, and the merge kernel, each against its reference."""
    seq_lens = [1, 64, 65, 300]
    k_cache, v_cache, table = paged_cache(seq_lens, 16, 2, 64, seed=2)
    query = torch.randn(len(seq_lens), 4, 64)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    plan = triton_decode.SplitPlan(num_splits=5, split_size=64)

    partial, lse = triton_decode.decode_partials(query, k_cache, v_cache, table, lens, 0.125, plan)
    ref_partial, ref_lse = ref.decode_attention_partials(
        query, k_cache, v_cache, table, lens, 0.125, plan.split_size, plan.num_splits
    )
    for row, seq_len in enumerate(seq_lens):
        used = triton.cdiv(seq_len, plan.split_size)
        torch.testing.assert_close(partial[row, :, :used], ref_partial[row, :, :used], **FP32_TOL)
        torch.testing.assert_close(lse[row, :, :used], ref_lse[row, :, :used], **FP32_TOL)

    merged = triton_decode.merge_partials(ref_partial, ref_lse, lens, plan.split_size, torch.float32)
    torch.testing.assert_close(merged, ref.merge_attention_partials(ref_partial, ref_lse), **FP32_TOL)


def test_decode_bf16_cache():
    seq_lens = [1, 33, 530]
    k_cache, v_cache, table = paged_cache(seq_lens, 16, 2, 128, seed=3, dtype=torch.bfloat16)
    query = torch.randn(len(seq_lens), 8, 128).to(torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = triton_decode.paged_decode_attention(query, k_cache, v_cache, table, lens, 128**-0.5)
    expected = ref.paged_decode_attention(query, k_cache, v_cache, table, lens, 128**-0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, **BF16_TOL)


@pytest.mark.parametrize("split", [False, True])
def test_decode_empty_padding_rows_are_zero(split):
    """A fixed-size batch pads with length-0 rows; they must come out as zeros, not NaN or garbage."""
    seq_lens = [40, 0, 300]
    k_cache, v_cache, table = paged_cache(seq_lens, 16, 1, 64, seed=4)
    query = torch.randn(3, 2, 64)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    plan = triton_decode.SplitPlan(5, 64) if split else triton_decode.SplitPlan(1, 320)
    out = triton_decode.paged_decode_attention(query, k_cache, v_cache, table, lens, 0.125, plan=plan)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    keep = torch.tensor([0, 2])
    expected = ref.paged_decode_attention(query[keep], k_cache, v_cache, table[keep], lens[keep], 0.125)
    torch.testing.assert_close(out[keep], expected, **FP32_TOL)


def test_decode_grid_depends_only_on_shapes(monkeypatch):
    """CUDA-graph friendliness: steps with different lengths but equal shapes launch identical grids."""
    grids = []
    kernel = triton_decode._decode_kernel

    class RecordingKernel:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(triton_decode, "_decode_kernel", RecordingKernel())
    k_cache, v_cache, table = paged_cache([600, 600], 16, 1, 64, seed=5)
    query = torch.randn(2, 4, 64)
    for seq_lens in ([5, 600], [599, 1], [300, 301]):
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        out = triton_decode.paged_decode_attention(query, k_cache, v_cache, table, lens, 0.125)
        expected = ref.paged_decode_attention(query, k_cache, v_cache, table, lens, 0.125)
        torch.testing.assert_close(out, expected, **FP32_TOL)
    assert len(set(grids)) == 1 and grids[0][2] > 1


def test_split_plan_heuristic():
    plan = triton_decode.plan_splits
    # A full GPU's worth of (sequence, KV head) programs: no split, however long the context.
    assert plan(256, 8, 32768, 132, 64).num_splits == 1
    # One sequence with a long context: split, and every split keeps a few hundred tokens.
    long = plan(1, 8, 32768, 132, 64)
    assert long.num_splits > 1 and long.split_size >= triton_decode.MIN_SPLIT_TOKENS
    assert long.num_splits * long.split_size >= 32768 > (long.num_splits - 1) * long.split_size
    assert long.split_size % 64 == 0
    # Short contexts are not worth splitting even when the GPU is nearly idle.
    assert plan(1, 1, 400, 132, 64).num_splits == 1
    # Fewer programs in flight means more splits, never more than MAX_SPLITS.
    assert plan(1, 1, 1 << 20, 132, 64).num_splits <= triton_decode.MAX_SPLITS
    assert plan(2, 8, 32768, 132, 64).num_splits >= plan(16, 8, 32768, 132, 64).num_splits


def test_kv_tiles_do_not_depend_on_the_block_size():
    """A block size that divides no tile (12, as the engine parity tests use) for decode and prefill."""
    seq_lens = [1, 12, 13, 700]
    k_cache, v_cache, table = paged_cache(seq_lens, 12, 2, 64, seed=8)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    query = torch.randn(len(seq_lens), 4, 64)
    out = triton_decode.paged_decode_attention(query, k_cache, v_cache, table, lens, 0.125)
    expected = ref.paged_decode_attention(query, k_cache, v_cache, table, lens, 0.125)
    torch.testing.assert_close(out, expected, **FP32_TOL)
    meta = metadata([1, 12, 5, 30], seq_lens, table)
    query = torch.randn(48, 4, 64)
    out = triton_prefill.paged_prefill_attention(query, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(out, ref.paged_attention(query, k_cache, v_cache, meta, 0.125), **FP32_TOL)


# ---------------------------------------------------------------- 64-bit offsets


def test_cache_offsets_are_64_bit():
    """A pool of 5M blocks of [16, 8, 128]: element offsets reach 2**36, far past int32.

    The real tensor would not fit this machine, so the kernels' shared address helpers are run
    alone on the block ids and slots of such a pool and checked against exact Python integers.
    """
    block_size, kv_heads, head_dim = 16, 8, 128
    stride_token = kv_heads * head_dim
    stride_block = block_size * stride_token
    num_blocks = 5_000_000
    assert num_blocks * stride_block > 2**36
    block_ids = torch.tensor([num_blocks - 1, 0, 3_000_000, 131_072, 262_145, 4_999_998, 7, 2_000_001])
    table = block_ids.to(torch.int32)
    n = 16
    positions = range(n)
    slots = torch.tensor([int(block_ids[p // 2]) * block_size + p % block_size for p in positions])
    token_out = torch.empty(n, dtype=torch.int64)
    slot_out = torch.empty(n, dtype=torch.int64)
    _offset_probe_kernel[(1,)](table, slots, token_out, slot_out, 2, stride_block, stride_token, N=n)
    expected_token = [int(block_ids[p // 2]) * stride_block + (p % 2) * stride_token for p in positions]
    expected_slot = [(int(s) // 2) * stride_block + (int(s) % 2) * stride_token for s in slots]
    assert token_out.tolist() == expected_token
    assert slot_out.tolist() == expected_slot
    assert max(expected_token) > 2**31


# ---------------------------------------------------------------- chunked prefill


def mixed_batch(block_size: int) -> tuple[list[int], list[int]]:
    """(query_lens, seq_lens): decodes, a fresh one-token prompt, a whole-block prompt, and chunks
    continuing a cached prefix, some crossing block boundaries."""
    query_lens = [1, 1, block_size, block_size + 1, 37, 1]
    seq_lens = [1, 2 * block_size + 1, block_size, block_size + 8, 37 + 2 * block_size + 1, block_size]
    return query_lens, seq_lens


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SWEEP)
def test_prefill_matches_reference(heads, kv_heads, head_dim, block_size):
    query_lens, seq_lens = mixed_batch(block_size)
    seed = head_dim * block_size
    k_cache, v_cache, table = paged_cache(seq_lens, block_size, kv_heads, head_dim, seed=seed)
    meta = metadata(query_lens, seq_lens, table)
    query = torch.randn(sum(query_lens), heads, head_dim)
    out = triton_prefill.paged_prefill_attention(query, k_cache, v_cache, meta, head_dim**-0.5)
    expected = ref.paged_attention(query, k_cache, v_cache, meta, head_dim**-0.5)
    torch.testing.assert_close(out, expected, **FP32_TOL)


@pytest.mark.parametrize(
    "tile",
    [triton_prefill.PrefillTile(16, 16, 4, 1), triton_prefill.PrefillTile(32, 64, 4, 1), None],
    ids=["m16n16", "m32n64", "default"],
)
def test_prefill_many_query_tiles(tile):
    """Chunks longer than a query tile, so tiles stop their KV loop at different causal bounds."""
    query_lens, seq_lens = [150, 1, 70], [150, 90, 300]
    k_cache, v_cache, table = paged_cache(seq_lens, 16, 2, 64, seed=6)
    meta = metadata(query_lens, seq_lens, table)
    query = torch.randn(sum(query_lens), 4, 64)
    out = triton_prefill.paged_prefill_attention(query, k_cache, v_cache, meta, 0.125, tile=tile)
    torch.testing.assert_close(out, ref.paged_attention(query, k_cache, v_cache, meta, 0.125), **FP32_TOL)


def test_prefill_strided_query_and_bf16():
    """q as a view into a fused qkv projection, as the model passes it; bf16 cache and activations."""
    query_lens, seq_lens = [20, 1, 9], [20, 50, 40]
    k_cache, v_cache, table = paged_cache(seq_lens, 16, 2, 64, seed=7, dtype=torch.bfloat16)
    meta = metadata(query_lens, seq_lens, table)
    qkv = torch.randn(sum(query_lens), (4 + 2 * 2) * 64).to(torch.bfloat16)
    query = qkv[:, : 4 * 64].view(-1, 4, 64)
    assert not query.is_contiguous()
    out = triton_prefill.paged_prefill_attention(query, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(out, ref.paged_attention(query, k_cache, v_cache, meta, 0.125), **BF16_TOL)


# ---------------------------------------------------------------- cache write


@pytest.mark.parametrize(("kv_heads", "head_dim", "block_size"), [(2, 64, 16), (1, 128, 32), (3, 64, 12)])
@pytest.mark.parametrize(
    ("input_dtype", "cache_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
)
def test_write_kv_cache_matches_reference(kv_heads, head_dim, block_size, input_dtype, cache_dtype):
    num_tokens, num_blocks = 23, 10
    gen = torch.Generator(TEST_DEVICE).manual_seed(head_dim + block_size)
    qkv = torch.randn(num_tokens, (4 + 2 * kv_heads) * head_dim, generator=gen)
    _, key, value = qkv.split([4 * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    key = key.view(num_tokens, kv_heads, head_dim)
    value = value.view(num_tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[0, 5, 22]] = -1
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    key, value = key.to(input_dtype), value.to(input_dtype)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    ref.write_kv_cache(key, value, k_expected, v_expected, slots)
    triton_cache.write_kv_cache(key, value, k_cache, v_cache, slots)
    if input_dtype == cache_dtype:
        assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    else:
        # The interpreter rounds fp32 -> bf16 toward zero (a GPU rounds to nearest): one ulp apart.
        torch.testing.assert_close(k_cache, k_expected, **BF16_TOL)
        torch.testing.assert_close(v_cache, v_expected, **BF16_TOL)


# ---------------------------------------------------------------- quantized KV cache (int8, fp8 e4m3)

QUANTIZED = [torch.int8, torch.float8_e4m3fn]


def quantized_paged_cache(
    seq_lens: list[int], block_size: int, kv_heads: int, head_dim: int, seed: int, dtype: torch.dtype
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """`paged_cache`'s random caches quantized by the reference: (k, v, k_scales, v_scales), table."""
    k_cache, v_cache, table = paged_cache(seq_lens, block_size, kv_heads, head_dim, seed)
    k, k_scales = ref.quantize_kv(k_cache * 3, dtype)
    v, v_scales = ref.quantize_kv(v_cache, dtype)
    return (k, v, k_scales, v_scales), table


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize(("kv_heads", "head_dim", "block_size"), [(2, 64, 16), (3, 80, 12), (1, 128, 32)])
def test_write_kv_cache_quantizes_like_the_reference(dtype, kv_heads, head_dim, block_size):
    """Exactly the reference's elements and scales (fp8: rounded in-kernel, see triton_cache), K and V
    strided views of a fused qkv, padding slots skipped; also a row of zeros and a row at a tie."""
    num_tokens, num_blocks = 19, 8
    gen = torch.Generator(TEST_DEVICE).manual_seed(head_dim + block_size)
    qkv = torch.randn(num_tokens, (4 + 2 * kv_heads) * head_dim, generator=gen) * 4
    _, key, value = qkv.split([4 * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    key, value = key.view(num_tokens, kv_heads, head_dim), value.view(num_tokens, kv_heads, head_dim)
    key[1, 0] = 0.0
    value[2, 0, :3] = torch.tensor([127.0, 0.5, -2.5])  # scale 1: ties land on even integers
    value[2, 0, 3:] = 0.0
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[0, 7]] = -1
    shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = [torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)]
    caches += [torch.zeros(shape[:3]), torch.zeros(shape[:3])]
    expected = [t.clone() for t in caches]
    ref.write_kv_cache(key, value, *expected[:2], slots, *expected[2:])
    triton_cache.write_kv_cache(key, value, *caches[:2], slots, *caches[2:])
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"), [(9, 3, 64, 16), (6, 1, 80, 12), (4, 4, 128, 16)]
)
def test_decode_over_a_quantized_cache_matches_reference(dtype, heads, kv_heads, head_dim, block_size):
    """Ragged lengths, split (3 splits) and not, GQA groups of 3, MQA, head dim 80 and block size 12."""
    seq_lens = [1, block_size, block_size + 1, 3 * 64 + 7]
    caches, table = quantized_paged_cache(
        seq_lens, block_size, kv_heads, head_dim, head_dim + block_size, dtype
    )
    query = torch.randn(len(seq_lens), heads, head_dim)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    k, v, k_scales, v_scales = caches
    expected = ref.paged_decode_attention(query, k, v, table, lens, scale, k_scales, v_scales)
    for plan in (triton_decode.SplitPlan(1, table.shape[1] * block_size), triton_decode.SplitPlan(4, 64)):
        out = triton_decode.paged_decode_attention(query, k, v, table, lens, scale, plan, k_scales, v_scales)
        torch.testing.assert_close(out, expected, **FP32_TOL)


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), [(9, 3, 64, 16), (6, 1, 80, 12)])
def test_prefill_over_a_quantized_cache_matches_reference(dtype, heads, kv_heads, head_dim, block_size):
    query_lens, seq_lens = mixed_batch(block_size)
    caches, table = quantized_paged_cache(
        seq_lens, block_size, kv_heads, head_dim, head_dim * block_size, dtype
    )
    meta = metadata(query_lens, seq_lens, table)
    query = torch.randn(sum(query_lens), heads, head_dim)
    k, v, k_scales, v_scales = caches
    tile = triton_prefill.PrefillTile(16, 16, 4, 1)  # several query and KV tiles per sequence
    out = triton_prefill.paged_prefill_attention(query, k, v, meta, 0.125, tile, k_scales, v_scales)
    torch.testing.assert_close(
        out, ref.paged_attention(query, k, v, meta, 0.125, k_scales, v_scales), **FP32_TOL
    )


def test_decode_over_int8_with_bf16_activations():
    caches, table = quantized_paged_cache([1, 33, 300], 16, 2, 128, seed=3, dtype=torch.int8)
    query = torch.randn(3, 8, 128).to(torch.bfloat16)
    lens = torch.tensor([1, 33, 300], dtype=torch.int32)
    k, v, k_scales, v_scales = caches
    out = triton_decode.paged_decode_attention(query, k, v, table, lens, 128**-0.5, None, k_scales, v_scales)
    expected = ref.paged_decode_attention(query, k, v, table, lens, 128**-0.5, k_scales, v_scales)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, **BF16_TOL)


def test_quantized_kernels_refuse_half_a_set_of_scales():
    caches, table = quantized_paged_cache([5], 16, 2, 64, seed=4, dtype=torch.int8)
    k, v, k_scales, _ = caches
    query, lens = torch.randn(1, 4, 64), torch.tensor([5], dtype=torch.int32)
    with pytest.raises(ValueError, match="both K and V scales"):
        triton_decode.paged_decode_attention(query, k, v, table, lens, 0.125, None, k_scales, None)
    with pytest.raises(ValueError, match="written without scales"):
        triton_cache.write_kv_cache(query[:, :2], query[:, 2:], k, v, torch.tensor([0]))


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_engine_over_a_quantized_cache_matches_the_torch_backend(monkeypatch, kv):
    """Chunked prefill, mixed steps and decode over a quantized cache on both backends: same tokens."""
    hf = tiny_hf_model(11, num_heads=4, num_kv_heads=2, head_dim=64)
    prompts = random_prompts(3, 12, min_len=3, max_len=40)
    greedy = SamplingParams(temperature=0.0)
    requests = [GenerateRequest(p, greedy, StoppingParams(max_tokens=5, ignore_eos=True)) for p in prompts]
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "torch")
    torch_engine = engine_for(hf, num_blocks=64, shuffle_seed=12, kv_cache_dtype=kv)
    expected = [s.output_token_ids for s in torch_engine.generate(requests, max_num_batched_tokens=48)]
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "triton")
    triton_engine = engine_for(hf, num_blocks=64, shuffle_seed=12, kv_cache_dtype=kv)
    assert triton_engine.backend.name == "triton" and triton_engine.kv_cache.quantized
    got = [s.output_token_ids for s in triton_engine.generate(requests, max_num_batched_tokens=48)]
    assert got == expected


# ---------------------------------------------------------------- sliding window

# Shorter than a chunk, one block, across block edges, wider than every context (must change nothing).
WINDOWS = [1, 5, 16, 21, 500]


def windowed_case(query_lens, seq_lens, heads, kv_heads, window, seed, quantized=None):
    """Query, clean caches and metadata, and the same caches with every block below the window poisoned
    (NaN, behind garbage table entries): `(query, clean, meta, poisoned, poisoned_meta)`."""
    k_cache, v_cache, table = paged_cache(seq_lens, 16, kv_heads, 64, seed=seed)
    clean = (k_cache, v_cache)
    if quantized is not None:
        k, k_scales = ref.quantize_kv(k_cache * 3, quantized)
        v, v_scales = ref.quantize_kv(v_cache, quantized)
        clean = (k, v, k_scales, v_scales)
    meta = metadata(query_lens, seq_lens, table)
    poisoned, poisoned_meta = poison_hidden_blocks(clean, meta, window)
    query = torch.randn(sum(query_lens), heads, 64)
    return query, clean, meta, poisoned, poisoned_meta


@pytest.mark.parametrize("window", [1, 16, 21, 500])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (6, 1)])
def test_windowed_decode_matches_the_definition(window, heads, kv_heads):
    """One split and four (the plan sized to the visible keys), a padding row of length 0 among them."""
    seq_lens = [1, 16, 17, 53, 97, 0]
    query, clean, meta, bad, bad_meta = windowed_case([1] * 6, seq_lens, heads, kv_heads, window, window)
    expected = windowed_attention(
        query[:5], *clean, metadata([1] * 5, seq_lens[:5], meta.block_tables[:5]), 0.125, window
    )
    for plan in (None, triton_decode.SplitPlan(4, 32)):
        out = triton_decode.paged_decode_attention(
            query, *bad, bad_meta.block_tables, bad_meta.seq_lens, 0.125, plan, window=window
        )
        assert torch.isfinite(out).all() and torch.equal(out[5], torch.zeros_like(out[5]))
        torch.testing.assert_close(out[:5], expected, **FP32_TOL)


def test_windowed_decode_stages_match_their_references():
    """Splits start at each sequence's first visible key, and the merge reads only the visible ones."""
    seq_lens, window = [1, 20, 21, 90], 21
    query, _, _, bad, bad_meta = windowed_case([1] * 4, seq_lens, 4, 2, window, seed=2)
    tables, lens = bad_meta.block_tables, bad_meta.seq_lens
    plan = triton_decode.SplitPlan(num_splits=3, split_size=8)
    partial, lse = triton_decode.decode_partials(query, *bad, tables, lens, 0.125, plan, window=window)
    ref_partial, ref_lse = ref.decode_attention_partials(
        query, *bad, tables, lens, 0.125, 8, 3, window=window
    )
    for row, seq_len in enumerate(seq_lens):
        used = triton.cdiv(min(seq_len, window), plan.split_size)
        torch.testing.assert_close(partial[row, :, :used], ref_partial[row, :, :used], **FP32_TOL)
        torch.testing.assert_close(lse[row, :, :used], ref_lse[row, :, :used], **FP32_TOL)
    merged = triton_decode.merge_partials(ref_partial, ref_lse, lens, 8, torch.float32, window)
    torch.testing.assert_close(merged, ref.merge_attention_partials(ref_partial, ref_lse), **FP32_TOL)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("tile", [triton_prefill.PrefillTile(16, 16, 4, 1), None], ids=["m16n16", "default"])
def test_windowed_prefill_matches_the_definition(window, tile):
    """Decodes and prompt chunks in one launch; query tiles whose rows' windows start at different keys."""
    query_lens, seq_lens = [1, 1, 16, 17, 37, 1], [1, 50, 16, 40, 90, 16]
    query, clean, meta, bad, bad_meta = windowed_case(query_lens, seq_lens, 4, 2, window, seed=window)
    assert window > max(seq_lens) or hidden_blocks(meta, 16, window), "the case must hide blocks"
    out = triton_prefill.paged_prefill_attention(query, *bad, bad_meta, 0.125, tile, window=window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, windowed_attention(query, *clean, meta, 0.125, window), **FP32_TOL)


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_windowed_attention_over_a_quantized_cache(dtype):
    query_lens, seq_lens, window = [1, 1, 9, 1], [20, 45, 50, 70], 21
    query, clean, meta, bad, bad_meta = windowed_case(query_lens, seq_lens, 6, 2, window, 3, dtype)
    k, v, k_scales, v_scales = bad
    expected = windowed_attention(query, *clean[:2], meta, 0.125, window, *clean[2:])
    tile = triton_prefill.PrefillTile(16, 16, 4, 1)
    out = triton_prefill.paged_prefill_attention(
        query, k, v, bad_meta, 0.125, tile, k_scales, v_scales, window
    )
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, **FP32_TOL)
    decodes = [0, 1, 11]  # the rows of the single-token sequences
    tables, lens = bad_meta.block_tables[[0, 1, 3]], bad_meta.seq_lens[[0, 1, 3]]
    plan = triton_decode.SplitPlan(2, 16)
    out = triton_decode.paged_decode_attention(
        query[decodes], k, v, tables, lens, 0.125, plan, k_scales, v_scales, window
    )
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected[decodes], **FP32_TOL)


def test_a_window_wider_than_every_context_changes_nothing():
    query_lens, seq_lens = [1, 9, 1], [16, 40, 70]
    k_cache, v_cache, table = paged_cache(seq_lens, 16, 2, 64, seed=4)
    meta = metadata(query_lens, seq_lens, table)
    query = torch.randn(sum(query_lens), 4, 64)
    wide = max(seq_lens)
    assert torch.equal(
        triton_prefill.paged_prefill_attention(query, k_cache, v_cache, meta, 0.125, window=wide),
        triton_prefill.paged_prefill_attention(query, k_cache, v_cache, meta, 0.125),
    )
    lens = meta.seq_lens
    args = (query[: len(seq_lens)], k_cache, v_cache, table, lens, 0.125, triton_decode.SplitPlan(3, 32))
    assert torch.equal(
        triton_decode.paged_decode_attention(*args, window=wide), triton_decode.paged_decode_attention(*args)
    )


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [1, 9, 1]], ids=["decode", "mixed"])
def test_triton_backend_passes_the_window(query_lens):
    query, clean, meta, bad, bad_meta = windowed_case(query_lens, [40, 45, 70], 4, 2, 19, seed=9)
    got = triton_backend.TritonBackend().attention(query, *bad, bad_meta, 0.125, window=19)
    torch.testing.assert_close(got, windowed_attention(query, *clean, meta, 0.125, 19), **FP32_TOL)


# ---------------------------------------------------------------- fused ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [128, 200])
def test_rms_norm_matches_reference(dtype, hidden):
    x = torch.randn(9, hidden).to(dtype)
    residual = torch.randn(9, hidden).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    out, same = triton_fused.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(out, ref.rms_norm(x, weight, 1e-6)[0], **tol)
    assert same is x
    out, new_residual = triton_fused.rms_norm(x, weight, 1e-6, residual)
    expected, expected_residual = ref.rms_norm(x, weight, 1e-6, residual)
    torch.testing.assert_close(out, expected, **tol)
    # bf16: the interpreter rounds the fp32 sum toward zero where torch rounds to nearest.
    torch.testing.assert_close(new_residual, expected_residual, **tol)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 64), (8, 2, 128), (6, 1, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_matches_reference(heads, kv_heads, head_dim, dtype):
    """Rotates q and k where they lie, inside one fused qkv tensor, leaving v untouched."""
    num_tokens = 11
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim).to(dtype)
    original = qkv.clone()
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(num_tokens, heads, head_dim), k.view(num_tokens, kv_heads, head_dim)
    positions = torch.arange(num_tokens).float() * 37
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q_expected, k_expected = ref.apply_rope(q.clone(), k.clone(), cos, sin)
    q_out, k_out = triton_fused.apply_rope(q, k, cos, sin)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(q, q_expected, **tol)
    torch.testing.assert_close(k, k_expected, **tol)
    assert torch.equal(v, original[:, (heads + kv_heads) * head_dim :])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [256, 300, 2500])
def test_silu_and_mul_matches_reference(dtype, width):
    gate_up = (2 * torch.randn(3, 4, 2 * width)).to(dtype)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(triton_fused.silu_and_mul(gate_up), ref.silu_and_mul(gate_up), **tol)


# ---------------------------------------------------------------- backend selection and end to end


def test_backend_selection(monkeypatch):
    """auto: Triton on CUDA, torch elsewhere; the environment, then the engine's config, override it."""
    monkeypatch.delenv(ATTENTION_BACKEND_ENV, raising=False)
    monkeypatch.setenv(CPU_EXTENSION_ENV, "0")  # which C++ kernels run is tests/test_platform.py's

    def attention(device: str, requested: str | None = None):
        return choose_platform(device, torch.float32, attention_backend=requested).attention

    assert isinstance(attention("cpu"), TorchBackend)
    assert isinstance(attention("cuda"), triton_backend.TritonBackend)
    assert isinstance(attention("cuda", "torch"), TorchBackend)
    assert isinstance(attention("cpu", "triton"), triton_backend.TritonBackend)
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "triton")
    assert isinstance(attention("cpu"), triton_backend.TritonBackend)
    assert isinstance(attention("cpu", "torch"), TorchBackend)
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "torch")
    assert isinstance(attention("cuda"), TorchBackend)
    with pytest.raises(ValueError, match="auto, torch or triton, not 'cuda'"):
        attention("cpu", "cuda")
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "cuda")
    with pytest.raises(SettingsError, match="TANDEM_ATTENTION_BACKEND must be auto, torch or triton"):
        attention("cpu")


@pytest.mark.skipif(not ON_CPU, reason="needs a machine without CUDA")
def test_triton_backend_refuses_a_cpu_without_the_interpreter(repo_root):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import torch\n"
        "from kernels.triton_backend import TritonBackend, TritonUnavailableError\n"
        "assert not torch.cuda.is_available()\n"
        "try:\n    TritonBackend()\nexcept TritonUnavailableError as e:\n    print('refused:', e)\n"
    )
    command = [sys.executable, "-c", code]
    done = subprocess.run(command, cwd=repo_root, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "refused:" in done.stdout and "TANDEM_ATTENTION_BACKEND=torch" in done.stdout


def test_engine_greedy_tokens_match_torch_backend(monkeypatch):
    """A tiny Llama through the whole engine (chunked prefill, mixed steps, decode) on both backends."""
    hf = tiny_hf_model(11, num_heads=4, num_kv_heads=2, head_dim=64)
    prompts = random_prompts(4, 11, min_len=3, max_len=40)
    greedy = SamplingParams(temperature=0.0)
    requests = [GenerateRequest(p, greedy, StoppingParams(max_tokens=6, ignore_eos=True)) for p in prompts]
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "torch")
    torch_engine = engine_for(hf, num_blocks=64, shuffle_seed=11)
    expected = [s.output_token_ids for s in torch_engine.generate(requests, max_num_batched_tokens=48)]
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "triton")
    triton_engine = engine_for(hf, num_blocks=64, shuffle_seed=11)
    assert triton_engine.backend.name == "triton"
    got = [s.output_token_ids for s in triton_engine.generate(requests, max_num_batched_tokens=48)]
    assert got == expected
    assert triton_engine.block_manager.num_free_blocks == 64


# ---------------------------------------------------------------- GPU benchmark script


def test_gpu_benchmark_dry_run(repo_root, tmp_path):
    """The benchmark's CPU dry run: kernels checked against references on tiny shapes, JSON written."""
    out = tmp_path / "kernels.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.kernels_gpu", "--dry-run", "--out", str(out)],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["mode"] == "dry-run" and report["peak_bandwidth_bytes_per_s"] > 0
    assert report["decode"] and report["prefill"]
    # The static roofline is of the GPU sweep (batch 1-256, contexts 1k-32k) at an H200's bandwidth.
    roofline = report["static_roofline"]
    assert {row["batch"] for row in roofline} == {1, 8, 64, 256}
    assert {row["context"] for row in roofline} == {1024, 4096, 16384, 32768}
    for row in roofline:
        assert row["min_seconds"] == pytest.approx(row["compulsory_bytes"] / 4.8e12)
        assert row["compulsory_bytes"] > row["kv_bytes"] > 0 and row["flops"] > 0
        assert (row["split_bytes"] > 0) == (row["num_splits"] > 1)
    assert "static roofline of decode attention" in done.stdout
    for row in report["decode"]:
        assert {"batch", "context", "gqa", "kv_bytes", "results"} <= row.keys()
        triton_result = row["results"]["triton"]
        assert triton_result["max_abs_error"] < 1e-4
        assert triton_result["seconds"] > 0 and 0 < triton_result["fraction_of_peak"]
    for row in report["prefill"]:
        assert {"batch", "seq_len", "flops", "results"} <= row.keys()
        assert row["results"]["triton"]["tflops"] > 0
        assert row["results"]["triton"]["max_abs_error"] < 1e-4
    assert {(row["rows"], row["kernel"]) for row in report["q8_0"]} == {
        (1, "gemv"),
        (3, "gemv"),
        (17, "gemm"),
    }
    for row in report["q8_0"]:
        assert {"out_features", "in_features", "bytes", "flops", "max_abs_reference"} <= row.keys()
        for peer in ("triton", "torch_dequantize"):
            assert row["results"][peer]["max_abs_error"] < 1e-4 * max(1.0, row["max_abs_reference"])
            assert row["results"][peer]["bandwidth_bytes_per_s"] > 0
