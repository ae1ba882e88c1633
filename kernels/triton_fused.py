"""Fused elementwise ops of a decoder layer: RMSNorm (+ residual add), in-place RoPE, SiLU-and-mul.

Each is a handful of torch ops that would read and write the activations several times; on a GPU
one pass over memory is what they cost fused. Rounding follows the torch references step by step
(the residual sum and the normalised row are rounded to the activation dtype where the
reference rounds them), so bf16 results stay within a rounding of the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import KernelLaunch, launch


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as a 2-D `[rows, last]` view with a contiguous last dim (copying only if it must)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    eps,
    hidden,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm with an optional residual add first; returns (normed, new residual) like the reference.

    Without a residual the returned residual is `x` itself, as in the reference.
    """
    hidden = x.shape[-1]
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    residual_rows = _rows(residual) if residual is not None else rows
    residual_out = torch.empty_like(rows) if residual is not None else rows
    if rows.shape[0]:
        args = (
            rows,
            residual_rows,
            weight,
            out,
            residual_out,
            eps,
            hidden,
            rows.stride(0),
            residual_rows.stride(0),
            out.stride(0),
            residual_out.stride(0),
        )
        constexprs = {"HAS_RESIDUAL": residual is not None, "BLOCK": triton.next_power_of_2(hidden)}
        num_warps = 4 if hidden <= 4096 else 8
        launch(KernelLaunch(_rms_norm_kernel, (rows.shape[0],), args, constexprs, num_warps))
    new_residual = residual_out.view(x.shape) if residual is not None else x
    return out.view(x.shape), new_residual


@triton.jit
def _rotate_heads(
    ptr,
    row_offset,
    stride_head,
    num_heads,
    c1,
    c2,
    s1,
    s2,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """Rotate-half RoPE of all heads of one token, in place: (x1, x2) -> (x1·c1 − x2·s1, x2·c2 + x1·s2)."""
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HALF_PAD)
    mask = (heads < num_heads)[:, None] & (dims < HALF)[None, :]
    first = ptr + row_offset + heads[:, None] * stride_head + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * c1[None, :] - x2 * s1[None, :]
    out2 = x2 * c2[None, :] + x1 * s2[None, :]
    tl.store(first, out1.to(ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, out2.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_cos,
    stride_sin,
    num_q_heads,
    num_k_heads,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    mask = dims < HALF
    cos_row = cos_ptr + token * stride_cos
    sin_row = sin_ptr + token * stride_sin
    c1 = tl.load(cos_row + dims, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_row + HALF + dims, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_row + dims, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_row + HALF + dims, mask=mask, other=0.0).to(tl.float32)
    q_row = token * stride_q_token
    k_row = token * stride_k_token
    _rotate_heads(q_ptr, q_row, stride_q_head, num_q_heads, c1, c2, s1, s2, Q_HEADS_PAD, HALF, HALF_PAD)
    _rotate_heads(k_ptr, k_row, stride_k_head, num_k_heads, c1, c2, s1, s2, K_HEADS_PAD, HALF, HALF_PAD)


def apply_rope(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE applied *in place* to q `[T, heads, d]` and k `[T, kv_heads, d]`; returns them.

    q and k may be strided views into one fused qkv tensor; rotating them there saves the copies
    the reference makes. cos/sin are `[T, d]`.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_k_heads = key.shape[1]
    if head_dim % 2 or key.shape[2] != head_dim or cos.shape != (num_tokens, head_dim):
        shapes = f"q {tuple(query.shape)}, k {tuple(key.shape)}, cos {tuple(cos.shape)}"
        raise ValueError(f"RoPE shapes do not fit: {shapes}")
    if query.stride(-1) != 1 or key.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("RoPE needs a contiguous head_dim in q, k, cos and sin")
    if num_tokens == 0:
        return query, key
    half = head_dim // 2
    args = (
        query,
        key,
        cos,
        sin,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos.stride(0),
        sin.stride(0),
        num_q_heads,
        num_k_heads,
    )
    constexprs = {
        "Q_HEADS_PAD": triton.next_power_of_2(num_q_heads),
        "K_HEADS_PAD": triton.next_power_of_2(num_k_heads),
        "HALF": half,
        "HALF_PAD": triton.next_power_of_2(half),
    }
    launch(KernelLaunch(_rope_kernel, (num_tokens,), args, constexprs, num_warps=4))
    return query, key


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, width, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
    out = activated.to(tl.float32) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


SILU_BLOCK = 1024


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) * up, with gate and up concatenated on the last dim (like the reference)."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim {gate_up.shape[-1]} is not gate and up of one width")
    width = gate_up.shape[-1] // 2
    rows = _rows(gate_up)
    out = torch.empty((rows.shape[0], width), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        block = min(SILU_BLOCK, triton.next_power_of_2(width))
        grid = (rows.shape[0], triton.cdiv(width, block))
        args = (rows, out, width, rows.stride(0), out.stride(0))
        launch(KernelLaunch(_silu_and_mul_kernel, grid, args, {"BLOCK": block}, num_warps=4))
    return out.view(*gate_up.shape[:-1], width)
