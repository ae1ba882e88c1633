"""KV messages framed by hand in protobuf's wire format, so a payload is copied once on each side.

Through protobuf's Python API a megabyte payload is copied four times on the sender (``tobytes``, the
message arena, the wrapping ``PrefillResponse``, ``SerializeToString``) and twice more on the
receiver (parsing into the arena, then every read of ``payload``). A ``KVFrame`` is the serialized
``PrefillResponse{kv: KVChunk}`` built with one ``join`` over the payload's pieces, and parsing one
keeps the payload as a view into the received bytes. The bytes are ordinary protobuf: any protobuf
client parses what ``frame_kv`` builds, and ``parse_response`` accepts what any protobuf sender
serializes (falling back to protobuf itself for anything but a lone ``kv`` field).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from kv_transfer.errors import KVFramingError
from protos.tandem.internal.v1 import prefill_pb2

_LEN = 2  # protobuf wire type of length-delimited fields
_KV_TAG = (1 << 3) | _LEN  # PrefillResponse.kv
_PAYLOAD_FIELD = 7  # KVChunk.payload
_PAYLOAD_TAG = (_PAYLOAD_FIELD << 3) | _LEN
_MAX_VARINT_BYTES = 10
_FIXED_WIDTHS = {1: 8, 5: 4}  # wire types I64 and I32


@dataclass(frozen=True)
class KVFrame:
    """One KV message as it crosses the wire: the header fields, the payload, and the message's bytes.

    ``header`` is the KVChunk without its payload; ``payload`` is a read-only view into ``data``, the
    serialized ``PrefillResponse``, so nothing is copied to read it.
    """

    header: prefill_pb2.KVChunk
    payload: memoryview
    data: bytes


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it; the bytes are untrusted, so bound everything."""
    value = 0
    for index in range(_MAX_VARINT_BYTES):
        if pos + index >= end:
            raise KVFramingError(f"KV message truncated inside a varint at byte {pos}")
        byte = data[pos + index]
        value |= (byte & 0x7F) << (7 * index)
        if byte < 0x80:
            return value, pos + index + 1
    raise KVFramingError(f"KV message has a varint longer than {_MAX_VARINT_BYTES} bytes at byte {pos}")


def frame_kv(header: prefill_pb2.KVChunk, pieces: Sequence[memoryview | bytes]) -> KVFrame:
    """Serialize ``PrefillResponse{kv: header + payload}`` where the payload is ``pieces`` concatenated.

    ``header`` must not carry a payload itself. The pieces are copied exactly once, by the join.
    """
    head = header.SerializeToString()
    payload_len = sum(memoryview(piece).nbytes for piece in pieces)
    payload_prefix = bytes((_PAYLOAD_TAG,)) + _varint(payload_len)
    inner_len = len(head) + len(payload_prefix) + payload_len
    prefix = bytes((_KV_TAG,)) + _varint(inner_len) + head + payload_prefix
    data = b"".join((prefix, *pieces))
    return KVFrame(header, memoryview(data)[len(prefix) :], data)


def frame_chunk(chunk: prefill_pb2.KVChunk) -> KVFrame:
    """A frame for a KVChunk that protobuf parsed (a standard client, the fallback); copies the payload."""
    header = prefill_pb2.KVChunk()
    header.CopyFrom(chunk)
    header.ClearField("payload")
    return frame_kv(header, [chunk.payload])


def serialize_response(response: KVFrame | prefill_pb2.PrefillResponse) -> bytes:
    """gRPC response serializer of the Prefill method: frames are already bytes, the rest is protobuf."""
    if isinstance(response, KVFrame):
        return response.data
    return response.SerializeToString()


def parse_response(data: bytes) -> KVFrame | prefill_pb2.PrefillResponse:
    """gRPC response deserializer of the Prefill method: a KVFrame for a KV message, else the protobuf.

    Raises KVFramingError for bytes that are not a valid message.
    """
    if data[:1] == bytes((_KV_TAG,)):
        length, start = _read_varint(data, 1, len(data))
        if start + length == len(data):
            return _parse_kv(data, start)
    try:
        response = prefill_pb2.PrefillResponse.FromString(data)
    except DecodeError as exc:
        raise KVFramingError(f"undecodable Prefill response ({len(data)} bytes): {exc}") from None
    if response.WhichOneof("kind") == "kv":
        return frame_chunk(response.kv)
    return response


def _parse_kv(data: bytes, pos: int) -> KVFrame:
    """Split a serialized KVChunk spanning data[pos:] into its header fields and a view of its payload."""
    end = len(data)
    header_parts: list[bytes] = []
    payload_span = (end, end)
    while pos < end:
        field_start = pos
        tag, pos = _read_varint(data, pos, end)
        field, wire_type = tag >> 3, tag & 7
        if wire_type == 0:
            _, pos = _read_varint(data, pos, end)
        elif wire_type == _LEN:
            length, pos = _read_varint(data, pos, end)
            value_start, pos = pos, pos + length
        elif wire_type in _FIXED_WIDTHS:
            pos += _FIXED_WIDTHS[wire_type]
        else:
            raise KVFramingError(f"KV message has field {field} of unsupported wire type {wire_type}")
        if pos > end:
            raise KVFramingError(f"KV message field {field} runs past the message's {end} bytes")
        if field == _PAYLOAD_FIELD and wire_type == _LEN:
            payload_span = (value_start, pos)  # protobuf keeps the last occurrence
        else:
            header_parts.append(data[field_start:pos])
    try:
        header = prefill_pb2.KVChunk.FromString(b"".join(header_parts))
    except DecodeError as exc:
        raise KVFramingError(f"undecodable KVChunk header: {exc}") from None
    return KVFrame(header, memoryview(data)[payload_span[0] : payload_span[1]], data)
