"""The KV layout of an engine: what a prefill replica computes and sends, and what a decode replica
must receive. Both sides derive it here, so the compatibility handshake compares like with like."""

from __future__ import annotations

from engine.engine import Engine
from kv_transfer import KVLayout


def engine_kv_layout(engine: Engine) -> KVLayout:
    """The layout of this engine's paged KV cache."""
    model = engine.model_config
    return KVLayout(
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        block_size=engine.block_size,
        dtype=engine.kv_dtype,
    )
