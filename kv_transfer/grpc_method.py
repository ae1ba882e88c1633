"""The Prefill service's gRPC plumbing with the KV codec: server registration, client stub, channel options.

The generated stubs serialize every message through protobuf, which copies a KV payload several
times; these register the same methods with the framing codec instead (``serialize_response`` on the
server, ``parse_response`` on the client). The bytes on the wire are the same protobuf messages, so a
generated stub on either side still interoperates.
"""

from __future__ import annotations

from typing import Any

import grpc

from kv_transfer.errors import KVFramingError
from kv_transfer.framing import KVFrame, parse_response, serialize_response
from kv_transfer.wire import MAX_MESSAGE_BYTES
from protos.tandem.internal.v1 import prefill_pb2

PREFILL_SERVICE = "tandem.internal.v1.Prefill"

MESSAGE_HEADROOM_BYTES = 64 * 1024
"""Room above the payload budget for a KV message's header, and for requests (a long prompt's ids)."""

MAX_GRPC_MESSAGE_BYTES = MAX_MESSAGE_BYTES + MESSAGE_HEADROOM_BYTES

# The receiving end of a KV stream (the decode tier's channel to a prefill replica). No compression: KV
# is incompressible floats, and gRPC compresses nothing unless asked. HTTP/2 frames are capped at 16 KiB
# unless the receiver allows more, so a 1 MiB message would cross as 64+ frames, each a header, a
# flow-control check and a write; allowing 1 MiB frames cuts the receiver's CPU per byte (bench.kv_wire;
# bench/README.md, "KV transfer"). gRPC's BDP probing (on by default) sizes the flow-control windows.
CLIENT_CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
    ("grpc.http2.max_frame_size", 1 << 20),
]


def add_prefill_servicer(servicer: Any, server: grpc.aio.Server) -> None:
    """Register ``servicer``'s GetInfo and Prefill; Prefill may yield KVFrames as well as responses."""
    handlers = {
        "GetInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetInfo,
            request_deserializer=prefill_pb2.GetInfoRequest.FromString,
            response_serializer=prefill_pb2.PrefillInfo.SerializeToString,
        ),
        "Prefill": grpc.unary_stream_rpc_method_handler(
            servicer.Prefill,
            request_deserializer=prefill_pb2.PrefillRequest.FromString,
            response_serializer=serialize_response,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(PREFILL_SERVICE, handlers),))
    server.add_registered_method_handlers(PREFILL_SERVICE, handlers)


def _parse_or_error(data: bytes) -> KVFrame | prefill_pb2.PrefillResponse | KVFramingError:
    """The Prefill deserializer. gRPC turns an exception raised here into a logged stack trace and a
    None message, so a malformed message is returned as its error for the caller to raise."""
    try:
        return parse_response(data)
    except KVFramingError as exc:
        return exc


class PrefillStub:
    """Client of the Prefill service whose Prefill stream yields KVFrame, PrefillResponse (the done
    message) or KVFramingError (a malformed message; raise it)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.GetInfo = channel.unary_unary(
            f"/{PREFILL_SERVICE}/GetInfo",
            request_serializer=prefill_pb2.GetInfoRequest.SerializeToString,
            response_deserializer=prefill_pb2.PrefillInfo.FromString,
            _registered_method=True,
        )
        self.Prefill = channel.unary_stream(
            f"/{PREFILL_SERVICE}/Prefill",
            request_serializer=prefill_pb2.PrefillRequest.SerializeToString,
            response_deserializer=_parse_or_error,
            _registered_method=True,
        )
