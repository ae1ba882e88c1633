"""Finding NaN and infinity in received KV bytes, before they reach the cache.

A CRC32C proves that the bytes are the ones the sender meant; it cannot prove that the sender's numbers
were sane. A prefill replica with broken numerics (or a rogue one) can send NaN values or NaN and
infinite scales with a valid checksum, and once written they poison every token decoded over them and,
through the prefix cache, every later request that shares their prefix.

An IEEE 754 value is NaN or ±infinity exactly when all its exponent bits are set; fp8 e4m3fn has no
infinity and a single NaN pattern per sign, S.1111.111, which the same test catches with a mask over its
exponent and mantissa. So the payload is read as unsigned integers of the element's width and tested
against one mask: the same code for every KV dtype, bf16 and fp8 included (numpy has no type for them).
On the host numpy does it in about 0.3 ms per 4 MiB message, close to the CRC32C's 0.2 ms; the
`torch.isfinite` equivalent took 2 to 60 ms on a busy two-core machine.
"""

from __future__ import annotations

import numpy as np
import torch

# Per floating KV dtype: the unsigned integer of its width, and the bits that are all set in a NaN or an
# infinity (and in nothing else).
_NON_FINITE_MASKS: dict[torch.dtype, tuple[type[np.unsignedinteger], int]] = {
    torch.float32: (np.uint32, 0x7F80_0000),
    torch.float16: (np.uint16, 0x7C00),
    torch.bfloat16: (np.uint16, 0x7F80),
    torch.float8_e4m3fn: (np.uint8, 0x7F),
}


def count_non_finite(data: memoryview | bytes, dtype: torch.dtype) -> int:
    """How many values of `dtype` in `data` (raw little-endian elements) are NaN or infinite; 0 for an
    integer dtype (int8 KV elements), whose values are all finite."""
    if not dtype.is_floating_point:
        return 0
    try:
        unsigned, mask = _NON_FINITE_MASKS[dtype]
    except KeyError:
        raise ValueError(f"no finiteness test for KV dtype {dtype}") from None
    bits = np.frombuffer(data, dtype=unsigned)
    return int(np.count_nonzero((bits & unsigned(mask)) == mask))
