"""How a quantized KV cache stores its rows: the scales beside them, the rotation of its keys, and where
each element dtype can run (the dtypes themselves, their ranges and sizes, are `base.kv_dtypes`).

A quantized cache stores every (token, KV head) row of K and of V as `head_dim` narrow elements plus
one fp32 scale, symmetric: `scale = max|row| / QMAX`, `stored = round(row / scale)` (int8: round half
to even, clamped to ±127; fp8 e4m3: the cast's own rounding, clamped to ±448), and `row ≈ stored ·
scale`. A row is quantized once, when its token is written, and never again: per-token scales need
no requantization when later tokens of the block arrive, and keep one outlier token from coarsening
its neighbours (per-block scales would do both; bench/README.md, "Quantized KV cache", has the trade).

Keys are stored rotated: after RoPE, the model multiplies every key and query head by one orthonormal
(Hadamard) matrix, `kv_rotation`, which leaves each score q·k as it was and spreads the few outlier
channels of a key over all of them. A row's maximum, and with it the quantization step, then falls
to a few standard deviations: of the int8 variants measured (`python -m bench.kv_quant`), rotated keys
with per-token scales came closest to full precision. Values are stored as computed.
"""

from __future__ import annotations

import torch

from base.errors import ConfigError
from base.kv_dtypes import is_quantized, kv_cache_dtype_flag
from base.kv_dtypes import resolve_kv_cache_dtype as resolve_kv_cache_dtype  # bench.memory reads it here

# Triton converts fp8 e4m3 in hardware from Ada/Hopper on; older GPUs have no such instruction.
FP8_MIN_CUDA_CAPABILITY = (8, 9)


def check_device_supports(dtype: torch.dtype, device: torch.device, backend: str) -> None:
    """Refuse, at start, a quantized cache the device's attention kernels cannot run.

    The CPU runs both (C++ kernels, else the torch reference); CUDA runs int8 everywhere and fp8 e4m3
    under Triton only where the GPU converts it (compute capability 8.9 and up).
    """
    if not is_quantized(dtype) or device.type == "cpu":
        return
    flag = f"--kv-cache-dtype {kv_cache_dtype_flag(dtype)}"
    if device.type != "cuda":
        raise ConfigError(f"{flag} is not supported on device {device}; use cpu or cuda")
    if dtype == torch.float8_e4m3fn and backend == "triton":
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CUDA_CAPABILITY:
            raise ConfigError(
                f"{flag} needs a GPU of compute capability 8.9 or newer (Ada, Hopper) for its fp8 "
                f"conversions; {device} is {capability[0]}.{capability[1]}: use --kv-cache-dtype int8"
            )


def kv_rotation(head_dim: int) -> torch.Tensor:
    """The orthonormal `[head_dim, head_dim]` fp32 matrix quantized caches store keys rotated by.

    Sylvester's Hadamard matrix of the largest power of two dividing `head_dim` (entries ±1, scaled to
    unit rows), repeated along the diagonal: built from integers, so every device and tier builds the
    same one.
    """
    block = head_dim & -head_dim
    hadamard = torch.ones(1, 1)
    while hadamard.shape[0] < block:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0)
    return torch.block_diag(*[hadamard] * (head_dim // block)) / block**0.5
