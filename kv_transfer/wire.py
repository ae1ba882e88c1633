"""The KV wire format: turning a request's KV blocks into KVChunk messages and back.

A chunk carries a run of logical blocks for a run of layers as one C-contiguous tensor of shape
``[2 (K, V), layers, blocks, block_size, num_kv_heads, head_dim]`` in raw little-endian bytes,
with a CRC32C. A quantized cache's chunk (int8, fp8 e4m3) carries those elements and, right after
them, their fp32 scales ``[2 (K, V), layers, blocks, block_size, num_kv_heads]``: a quarter of the
fp32 bytes plus 4 bytes per token and head. Sender and receiver have their own block tables (the same
logical block sits in different physical blocks on each side), so the wire only ever speaks logical
block indices.

Nothing here deserializes objects: the receiver reinterprets validated bytes as numbers, so a
hostile or corrupted peer can at worst be refused, never run code or write outside the blocks
reserved for its request.
"""

from __future__ import annotations

import logging
import math
import sys
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import crc32c
import numpy as np
import torch

from kernels.kv_quant import SCALE_DTYPE
from kv_transfer.errors import (
    KVChecksumError,
    KVLayoutMismatchError,
    KVNonFiniteError,
    KVPayloadSizeError,
    KVRangeError,
)
from kv_transfer.finite import count_non_finite
from kv_transfer.framing import KVFrame, frame_kv
from kv_transfer.layout import KVLayout
from protos.tandem.internal.v1 import prefill_pb2

if TYPE_CHECKING:
    from engine.kv_cache import KVCache

logger = logging.getLogger(__name__)

if sys.byteorder != "little":
    # The wire format is little-endian and payloads are the tensors' native bytes.
    raise ImportError("kv_transfer.wire supports little-endian hosts only")

MAX_MESSAGE_BYTES = 4 << 20
"""Payload budget of one KVChunk; servers set gRPC's max message size a little above it.

Every message costs both sides a fixed amount of Python and gRPC work, so CPU per byte falls as
messages grow, up to about this size (bench.kv_wire; bench/README.md, "KV transfer"); larger messages
only hold more memory per stream and start arriving later. Raising it breaks receivers that cap
messages lower, hence WIRE_FORMAT_VERSION 2."""


@dataclass(frozen=True)
class ChunkSpan:
    """Which part of a transfer one message carries: blocks relative to the transfer's start."""

    block_offset: int
    num_blocks: int
    layer_start: int
    num_layers: int


def _split_evenly(total: int, max_per_part: int) -> list[tuple[int, int]]:
    """(start, count) parts covering [0, total), as few as the limit allows and near-equal in size.

    Equal parts keep messages of one transfer similar in size instead of ending on a runt.
    """
    num_parts = math.ceil(total / max_per_part)
    base, extra = divmod(total, num_parts)
    parts = []
    start = 0
    for index in range(num_parts):
        count = base + (1 if index < extra else 0)
        parts.append((start, count))
        start += count
    return parts


def plan_chunks(
    num_blocks: int, layout: KVLayout, max_payload_bytes: int = MAX_MESSAGE_BYTES
) -> list[ChunkSpan]:
    """Split ``num_blocks`` blocks x all layers into messages of at most ``max_payload_bytes``.

    Messages hold whole blocks of whole layers. When all layers of a block fit, a message takes
    all layers of as many blocks as fit; otherwise each block is sent as runs of layers. Raises
    KVPayloadSizeError when a single block of a single layer exceeds the budget, since no split
    could then respect it.
    """
    block_bytes = layout.block_bytes()
    if block_bytes > max_payload_bytes:
        raise KVPayloadSizeError(
            f"one KV block of one layer is {block_bytes} bytes, more than the {max_payload_bytes}-byte "
            f"message budget (block_size={layout.block_size}, num_kv_heads={layout.num_kv_heads}, "
            f"head_dim={layout.head_dim}, dtype={layout.dtype_name})"
        )
    if num_blocks == 0:
        return []
    layers_per_message = min(layout.num_layers, max_payload_bytes // block_bytes)
    if layers_per_message == layout.num_layers:
        blocks_per_message = max_payload_bytes // (layout.num_layers * block_bytes)
    else:
        blocks_per_message = 1
    return [
        ChunkSpan(block_offset, block_count, layer_start, layer_count)
        for block_offset, block_count in _split_evenly(num_blocks, blocks_per_message)
        for layer_start, layer_count in _split_evenly(layout.num_layers, layers_per_message)
    ]


@dataclass(frozen=True)
class _Plane:
    """One kind of per-layer tensor a block spans: the K and V elements, or a quantized cache's K and V
    scales. The payload holds the planes one after the other, each ``[2, layers, blocks, *block_shape]``."""

    caches: tuple[list[torch.Tensor], list[torch.Tensor]]
    dtype: torch.dtype
    block_shape: tuple[int, ...]
    block_bytes: int  # of K (or V) in one layer

    @property
    def slot_bytes(self) -> int:
        return self.block_bytes // self.block_shape[0]

    @property
    def byte_shape(self) -> tuple[int, ...]:
        """`block_shape` of the tensors' uint8 views (the last dim counts bytes): the device path moves
        bytes, which every dtype has, where torch's copies lack some dtypes (fp8) on some devices."""
        return (*self.block_shape[:-1], self.block_bytes // math.prod(self.block_shape[:-1]))


def _planes(
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    layout: KVLayout,
    k_scales: Sequence[torch.Tensor] | None,
    v_scales: Sequence[torch.Tensor] | None,
) -> list[_Plane]:
    """The local tensors as planes, checked against the local layout (scales given iff it is quantized)."""
    planes = [_Plane((list(k_caches), list(v_caches)), layout.dtype, layout.block_shape, layout.data_bytes())]
    if layout.quantized != (k_scales is not None and v_scales is not None):
        raise KVLayoutMismatchError(
            f"a {layout.dtype_name} KV layout needs {'both' if layout.quantized else 'no'} K and V scales"
        )
    if k_scales is not None and v_scales is not None:
        scales = (list(k_scales), list(v_scales))
        planes.append(_Plane(scales, SCALE_DTYPE, layout.scale_shape, layout.scale_bytes()))
    num_physical_blocks = k_caches[0].shape[0] if len(k_caches) else 0
    for plane in planes:
        _check_plane(plane, layout.num_layers, num_physical_blocks)
    return planes


def _check_plane(plane: _Plane, num_layers: int, num_physical_blocks: int) -> None:
    for name, caches in zip(("K", "V"), plane.caches, strict=True):
        if len(caches) != num_layers:
            raise KVLayoutMismatchError(f"expected {num_layers} {name} tensors, got {len(caches)}")
    expected = (num_physical_blocks, *plane.block_shape)
    for layer, (k_cache, v_cache) in enumerate(zip(*plane.caches, strict=True)):
        for name, cache in (("K", k_cache), ("V", v_cache)):
            if tuple(cache.shape) != expected or cache.dtype != plane.dtype or not cache.is_contiguous():
                raise KVLayoutMismatchError(
                    f"layer {layer} {name} tensor is {tuple(cache.shape)} {cache.dtype}, "
                    f"expected {expected} {plane.dtype} and contiguous"
                )


def _physical_blocks(
    block_table: Sequence[int], logical_start: int, num_blocks: int, num_physical: int
) -> list[int]:
    """The physical block ids of logical blocks [logical_start, +num_blocks).

    The block table is the caller's own, so a bad entry is a local bug (ValueError), but it is
    still checked up front: an out-of-range index found halfway through a write would leave
    some layers written and others not.
    """
    physical = [int(block) for block in block_table[logical_start : logical_start + num_blocks]]
    bad = [block for block in physical if not 0 <= block < num_physical]
    if bad:
        raise ValueError(f"block table entries {bad} are outside the cache's {num_physical} blocks")
    return physical


def _runs(physical: list[int]) -> list[tuple[int, int]]:
    """(first physical block, count) of each run of consecutive physical blocks, in logical order."""
    runs: list[tuple[int, int]] = []
    for block in physical:
        if runs and runs[-1][0] + runs[-1][1] == block:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return runs


def _byte_rows(cache: torch.Tensor) -> np.ndarray:
    """A host cache as a [num_blocks, bytes per block] uint8 array sharing its memory (any dtype)."""
    return cache.view(torch.uint8).reshape(cache.shape[0], -1).numpy()


class PagedKV:
    """One replica's K/V caches (and a quantized cache's scales) as the wire reads and writes them,
    checked and viewed once.

    On the host, blocks move with numpy copies of byte rows (one per layer and run of consecutive
    physical blocks): torch's per-call overhead on a 24 KiB block is larger than the copy itself. On a
    GPU, blocks move with one gather or scatter per layer on the device and one transfer to or from
    the host per message.
    """

    def __init__(
        self,
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
        layout: KVLayout,
        k_scales: Sequence[torch.Tensor] | None = None,
        v_scales: Sequence[torch.Tensor] | None = None,
    ) -> None:
        self.layout = layout
        self.planes = _planes(k_caches, v_caches, layout, k_scales, v_scales)
        self.num_physical_blocks = k_caches[0].shape[0]
        self.device = k_caches[0].device
        # Per plane, K then V: each layer's tensor as byte rows, one row per block.
        self._rows = (
            [
                tuple([_byte_rows(cache) for cache in caches] for caches in plane.caches)
                for plane in self.planes
            ]
            if self.device.type == "cpu"
            else None
        )
        self._zeros = bytes(max(plane.block_bytes for plane in self.planes))

    @classmethod
    def of(cls, kv_cache: KVCache, layout: KVLayout) -> PagedKV:
        """The wire's view of an engine's cache (its scales too when it is quantized)."""
        if not kv_cache.quantized:
            return cls(kv_cache.k, kv_cache.v, layout)
        return cls(kv_cache.k, kv_cache.v, layout, kv_cache.k_scales, kv_cache.v_scales)

    # -- sending ---------------------------------------------------------------------------------

    def frames(
        self,
        block_table: Sequence[int],
        logical_start: int,
        num_blocks: int,
        *,
        num_tokens: int,
        max_payload_bytes: int = MAX_MESSAGE_BYTES,
    ) -> Iterator[KVFrame]:
        """KV messages carrying logical blocks [logical_start, logical_start + num_blocks), all layers.

        ``block_table[i]`` is the physical block of logical block i and ``num_tokens`` how many tokens
        the request holds. Slots at or past ``num_tokens`` go out as zeros: the request's last block
        was usually another request's block before, and its unused slots still hold that request's
        K/V. Arguments are validated here, before the first message is built, so a caller learns of a
        bad request (including KVPayloadSizeError when one block of one layer exceeds
        ``max_payload_bytes``) before it starts a stream. Messages are built lazily, one at a time.

        Copies per message on the host: one, from the cache blocks straight into the message's bytes
        (a ``join`` over views of the blocks). On a GPU the blocks are gathered on the device into a
        staging tensor and copied to a pinned host buffer (both reused by every message of the call),
        which the join then copies.
        """
        if logical_start < 0 or num_blocks < 0 or logical_start + num_blocks > len(block_table):
            raise ValueError(
                f"logical blocks [{logical_start}, {logical_start + num_blocks}) are not within the "
                f"block table's {len(block_table)} blocks"
            )
        if num_blocks and not (logical_start + num_blocks - 1) * self.layout.block_size < num_tokens:
            raise ValueError(
                f"logical blocks [{logical_start}, {logical_start + num_blocks}) reach past the "
                f"request's {num_tokens} tokens"
            )
        spans = plan_chunks(num_blocks, self.layout, max_payload_bytes)
        physical = _physical_blocks(block_table, logical_start, num_blocks, self.num_physical_blocks)
        return self._frames(spans, physical, logical_start, num_tokens)

    def _frames(
        self, spans: list[ChunkSpan], physical: list[int], logical_start: int, num_tokens: int
    ) -> Iterator[KVFrame]:
        layout = self.layout
        staging = _DeviceStaging(self, spans) if self._rows is None and spans else None
        for span in spans:
            first = logical_start + span.block_offset
            # Slots of the span's last block that belong to the request.
            used_slots = min(
                layout.block_size, num_tokens - (first + span.num_blocks - 1) * layout.block_size
            )
            blocks = physical[span.block_offset : span.block_offset + span.num_blocks]
            if staging is None:
                pieces = self._host_pieces(span, blocks, used_slots)
            else:
                pieces = staging.gather(span, blocks, used_slots)
            crc = 0
            for piece in pieces:
                crc = crc32c.crc32c(piece, crc)
            header = prefill_pb2.KVChunk(
                block_start=first,
                num_blocks=span.num_blocks,
                layer_start=span.layer_start,
                num_layers=span.num_layers,
                dtype=layout.dtype_name,
                shape=(2, span.num_layers, span.num_blocks, *layout.block_shape),
                crc32c=crc,
            )
            yield frame_kv(header, pieces)

    def _host_pieces(
        self, span: ChunkSpan, blocks: list[int], used_slots: int
    ) -> list[np.ndarray | memoryview]:
        """Views of each plane's K then V, layer by layer, of the span's blocks in wire order; the last
        block's unused slots are read from a zero buffer instead of the cache."""
        assert self._rows is not None
        runs = _runs(blocks[:-1])
        last = blocks[-1]
        pieces: list[np.ndarray | memoryview] = []
        for plane, plane_rows in zip(self.planes, self._rows, strict=True):
            used_bytes = used_slots * plane.slot_bytes
            tail = memoryview(self._zeros)[used_bytes : plane.block_bytes]
            for rows in plane_rows:
                for layer_rows in rows[span.layer_start : span.layer_start + span.num_layers]:
                    pieces.extend(layer_rows[start : start + count] for start, count in runs)
                    pieces.append(layer_rows[last, :used_bytes])
                    if tail:
                        pieces.append(tail)
        return pieces

    # -- receiving -------------------------------------------------------------------------------

    def write(
        self, chunk: KVFrame | prefill_pb2.KVChunk, block_table: Sequence[int], num_logical_blocks: int
    ) -> int:
        """Write a received chunk into the request's blocks; returns the payload bytes written.

        ``chunk`` is a frame from ``parse_response`` or a KVChunk parsed by protobuf. ``block_table``
        is the receiver's own table for the request and ``num_logical_blocks`` the number of blocks
        it reserved for it. Every field of the chunk is validated before anything is written, so a
        rejected chunk (KVRangeError, KVLayoutMismatchError, KVPayloadSizeError, KVChecksumError,
        KVNonFiniteError) leaves the cache untouched. The payload is read where it was received and
        copied once, into the physical blocks (plus a host-to-device transfer when the cache is on a GPU).
        """
        if not 0 <= num_logical_blocks <= len(block_table):
            raise ValueError(
                f"{num_logical_blocks} reserved blocks, but the block table has {len(block_table)}"
            )
        if isinstance(chunk, KVFrame):
            header, payload = chunk.header, chunk.payload
        else:
            # Each read of a upb bytes field returns a fresh copy, so read it exactly once.
            header, payload = chunk, memoryview(chunk.payload)
        _validate_chunk(header, payload, self.layout, num_logical_blocks)
        physical = _physical_blocks(
            block_table, header.block_start, header.num_blocks, self.num_physical_blocks
        )
        if self._rows is None:
            self._scatter_on_device(header, payload, physical)
        else:
            self._scatter_on_host(header, payload, physical)
        logger.debug(
            "wrote KV layers [%d, %d) blocks [%d, %d): %d bytes",
            header.layer_start,
            header.layer_start + header.num_layers,
            header.block_start,
            header.block_start + header.num_blocks,
            payload.nbytes,
        )
        return payload.nbytes

    def _plane_payloads(self, header: prefill_pb2.KVChunk, payload: memoryview) -> Iterator[memoryview]:
        """The payload cut into its planes' parts, in wire order."""
        start = 0
        for plane in self.planes:
            size = 2 * header.num_layers * header.num_blocks * plane.block_bytes
            yield payload[start : start + size]
            start += size

    def _scatter_on_host(self, header: prefill_pb2.KVChunk, payload: memoryview, physical: list[int]) -> None:
        """One numpy copy per plane and layer of K and of V: a slice when the blocks are consecutive, else
        a fancy index (a copy per block and layer costs more in Python and GIL hand-offs than the bytes)."""
        assert self._rows is not None
        runs = _runs(physical)
        blocks: slice | np.ndarray
        if len(runs) == 1:
            blocks = slice(runs[0][0], runs[0][0] + runs[0][1])
        else:
            blocks = np.asarray(physical, dtype=np.intp)
        for plane_rows, part in zip(self._rows, self._plane_payloads(header, payload), strict=True):
            source = np.frombuffer(part, dtype=np.uint8).reshape(2, header.num_layers, header.num_blocks, -1)
            for kv, rows in enumerate(plane_rows):
                for offset in range(header.num_layers):
                    rows[header.layer_start + offset][blocks] = source[kv, offset]

    def _scatter_on_device(
        self, header: prefill_pb2.KVChunk, payload: memoryview, physical: list[int]
    ) -> None:
        index = torch.tensor(physical, dtype=torch.long).to(self.device)
        for plane, part in zip(self.planes, self._plane_payloads(header, payload), strict=True):
            with warnings.catch_warnings():
                # The view is only ever a copy source.
                warnings.filterwarnings(
                    "ignore", message="The given buffer is not writable", category=UserWarning
                )
                raw = torch.frombuffer(part, dtype=torch.uint8)
            data = raw.view(2, header.num_layers, header.num_blocks, *plane.byte_shape).to(self.device)
            for kv, caches in enumerate(plane.caches):
                for offset in range(header.num_layers):
                    caches[header.layer_start + offset].view(torch.uint8).index_copy_(
                        0, index, data[kv, offset]
                    )


class _DeviceStaging:
    """One call's GPU-side gather buffers and pinned host buffers (one of each per plane), sized for
    its largest span."""

    def __init__(self, kv: PagedKV, spans: list[ChunkSpan]) -> None:
        self._kv = kv
        most = max(2 * s.num_layers * s.num_blocks for s in spans)
        self._buffers = []
        for plane in kv.planes:
            size = most * plane.block_bytes
            device = torch.empty(size, dtype=torch.uint8, device=kv.device)
            self._buffers.append((device, torch.empty(size, dtype=torch.uint8, pin_memory=True)))

    def gather(self, span: ChunkSpan, blocks: list[int], used_slots: int) -> list[np.ndarray]:
        """The span's payload in wire order, its last block's unused slots zeroed, as one host buffer
        per plane."""
        index = torch.tensor(blocks, dtype=torch.long).to(self._kv.device)
        pieces = []
        for plane, (device, pinned) in zip(self._kv.planes, self._buffers, strict=True):
            shape = (2, span.num_layers, span.num_blocks, *plane.byte_shape)
            size = math.prod(shape)
            staging = device[:size].view(shape)
            for kv, caches in enumerate(plane.caches):
                for offset in range(span.num_layers):
                    cache = caches[span.layer_start + offset].view(torch.uint8)
                    torch.index_select(cache, 0, index, out=staging[kv, offset])
            staging[:, :, -1, used_slots:] = 0
            host = pinned[:size]
            host.copy_(staging.view(-1))
            pieces.append(host.numpy())
        return pieces


def encode_blocks(
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    block_table: Sequence[int],
    logical_start: int,
    num_blocks: int,
    layout: KVLayout,
    *,
    num_tokens: int,
    max_payload_bytes: int = MAX_MESSAGE_BYTES,
    k_scales: Sequence[torch.Tensor] | None = None,
    v_scales: Sequence[torch.Tensor] | None = None,
) -> Iterator[KVFrame]:
    """``PagedKV.frames`` for a one-off transfer; long-lived senders keep a PagedKV instead."""
    return PagedKV(k_caches, v_caches, layout, k_scales, v_scales).frames(
        block_table, logical_start, num_blocks, num_tokens=num_tokens, max_payload_bytes=max_payload_bytes
    )


def write_chunk(
    chunk: KVFrame | prefill_pb2.KVChunk,
    layout: KVLayout,
    block_table: Sequence[int],
    num_logical_blocks: int,
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    k_scales: Sequence[torch.Tensor] | None = None,
    v_scales: Sequence[torch.Tensor] | None = None,
) -> int:
    """``PagedKV.write`` for a one-off chunk; long-lived receivers keep a PagedKV instead."""
    return PagedKV(k_caches, v_caches, layout, k_scales, v_scales).write(
        chunk, block_table, num_logical_blocks
    )


def _validate_chunk(
    chunk: prefill_pb2.KVChunk, payload: memoryview, layout: KVLayout, num_logical_blocks: int
) -> None:
    """Raise the matching KVTransferError for anything wrong with a received chunk's header or payload."""
    layer_end = chunk.layer_start + chunk.num_layers
    if chunk.num_layers == 0 or layer_end > layout.num_layers:
        raise KVRangeError(
            f"chunk layers [{chunk.layer_start}, {layer_end}) are empty or not within the "
            f"layout's {layout.num_layers} layers"
        )
    block_end = chunk.block_start + chunk.num_blocks
    if chunk.num_blocks == 0 or block_end > num_logical_blocks:
        raise KVRangeError(
            f"chunk blocks [{chunk.block_start}, {block_end}) are empty or not within the "
            f"{num_logical_blocks} blocks reserved for the request"
        )
    if chunk.dtype != layout.dtype_name:
        raise KVLayoutMismatchError(
            f"chunk dtype {chunk.dtype!r} differs from the layout's {layout.dtype_name!r}"
        )
    expected_shape = (2, chunk.num_layers, chunk.num_blocks, *layout.block_shape)
    if tuple(chunk.shape) != expected_shape:
        raise KVLayoutMismatchError(
            f"chunk shape {list(chunk.shape)} differs from {list(expected_shape)} expected from the layout "
            f"and the chunk's {chunk.num_layers} layers x {chunk.num_blocks} blocks"
        )
    # The elements, and a quantized layout's scales after them.
    expected_bytes = chunk.num_layers * chunk.num_blocks * layout.block_bytes()
    if payload.nbytes != expected_bytes:
        raise KVPayloadSizeError(f"chunk payload is {payload.nbytes} bytes, its shape needs {expected_bytes}")
    actual_crc = crc32c.crc32c(payload)
    if actual_crc != chunk.crc32c:
        raise KVChecksumError(
            f"chunk payload CRC32C {actual_crc:#010x} differs from the sender's {chunk.crc32c:#010x} "
            f"(layers [{chunk.layer_start}, {layer_end}), blocks [{chunk.block_start}, {block_end}))"
        )
    _check_finite(chunk, payload, layout)


def _check_finite(chunk: prefill_pb2.KVChunk, payload: memoryview, layout: KVLayout) -> None:
    """Refuse a payload (of the checked size) holding a NaN or an infinity: a K or V value of a float
    cache, or a quantized cache's scale (its int8 elements are always finite)."""
    element_bytes = 2 * chunk.num_layers * chunk.num_blocks * layout.data_bytes()
    parts = [("K/V values", payload[:element_bytes], layout.dtype)]
    if layout.quantized:
        parts.append(("K/V scales", payload[element_bytes:], SCALE_DTYPE))
    for what, part, dtype in parts:
        bad = count_non_finite(part, dtype)
        if bad:
            raise KVNonFiniteError(
                f"chunk holds {bad} NaN or infinite {what} (layers [{chunk.layer_start}, "
                f"{chunk.layer_start + chunk.num_layers}), blocks [{chunk.block_start}, "
                f"{chunk.block_start + chunk.num_blocks}))"
            )
