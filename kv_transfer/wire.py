"""The KV wire format: turning a request's KV blocks into KVChunk messages and back.

A chunk carries a run of logical blocks for a run of layers as one C-contiguous tensor of shape
``[2 (K, V), layers, blocks, block_size, num_kv_heads, head_dim]`` in raw little-endian bytes,
with a CRC32C. Sender and receiver have their own block tables (the same logical block sits in
different physical blocks on each side), so the wire only ever speaks logical block indices.

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

import crc32c
import torch

from kv_transfer.errors import (
    KVChecksumError,
    KVLayoutMismatchError,
    KVPayloadSizeError,
    KVRangeError,
)
from kv_transfer.layout import KVLayout
from protos.tandem.internal.v1 import prefill_pb2

logger = logging.getLogger(__name__)

if sys.byteorder != "little":
    # The wire format is little-endian and payloads are the tensors' native bytes.
    raise ImportError("kv_transfer.wire supports little-endian hosts only")

MAX_MESSAGE_BYTES = 1 << 20
"""Payload budget of one KVChunk; servers set gRPC's max message size a little above it."""


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


def _check_caches(
    k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor], layout: KVLayout
) -> int:
    """Check that the local caches match the local layout; returns the number of physical blocks."""
    if len(k_caches) != layout.num_layers or len(v_caches) != layout.num_layers:
        raise KVLayoutMismatchError(
            f"expected {layout.num_layers} K and V cache tensors, got {len(k_caches)} and {len(v_caches)}"
        )
    num_physical_blocks = k_caches[0].shape[0]
    expected = (num_physical_blocks, *layout.block_shape)
    for layer, (k_cache, v_cache) in enumerate(zip(k_caches, v_caches, strict=True)):
        for name, cache in (("K", k_cache), ("V", v_cache)):
            if tuple(cache.shape) != expected or cache.dtype != layout.dtype:
                raise KVLayoutMismatchError(
                    f"layer {layer} {name} cache is {tuple(cache.shape)} {cache.dtype}, "
                    f"expected {expected} {layout.dtype}"
                )
    return num_physical_blocks


def _physical_blocks(
    block_table: Sequence[int],
    logical_start: int,
    num_blocks: int,
    num_physical_blocks: int,
    device: torch.device,
) -> torch.Tensor:
    """The physical block ids of logical blocks [logical_start, +num_blocks), as an index tensor.

    The block table is the caller's own, so a bad entry is a local bug (ValueError), but it is
    still checked up front: an out-of-range index found halfway through a write would leave
    some layers written and others not.
    """
    physical = [int(block) for block in block_table[logical_start : logical_start + num_blocks]]
    bad = [block for block in physical if not 0 <= block < num_physical_blocks]
    if bad:
        raise ValueError(f"block table entries {bad} are outside the cache's {num_physical_blocks} blocks")
    return torch.tensor(physical, dtype=torch.long, device=device)


def encode_blocks(
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    block_table: Sequence[int],
    logical_start: int,
    num_blocks: int,
    layout: KVLayout,
    max_payload_bytes: int = MAX_MESSAGE_BYTES,
) -> Iterator[prefill_pb2.KVChunk]:
    """KVChunk messages carrying logical blocks [logical_start, logical_start + num_blocks), all layers.

    ``k_caches[l]``/``v_caches[l]`` are layer l's cache tensors; ``block_table[i]`` is the
    physical block of logical block i. Arguments are validated here, before the first message
    is produced, so a caller learns of a bad request (including KVPayloadSizeError when one block
    of one layer exceeds ``max_payload_bytes``) before it starts a stream.

    Copies per message: the gather of the blocks into one contiguous staging tensor (on CUDA
    the gather runs on the device and the device-to-host transfer completes it), then one copy
    of the staging tensor into the ``bytes`` object protobuf requires. Protobuf's upb backend
    copies those bytes once more into its message arena when the field is set; its Python API
    offers no way to hand over a buffer.
    """
    num_physical_blocks = _check_caches(k_caches, v_caches, layout)
    if logical_start < 0 or num_blocks < 0 or logical_start + num_blocks > len(block_table):
        raise ValueError(
            f"logical blocks [{logical_start}, {logical_start + num_blocks}) are not within the "
            f"block table's {len(block_table)} blocks"
        )
    spans = plan_chunks(num_blocks, layout, max_payload_bytes)
    physical = _physical_blocks(
        block_table, logical_start, num_blocks, num_physical_blocks, k_caches[0].device
    )
    return _encode_spans(k_caches, v_caches, physical, logical_start, spans, layout)


def _encode_spans(
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    physical: torch.Tensor,
    logical_start: int,
    spans: list[ChunkSpan],
    layout: KVLayout,
) -> Iterator[prefill_pb2.KVChunk]:
    """Gather and serialize each planned span lazily, so only one message's staging tensor is alive."""
    for span in spans:
        span_blocks = physical[span.block_offset : span.block_offset + span.num_blocks]
        shape = (2, span.num_layers, span.num_blocks, *layout.block_shape)
        staging = torch.empty(shape, dtype=layout.dtype, device=physical.device)
        for index in range(span.num_layers):
            layer = span.layer_start + index
            torch.index_select(k_caches[layer], 0, span_blocks, out=staging[0, index])
            torch.index_select(v_caches[layer], 0, span_blocks, out=staging[1, index])
        # bfloat16 has no numpy dtype; reinterpreting as bytes works for every dtype.
        payload = staging.cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        yield prefill_pb2.KVChunk(
            block_start=logical_start + span.block_offset,
            num_blocks=span.num_blocks,
            layer_start=span.layer_start,
            num_layers=span.num_layers,
            dtype=layout.dtype_name,
            shape=shape,
            payload=payload,
            crc32c=crc32c.crc32c(payload),
        )


def _validate_chunk(
    chunk: prefill_pb2.KVChunk, payload: bytes, layout: KVLayout, num_logical_blocks: int
) -> None:
    """Raise the matching KVTransferError for anything wrong with a received chunk."""
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
    expected_bytes = math.prod(expected_shape) * layout.element_size()
    if len(payload) != expected_bytes:
        raise KVPayloadSizeError(f"chunk payload is {len(payload)} bytes, its shape needs {expected_bytes}")
    actual_crc = crc32c.crc32c(payload)
    if actual_crc != chunk.crc32c:
        raise KVChecksumError(
            f"chunk payload CRC32C {actual_crc:#010x} differs from the sender's {chunk.crc32c:#010x} "
            f"(layers [{chunk.layer_start}, {layer_end}), blocks [{chunk.block_start}, {block_end}))"
        )


def _tensor_view(payload: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A zero-copy tensor over the received bytes, used only as a copy source.

    torch warns that ``bytes`` is not writable; the view is never written, so the warning is
    silenced for this call only.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        return torch.frombuffer(payload, dtype=dtype).view(shape)


def write_chunk(
    chunk: prefill_pb2.KVChunk,
    layout: KVLayout,
    block_table: Sequence[int],
    num_logical_blocks: int,
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
) -> int:
    """Write a received chunk into the request's blocks; returns the payload bytes written.

    ``block_table`` is the receiver's own table for the request and ``num_logical_blocks`` the
    number of blocks it reserved for it. Every field of the chunk is validated before anything
    is written, so a rejected chunk (KVRangeError, KVLayoutMismatchError, KVPayloadSizeError,
    KVChecksumError) leaves the cache untouched. The payload is viewed in place and copied once,
    into the physical blocks (plus a host-to-device transfer when the cache is on a GPU).
    """
    num_physical_blocks = _check_caches(k_caches, v_caches, layout)
    if not 0 <= num_logical_blocks <= len(block_table):
        raise ValueError(f"{num_logical_blocks} reserved blocks, but the block table has {len(block_table)}")
    # Each read of a upb bytes field returns a fresh copy, so read it exactly once.
    payload = chunk.payload
    _validate_chunk(chunk, payload, layout, num_logical_blocks)
    device = k_caches[0].device
    physical = _physical_blocks(block_table, chunk.block_start, chunk.num_blocks, num_physical_blocks, device)
    data = _tensor_view(payload, layout.dtype, tuple(chunk.shape))
    if data.device != device:
        data = data.to(device)
    for index in range(chunk.num_layers):
        layer = chunk.layer_start + index
        k_caches[layer].index_copy_(0, physical, data[0, index])
        v_caches[layer].index_copy_(0, physical, data[1, index])
    logger.debug(
        "wrote KV layers [%d, %d) blocks [%d, %d): %d bytes",
        chunk.layer_start,
        chunk.layer_start + chunk.num_layers,
        chunk.block_start,
        chunk.block_start + chunk.num_blocks,
        len(payload),
    )
    return len(payload)
