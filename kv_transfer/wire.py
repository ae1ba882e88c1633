"""The KV wire format: turning a request's KV blocks into KVChunk messages and back.

A chunk carries a run of logical blocks of one attention group (`KVLayout.groups`) for a run of that
group's layers as one C-contiguous tensor of shape ``[2 (K, V), layers, blocks, block_size,
num_kv_heads, head_dim]`` in raw little-endian bytes, with a CRC32C. Each group has its own block
table, and a sliding-window group hands over only the blocks from `KVLayout.first_sent_block` on: the
rest has slid out of every one of its layers' windows before the decode tier's first query, so it is
never sent (and never reserved by the receiver). A model with one group (every layer attends
globally) sends group 0, whose layer indices are the model's, and its bytes are what they were before
groups existed. A quantized cache's chunk (int8, fp8 e4m3) carries those elements and, right after
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

from base.kv_dtypes import SCALE_DTYPE
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
    layer_start: int  # within the group's layers
    num_layers: int
    group: int = 0


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
    num_blocks: int, layout: KVLayout, max_payload_bytes: int = MAX_MESSAGE_BYTES, group: int = 0
) -> list[ChunkSpan]:
    """Split ``num_blocks`` blocks x all layers of ``group`` into messages of at most ``max_payload_bytes``.

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
    num_layers = len(layout.groups[group].layers)
    layers_per_message = min(num_layers, max_payload_bytes // block_bytes)
    if layers_per_message == num_layers:
        blocks_per_message = max_payload_bytes // (num_layers * block_bytes)
    else:
        blocks_per_message = 1
    return [
        ChunkSpan(block_offset, block_count, layer_start, layer_count, group)
        for block_offset, block_count in _split_evenly(num_blocks, blocks_per_message)
        for layer_start, layer_count in _split_evenly(num_layers, layers_per_message)
    ]


def plan_transfer(
    layout: KVLayout,
    num_tokens: int,
    logical_start: int,
    num_blocks: int,
    max_payload_bytes: int = MAX_MESSAGE_BYTES,
) -> list[tuple[int, ChunkSpan]]:
    """The messages carrying logical blocks [logical_start, +num_blocks) of a ``num_tokens``-token
    request, group by group: (first logical block, span) each, the span's offset counted from it.

    A sliding-window group's range starts no earlier than `KVLayout.first_sent_block`, so a block that
    will have slid out of its window by the decode tier's first query is never planned.
    """
    planned = []
    for group in range(layout.num_groups):
        first = max(logical_start, layout.first_sent_block(group, num_tokens))
        count = logical_start + num_blocks - first
        if count > 0:
            planned.extend((first, span) for span in plan_chunks(count, layout, max_payload_bytes, group))
    return planned


def transfer_payload_bytes(
    layout: KVLayout, num_tokens: int, first_block: int = 0, max_payload_bytes: int = MAX_MESSAGE_BYTES
) -> int:
    """KV payload bytes a request of ``num_tokens`` tokens puts on the wire when the receiver already
    holds its first ``first_block`` blocks (what the sizes of sliding-window savings are measured by)."""
    num_blocks = -(-num_tokens // layout.block_size) - first_block
    return sum(
        span.num_layers * span.num_blocks * layout.block_bytes()
        for _, span in plan_transfer(layout, num_tokens, first_block, num_blocks, max_payload_bytes)
    )


BlockTables = Sequence[int] | Sequence[Sequence[int]]
"""A request's block tables, one per attention group in layout order (``table[i]`` is the physical
block of logical block i, `engine.kv_layout.NULL_BLOCK` where a block slid out); a model with one
group may pass its one table alone."""


def _tables(block_tables: BlockTables, layout: KVLayout) -> list[Sequence[int]]:
    """The tables per group; raises ValueError when there is not one per group (a local bug)."""
    if len(block_tables) == 0 or isinstance(block_tables[0], int):
        tables: list[Sequence[int]] = [block_tables]  # type: ignore[list-item]
    else:
        tables = list(block_tables)  # type: ignore[arg-type]
    if len(tables) != layout.num_groups:
        raise ValueError(f"{len(tables)} block tables for a layout of {layout.num_groups} attention groups")
    return tables


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

    The block table is the caller's own, so a bad entry (a slid-out block among them too) is a local
    bug (ValueError), but it is still checked up front: an out-of-range index found halfway through a
    write would leave some layers written and others not.
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
        block_tables: BlockTables,
        logical_start: int,
        num_blocks: int,
        *,
        num_tokens: int,
        max_payload_bytes: int = MAX_MESSAGE_BYTES,
    ) -> Iterator[KVFrame]:
        """KV messages carrying logical blocks [logical_start, logical_start + num_blocks), all layers,
        group by group; a sliding-window group's blocks before `KVLayout.first_sent_block` are left out.

        ``block_tables`` holds each group's table (`BlockTables`) and ``num_tokens`` how many tokens
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
        tables = _tables(block_tables, self.layout)
        shortest = min(len(table) for table in tables)
        if logical_start < 0 or num_blocks < 0 or logical_start + num_blocks > shortest:
            raise ValueError(
                f"logical blocks [{logical_start}, {logical_start + num_blocks}) are not within the "
                f"block tables' {shortest} blocks"
            )
        if num_blocks and not (logical_start + num_blocks - 1) * self.layout.block_size < num_tokens:
            raise ValueError(
                f"logical blocks [{logical_start}, {logical_start + num_blocks}) reach past the "
                f"request's {num_tokens} tokens"
            )
        planned = plan_transfer(self.layout, num_tokens, logical_start, num_blocks, max_payload_bytes)
        physical = [
            _physical_blocks(
                tables[span.group], first + span.block_offset, span.num_blocks, self.num_physical_blocks
            )
            for first, span in planned
        ]
        return self._frames(planned, physical, num_tokens)

    def layers_of(self, span: ChunkSpan | prefill_pb2.KVChunk) -> tuple[int, ...]:
        """The model layers a span or chunk covers: its range of its group's layers."""
        return self.layout.groups[span.group].layers[span.layer_start : span.layer_start + span.num_layers]

    def _frames(
        self, planned: list[tuple[int, ChunkSpan]], physical: list[list[int]], num_tokens: int
    ) -> Iterator[KVFrame]:
        layout = self.layout
        spans = [span for _, span in planned]
        staging = _DeviceStaging(self, spans) if self._rows is None and spans else None
        for (group_first, span), blocks in zip(planned, physical, strict=True):
            first = group_first + span.block_offset
            # Slots of the span's last block that belong to the request.
            used_slots = min(
                layout.block_size, num_tokens - (first + span.num_blocks - 1) * layout.block_size
            )
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
                group=span.group,
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
                for layer in self.layers_of(span):
                    layer_rows = rows[layer]
                    pieces.extend(layer_rows[start : start + count] for start, count in runs)
                    pieces.append(layer_rows[last, :used_bytes])
                    if tail:
                        pieces.append(tail)
        return pieces

    # -- receiving -------------------------------------------------------------------------------

    def write(
        self, chunk: KVFrame | prefill_pb2.KVChunk, block_tables: BlockTables, num_logical_blocks: int
    ) -> int:
        """Write a received chunk into the request's blocks; returns the payload bytes written.

        ``chunk`` is a frame from ``parse_response`` or a KVChunk parsed by protobuf. ``block_tables``
        are the receiver's own tables for the request (`BlockTables`) and ``num_logical_blocks`` the
        length of the request's tables; a block the receiver did not reserve (a sliding-window group's
        block that slid out, `NULL_BLOCK` in its table) is refused with KVRangeError. Every field of
        the chunk is validated before anything is written, so a rejected chunk (KVRangeError,
        KVLayoutMismatchError, KVPayloadSizeError, KVChecksumError, KVNonFiniteError) leaves the cache
        untouched. The payload is read where it was received and
        copied once, into the physical blocks (plus a host-to-device transfer when the cache is on a GPU).
        """
        tables = _tables(block_tables, self.layout)
        if not 0 <= num_logical_blocks <= min(len(table) for table in tables):
            raise ValueError(
                f"{num_logical_blocks} reserved blocks, but the block tables have "
                f"{[len(table) for table in tables]}"
            )
        if isinstance(chunk, KVFrame):
            header, payload = chunk.header, chunk.payload
        else:
            # Each read of a upb bytes field returns a fresh copy, so read it exactly once.
            header, payload = chunk, memoryview(chunk.payload)
        _validate_chunk(header, payload, self.layout, num_logical_blocks)
        table = tables[header.group]
        block_end = header.block_start + header.num_blocks
        if any(block < 0 for block in table[header.block_start : block_end]):
            raise KVRangeError(
                f"chunk blocks [{header.block_start}, {block_end}) of group {header.group} include blocks "
                "not reserved here: they slid out of the group's window before decoding starts"
            )
        physical = _physical_blocks(table, header.block_start, header.num_blocks, self.num_physical_blocks)
        if self._rows is None:
            self._scatter_on_device(header, payload, physical)
        else:
            self._scatter_on_host(header, payload, physical)
        logger.debug(
            "wrote KV group %d layers [%d, %d) blocks [%d, %d): %d bytes",
            header.group,
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
                for offset, layer in enumerate(self.layers_of(header)):
                    rows[layer][blocks] = source[kv, offset]

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
                for offset, layer in enumerate(self.layers_of(header)):
                    caches[layer].view(torch.uint8).index_copy_(0, index, data[kv, offset])


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
                for offset, layer in enumerate(self._kv.layers_of(span)):
                    cache = caches[layer].view(torch.uint8)
                    torch.index_select(cache, 0, index, out=staging[kv, offset])
            staging[:, :, -1, used_slots:] = 0
            host = pinned[:size]
            host.copy_(staging.view(-1))
            pieces.append(host.numpy())
        return pieces


def encode_blocks(
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    block_tables: BlockTables,
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
        block_tables, logical_start, num_blocks, num_tokens=num_tokens, max_payload_bytes=max_payload_bytes
    )


def write_chunk(
    chunk: KVFrame | prefill_pb2.KVChunk,
    layout: KVLayout,
    block_tables: BlockTables,
    num_logical_blocks: int,
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    k_scales: Sequence[torch.Tensor] | None = None,
    v_scales: Sequence[torch.Tensor] | None = None,
) -> int:
    """``PagedKV.write`` for a one-off chunk; long-lived receivers keep a PagedKV instead."""
    return PagedKV(k_caches, v_caches, layout, k_scales, v_scales).write(
        chunk, block_tables, num_logical_blocks
    )


def _validate_chunk(
    chunk: prefill_pb2.KVChunk, payload: memoryview, layout: KVLayout, num_logical_blocks: int
) -> None:
    """Raise the matching KVTransferError for anything wrong with a received chunk's header or payload."""
    if chunk.group >= layout.num_groups:
        raise KVRangeError(f"chunk group {chunk.group} is not one of the layout's {layout.num_groups} groups")
    layer_end = chunk.layer_start + chunk.num_layers
    group_layers = len(layout.groups[chunk.group].layers)
    if chunk.num_layers == 0 or layer_end > group_layers:
        raise KVRangeError(
            f"chunk layers [{chunk.layer_start}, {layer_end}) are empty or not within the "
            f"{group_layers} layers of group {chunk.group}"
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
