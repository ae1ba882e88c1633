"""KV-cache transfer between the prefill and decode tiers: layout handshake and wire format.

The prefill service streams the frames ``encode_blocks`` yields (``serialize_response`` is the
Prefill method's serializer, registered by ``grpc_method``) and the decode service parses each
message with ``parse_response`` and passes KV frames to ``write_chunk``.
"""

from kv_transfer.errors import (
    IncompatibleKVError,
    KVChecksumError,
    KVFramingError,
    KVLayoutMismatchError,
    KVNonFiniteError,
    KVPayloadSizeError,
    KVRangeError,
    KVTransferError,
    PrefixMismatchError,
)
from kv_transfer.framing import KVFrame, parse_response, serialize_response
from kv_transfer.layout import KVLayout, compatibility_hash
from kv_transfer.wire import MAX_MESSAGE_BYTES, PagedKV, encode_blocks, write_chunk

__all__ = [
    "MAX_MESSAGE_BYTES",
    "IncompatibleKVError",
    "PagedKV",
    "KVChecksumError",
    "KVFrame",
    "KVFramingError",
    "KVLayout",
    "KVLayoutMismatchError",
    "KVNonFiniteError",
    "KVPayloadSizeError",
    "KVRangeError",
    "KVTransferError",
    "PrefixMismatchError",
    "compatibility_hash",
    "encode_blocks",
    "parse_response",
    "serialize_response",
    "write_chunk",
]
