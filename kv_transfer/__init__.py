"""KV-cache transfer between the prefill and decode tiers: layout handshake and wire format.

No gRPC here: the prefill service streams what ``encode_blocks`` yields and the decode service
passes each received chunk to ``write_chunk``.
"""

from kv_transfer.errors import (
    IncompatibleKVError,
    KVChecksumError,
    KVLayoutMismatchError,
    KVPayloadSizeError,
    KVRangeError,
    KVTransferError,
)
from kv_transfer.layout import KVLayout, compatibility_hash
from kv_transfer.wire import MAX_MESSAGE_BYTES, encode_blocks, write_chunk

__all__ = [
    "MAX_MESSAGE_BYTES",
    "IncompatibleKVError",
    "KVChecksumError",
    "KVLayout",
    "KVLayoutMismatchError",
    "KVPayloadSizeError",
    "KVRangeError",
    "KVTransferError",
    "compatibility_hash",
    "encode_blocks",
    "write_chunk",
]
