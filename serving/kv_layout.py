"""The KV layout of an engine and the identity of the weights it computes KV with: what a prefill replica
sends and what a decode replica must receive. Both sides derive them here, so the compatibility
handshake compares like with like."""

from __future__ import annotations

import torch

from engine.config import dtype_name
from engine.engine import Engine
from engine.quantization import weights_fingerprint
from kernels.block_linear import BlockLinear
from kv_transfer import KVLayout


def engine_kv_layout(engine: Engine) -> KVLayout:
    """The layout of this engine's paged KV cache, its layers grouped by attention window."""
    model = engine.model_config
    return KVLayout(
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        block_size=engine.block_size,
        dtype=engine.kv_dtype,
        attention=model.kv_layout,
    )


def engine_fingerprint(engine: Engine, model_fingerprint: str) -> str:
    """The fingerprint this engine announces: the checkpoint's, marked with its weight quantization and,
    unless fp32, its compute dtype, so tiers whose weights are quantized or cast differently (and so compute
    different KV) refuse each other. The KV layout's dtype alone would miss `--dtype bfloat16` against
    `--dtype float32` when both quantize the cache (`--kv-cache-dtype int8`)."""
    keeps_blocks = any(isinstance(module, BlockLinear) for module in engine.model.modules())
    fingerprint = weights_fingerprint(model_fingerprint, engine.config.quantization, keeps_blocks)
    if engine.dtype == torch.float32:
        return fingerprint
    return f"{fingerprint}+{dtype_name(engine.dtype)}-compute"
