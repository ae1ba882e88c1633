"""What every Triton kernel of tandem shares: the paged-cache address arithmetic, the dot input dtype,
facts about the device that launch heuristics need, and the one point every launch goes through.

The address arithmetic lives in one `@triton.jit` helper so the 64-bit rule is written (and tested)
once: a cache with a few million blocks has element offsets past 2**31, and an offset computed in
int32 silently wraps and reads another sequence's keys.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# Streaming multiprocessors assumed when the kernels run without a GPU (the interpreter): an H100/H200.
DEFAULT_NUM_SMS = 132

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def is_interpreted(kernel: object) -> bool:
    """True when `kernel` was decorated under `TRITON_INTERPRET=1` and so runs in numpy on the CPU.

    Asked of the kernel object, not the environment, because the decision was taken when the
    module was imported and a later change of the variable does not change the kernel.
    """
    return isinstance(kernel, InterpretedFunction)


def dot_dtype(kernel: object, dtype: torch.dtype) -> tl.dtype:
    """The input dtype of `tl.dot` for tensors of `dtype`.

    The interpreter computes bf16/fp16 dots wrongly, so under it every dot runs in fp32; on a GPU
    half-precision inputs go to the tensor cores as they are, with fp32 accumulation.
    """
    if is_interpreted(kernel):
        return tl.float32
    return _TL_DTYPES[dtype]


def dot_precision(dtype: tl.dtype) -> str:
    """`tl.dot`'s input_precision: full fp32 for fp32 inputs (a fp32 model asked for fp32, and TF32
    would flip greedy near-ties against the reference), the default for half inputs (where it is moot).
    """
    return "ieee" if dtype == tl.float32 else "tf32"


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """How many programs run at once, to the first order: the SM count, or an H200's on a CPU."""
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@dataclass(frozen=True)
class KernelLaunch:
    """Everything one launch of a `@triton.jit` kernel is: grid, runtime arguments, constexprs, options.

    Launch sites build one and hand it to `launch`, so the specialisations they launch can be
    recorded (`recorded_launches`) and compiled ahead of time for real GPUs (`kernels.aot`) by
    the very code that plans them, instead of by a copy of their heuristics.
    """

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    constexprs: dict[str, Any] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int | None = None

    @property
    def options(self) -> dict[str, int]:
        """Triton's launch options; `num_stages` only when set, so Triton's default applies otherwise."""
        if self.num_stages is None:
            return {"num_warps": self.num_warps}
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


_recorder: contextvars.ContextVar[list[KernelLaunch] | None] = contextvars.ContextVar(
    "kernel_launch_recorder", default=None
)


def launch(spec: KernelLaunch) -> None:
    """Run `spec`, or append it to the list of an enclosing `recorded_launches` block instead."""
    recorded = _recorder.get()
    if recorded is not None:
        recorded.append(spec)
        return
    spec.kernel[spec.grid](*spec.args, **spec.constexprs, **spec.options)


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[KernelLaunch]]:
    """Within the block, kernel wrappers plan and record their launches without running them.

    The wrappers still allocate their outputs, so tensors on the `meta` device make this free.
    """
    recorded: list[KernelLaunch] = []
    token = _recorder.set(recorded)
    try:
        yield recorded
    finally:
        _recorder.reset(token)


@triton.jit
def slot_offsets(slots, block_size, stride_block, stride_token):
    """Element offsets (int64) of flat cache slots (block * block_size + row), as in the slot mapping."""
    slots = slots.to(tl.int64)
    return (slots // block_size) * stride_block + (slots % block_size) * stride_token


@triton.jit
def kv_block_ids(table_row_ptr, positions, mask, block_size):
    """Physical block ids (int64) of context `positions` of one sequence: table[p // block_size].

    `table_row_ptr` points at the sequence's row of the block table. The ids are widened to int64
    before anyone scales them, which is the whole point of this helper.
    """
    return tl.load(table_row_ptr + positions // block_size, mask=mask, other=0).to(tl.int64)


@triton.jit
def block_offsets(block_ids, positions, block_size, stride_block, stride_token):
    """Element offsets (int64) of `positions` in their blocks `block_ids` of a paged tensor with these
    strides: the cache itself, or a quantized cache's scales (whose strides differ)."""
    return block_ids * stride_block + (positions % block_size).to(tl.int64) * stride_token


@triton.jit
def kv_token_offsets(table_row_ptr, positions, mask, block_size, stride_block, stride_token):
    """Element offsets (int64) of context `positions` of one sequence in a paged cache.

    A position p lives in slot p % block_size of physical block table[p // block_size].
    """
    block_ids = kv_block_ids(table_row_ptr, positions, mask, block_size)
    return block_offsets(block_ids, positions, block_size, stride_block, stride_token)


@triton.jit
def round_half_even(x):
    """fp32 `x` (|x| < 2**22) rounded to the nearest integer, ties to even, as torch.round does:
    adding and taking away 1.5 * 2**23 leaves no fraction bits, and IEEE addition rounds to even."""
    return (x + 12582912.0) - 12582912.0


def quantized_launch_args(
    k_scales: torch.Tensor | None, v_scales: torch.Tensor | None, fallback: torch.Tensor
) -> tuple[tuple[Any, ...], bool]:
    """The scale arguments a kernel over the paged cache takes, and its QUANTIZED constexpr.

    (k_scales, v_scales, block stride, token stride, head stride) of the `[blocks, block_size,
    kv_heads]` scale caches; for a cache that is not quantized, `fallback` stands in for both
    pointers (the kernel never reads them) and the strides are 0.
    """
    if k_scales is None or v_scales is None:
        if k_scales is not None or v_scales is not None:
            raise ValueError("a quantized cache needs both K and V scales")
        return (fallback, fallback, 0, 0, 0), False
    if k_scales.dtype != torch.float32 or k_scales.stride() != v_scales.stride() or k_scales.dim() != 3:
        raise ValueError("K and V scales must be fp32 [blocks, block_size, kv_heads] of one layout")
    return (k_scales, v_scales, *k_scales.stride()), True
