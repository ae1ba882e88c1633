"""The KV-cache layout both tiers must agree on before any KV block moves.

Per layer, K and V are each ``[num_blocks, block_size, num_kv_heads, head_dim]``; a quantized
cache (int8, fp8 e4m3) also has one fp32 scale per token and KV head, ``[num_blocks, block_size,
num_kv_heads]`` for K and for V. Layers are grouped by attention window (`engine.kv_layout`), each
group with its own block table, and a sliding-window group only ever needs its last window's blocks:
the wire moves blocks per group, so both tiers must group the layers alike. Two replicas can exchange
blocks only when they run the same model with the same layout; the compatibility hash folds all of
that (the KV dtype and the attention layout included, plus the wire-format version) into one string
that the tiers compare in a handshake, so a mismatch fails fast instead of filling a cache with garbage.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from base.kv_dtypes import SCALE_DTYPE, is_quantized
from engine.kv_layout import KVGroup, first_visible_block
from engine.kv_layout import KVLayout as AttentionLayout
from kv_transfer.errors import KVLayoutMismatchError
from protos.tandem.internal.v1 import prefill_pb2

# Bump whenever the meaning of KVChunk's bytes or their size limit changes: replicas on different
# versions then get different compatibility hashes and refuse to talk. 2: KV messages of up to 4 MiB of
# payload (1 MiB before), which a version-1 receiver refuses as too large. 3: quantized KV (int8, fp8
# e4m3), whose payload carries the elements and then their fp32 scales, keys Hadamard-rotated
# (`kernels.kv_quant.kv_rotation`). 4: KV per attention group (KVChunk.group, its layer range indexing
# the group's layers), a sliding-window group sending only the blocks still in its window; the attention
# layout is part of the hash.
WIRE_FORMAT_VERSION = 4

_DTYPES_BY_NAME: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
_NAMES_BY_DTYPE: dict[torch.dtype, str] = {dtype: name for name, dtype in _DTYPES_BY_NAME.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a supported KV dtype ("float32", "bfloat16", "float16", "int8", "float8_e4m3fn")."""
    try:
        return _NAMES_BY_DTYPE[dtype]
    except KeyError:
        raise KVLayoutMismatchError(
            f"unsupported KV dtype {dtype}; supported: {', '.join(_DTYPES_BY_NAME)}"
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype for a wire name; the name came from the network, so reject unknown ones."""
    try:
        return _DTYPES_BY_NAME[name]
    except KeyError:
        raise KVLayoutMismatchError(
            f"unsupported KV dtype name {name!r}; supported: {', '.join(_DTYPES_BY_NAME)}"
        ) from None


@dataclass(frozen=True)
class KVLayout:
    """Shape and element type of one replica's paged KV cache (int8 and fp8 e4m3 carry scales), and its
    attention layout: which layers share a block table, and over what window they attend.

    `attention` None means one full-attention group holding every layer (what every model had before
    sliding windows); such a layout given explicitly is stored as None, so equal layouts compare equal
    and a one-group model's messages stay what they were.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    attention: AttentionLayout | None = None

    def __post_init__(self) -> None:
        # Layouts also arrive from the network (from_proto), so an invalid one is a layout
        # problem, not a programming error.
        for field_name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise KVLayoutMismatchError(f"KV layout {field_name} must be a positive int, got {value!r}")
        dtype_name(self.dtype)
        _check_attention(self.groups, self.num_layers)
        if self.attention is not None and self.groups == (KVGroup(None, tuple(range(self.num_layers))),):
            object.__setattr__(self, "attention", None)

    @property
    def groups(self) -> tuple[KVGroup, ...]:
        """The attention groups, full attention first; each has its own block table per request."""
        if self.attention is None:
            return (KVGroup(None, tuple(range(self.num_layers))),)
        return self.attention.groups

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def sliding(self) -> bool:
        """Whether some group slides: a request's early blocks of it are then never sent."""
        return any(group.window is not None for group in self.groups)

    def first_sent_block(self, group: int, num_tokens: int) -> int:
        """The first logical block of `group` a prompt of `num_tokens` tokens hands over.

        The decode tier's first query sits at position `num_tokens`: a full-attention group reads every
        block, a sliding-window group only those from the one holding its window's oldest key on. The
        blocks before that have slid out for good, so they are neither reserved nor sent.
        """
        window = self.groups[group].window
        if window is None:
            return 0
        return first_visible_block(num_tokens, window, self.block_size)

    def differences(self, other: KVLayout) -> list[str]:
        """What differs from `other` (a peer's layout, "ours"), in words an operator can act on."""
        found = [
            f"{name} {getattr(self, name)} != ours {getattr(other, name)}"
            for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype")
            if getattr(self, name) != getattr(other, name)
        ]
        if self.dtype != other.dtype:
            found.append("run both tiers with the same --dtype and --kv-cache-dtype")
        if self.attention_description() != other.attention_description():
            found.append(
                f"attention layout {self.attention_description()} != ours {other.attention_description()} "
                "(layers grouped by window differently: another model config or tandem version)"
            )
        return found

    def attention_description(self) -> str:
        """The attention groups in one line, e.g. ``full:[0, 6] window 512:[1, 2, 3, 4, 5]``."""
        return " ".join(
            f"{'full' if g.window is None else f'window {g.window}'}:{list(g.layers)}" for g in self.groups
        )

    @property
    def dtype_name(self) -> str:
        """The dtype's wire name."""
        return dtype_name(self.dtype)

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """Shape of one block of K (or V) in one layer: ``(block_size, num_kv_heads, head_dim)``."""
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def quantized(self) -> bool:
        """Whether the cache carries a scale per token and KV head beside its elements."""
        return is_quantized(self.dtype)

    @property
    def scale_shape(self) -> tuple[int, int]:
        """Shape of one block of K (or V) scales in one layer: ``(block_size, num_kv_heads)``."""
        return (self.block_size, self.num_kv_heads)

    def element_size(self) -> int:
        """Bytes of one cache element."""
        return torch.empty((), dtype=self.dtype).element_size()

    def data_bytes(self) -> int:
        """Bytes of the K (or V) elements of one block in one layer."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.element_size()

    def scale_bytes(self) -> int:
        """Bytes of the K (or V) scales of one block in one layer; 0 for a cache that is not quantized."""
        if not self.quantized:
            return 0
        return self.block_size * self.num_kv_heads * torch.empty((), dtype=SCALE_DTYPE).element_size()

    def block_bytes(self) -> int:
        """Bytes of K plus V of one block in one layer, scales included: the unit KV messages are made of."""
        return 2 * (self.data_bytes() + self.scale_bytes())

    def to_proto(self) -> prefill_pb2.KVLayout:
        """The layout as the internal API's KVLayout message."""
        return prefill_pb2.KVLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
            dtype=self.dtype_name,
            groups=[
                prefill_pb2.KVGroup(window=group.window or 0, layers=group.layers)
                for group in (self.attention.groups if self.attention is not None else ())
            ],
        )

    @classmethod
    def from_proto(cls, msg: prefill_pb2.KVLayout) -> KVLayout:
        """Parse a peer's layout; raises KVLayoutMismatchError for an unknown dtype, a zero size, or
        attention groups that do not hold each layer exactly once."""
        attention = None
        if msg.groups:
            groups = tuple(KVGroup(group.window or None, tuple(group.layers)) for group in msg.groups)
            _check_attention(groups, msg.num_layers)
            attention = AttentionLayout(groups, num_slots=max(len(group.layers) for group in groups))
        return cls(
            num_layers=msg.num_layers,
            num_kv_heads=msg.num_kv_heads,
            head_dim=msg.head_dim,
            block_size=msg.block_size,
            dtype=dtype_from_name(msg.dtype),
            attention=attention,
        )


def _check_attention(groups: tuple[KVGroup, ...], num_layers: int) -> None:
    """Every layer in exactly one non-empty group; windows positive."""
    layers = sorted(layer for group in groups for layer in group.layers)
    if layers != list(range(num_layers)) or any(not group.layers for group in groups):
        raise KVLayoutMismatchError(
            f"attention groups {[list(group.layers) for group in groups]} do not hold each of the "
            f"{num_layers} layers exactly once"
        )
    bad = [group.window for group in groups if group.window is not None and group.window < 1]
    if bad:
        raise KVLayoutMismatchError(f"attention windows must be positive, got {bad}")


def compatibility_hash(model_fingerprint: str, layout: KVLayout) -> str:
    """SHA-256 hex of everything that must match for KV blocks to be interchangeable.

    The canonical string is JSON with sorted keys, so no choice of fingerprint text can make
    two different (fingerprint, layout) pairs collide by running fields together.
    """
    canonical = json.dumps(
        {
            "wire_format_version": WIRE_FORMAT_VERSION,
            "model_fingerprint": model_fingerprint,
            "num_layers": layout.num_layers,
            "num_kv_heads": layout.num_kv_heads,
            "head_dim": layout.head_dim,
            "block_size": layout.block_size,
            "dtype": layout.dtype_name,
            "attention": [{"window": group.window, "layers": list(group.layers)} for group in layout.groups],
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()
