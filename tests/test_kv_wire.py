"""KV wire format: sender-to-receiver round trips, splitting, and rejection of every corruption."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import crc32c
import grpc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_transfer import (
    MAX_MESSAGE_BYTES,
    KVChecksumError,
    KVFrame,
    KVFramingError,
    KVLayout,
    KVLayoutMismatchError,
    KVPayloadSizeError,
    KVRangeError,
    KVTransferError,
    compatibility_hash,
    encode_blocks,
    parse_response,
    serialize_response,
    write_chunk,
)
from kv_transfer.grpc_method import (
    CLIENT_CHANNEL_OPTIONS,
    MAX_GRPC_MESSAGE_BYTES,
    PrefillStub,
    add_prefill_servicer,
)
from kv_transfer.wire import plan_chunks
from protos.tandem.internal.v1 import prefill_pb2

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _random_caches(
    layout: KVLayout, num_physical_blocks: int, seed: int, device: str = "cpu"
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    shape = (num_physical_blocks, *layout.block_shape)

    def one() -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(layout.dtype).to(device)

    return [one() for _ in range(layout.num_layers)], [one() for _ in range(layout.num_layers)]


def _snapshot(caches: list[torch.Tensor]) -> list[bytes]:
    """Exact bytes of each cache tensor, for byte-identical comparisons (NaN-safe, dtype-agnostic)."""
    return [cache.cpu().reshape(-1).view(torch.uint8).numpy().tobytes() for cache in caches]


def _block_bytes(cache: torch.Tensor, block: int) -> bytes:
    return cache[block].cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


@st.composite
def transfers(draw):
    """A layout, a sender and a receiver with differently permuted block tables, a block range, a budget."""
    layout = KVLayout(
        num_layers=draw(st.integers(1, 4)),
        num_kv_heads=draw(st.integers(1, 3)),
        head_dim=draw(st.integers(1, 8)),
        block_size=draw(st.integers(1, 4)),
        dtype=draw(st.sampled_from(DTYPES)),
    )
    num_logical = draw(st.integers(1, 6))
    sender_blocks = draw(st.integers(num_logical, num_logical + 4))
    receiver_blocks = draw(st.integers(num_logical, num_logical + 4))
    sender_table = draw(st.permutations(range(sender_blocks)))[:num_logical]
    receiver_table = draw(st.permutations(range(receiver_blocks)))[:num_logical]
    logical_start = draw(st.integers(0, num_logical - 1))
    num_blocks = draw(st.integers(1, num_logical - logical_start))
    # The request's tokens end anywhere in the range's last block or in a later block.
    num_tokens = draw(
        st.integers((logical_start + num_blocks - 1) * layout.block_size + 1, num_logical * layout.block_size)
    )
    block_bytes = layout.block_bytes()
    budget = draw(st.integers(block_bytes, block_bytes * layout.num_layers * num_blocks + block_bytes))
    return (
        layout,
        sender_blocks,
        receiver_blocks,
        sender_table,
        receiver_table,
        logical_start,
        num_blocks,
        num_tokens,
        budget,
    )


def _wire(frame: KVFrame) -> KVFrame:
    """The frame as the receiver gets it: its bytes, parsed again."""
    parsed = parse_response(serialize_response(frame))
    assert isinstance(parsed, KVFrame)
    return parsed


@settings(max_examples=150, deadline=None)
@given(transfer=transfers(), seed=st.integers(0, 2**31 - 1))
def test_round_trip_moves_exactly_the_requested_blocks(transfer, seed: int) -> None:
    layout, sender_blocks, receiver_blocks, sender_table, receiver_table, start, count, tokens, budget = (
        transfer
    )
    k_src, v_src = _random_caches(layout, sender_blocks, seed)
    k_dst, v_dst = _random_caches(layout, receiver_blocks, seed + 1)
    k_before, v_before = _snapshot(k_dst), _snapshot(v_dst)

    covered: list[tuple[int, int]] = []
    frames = encode_blocks(
        k_src, v_src, sender_table, start, count, layout, num_tokens=tokens, max_payload_bytes=budget
    )
    for frame in frames:
        header = frame.header
        assert frame.payload.nbytes <= budget
        covered += [
            (layer, block)
            for layer in range(header.layer_start, header.layer_start + header.num_layers)
            for block in range(header.block_start, header.block_start + header.num_blocks)
        ]
        # Decode reserves blocks for the whole request, not only the range being sent.
        written = write_chunk(_wire(frame), layout, receiver_table, len(receiver_table), k_dst, v_dst)
        assert written == frame.payload.nbytes

    expected = [(layer, block) for layer in range(layout.num_layers) for block in range(start, start + count)]
    assert sorted(covered) == expected
    moved = {receiver_table[logical]: logical for logical in range(start, start + count)}
    block_len = layout.block_bytes() // 2
    slot_len = block_len // layout.block_size
    for layer in range(layout.num_layers):
        for dst_block in range(receiver_blocks):
            for dst, src, before in ((k_dst, k_src, k_before), (v_dst, v_src, v_before)):
                received = _block_bytes(dst[layer], dst_block)
                if dst_block in moved:
                    logical = moved[dst_block]
                    used = min(layout.block_size, tokens - logical * layout.block_size) * slot_len
                    sent = _block_bytes(src[layer], sender_table[logical])
                    assert received == sent[:used] + bytes(block_len - used)
                else:
                    assert received == before[layer][dst_block * block_len : (dst_block + 1) * block_len]


def test_split_uses_whole_layer_runs_when_all_layers_of_a_block_do_not_fit() -> None:
    layout = KVLayout(num_layers=5, num_kv_heads=1, head_dim=2, block_size=2, dtype=torch.float32)
    spans = plan_chunks(2, layout, max_payload_bytes=layout.block_bytes() * 2)
    assert [(s.block_offset, s.num_blocks, s.layer_start, s.num_layers) for s in spans] == [
        (0, 1, 0, 2),
        (0, 1, 2, 2),
        (0, 1, 4, 1),
        (1, 1, 0, 2),
        (1, 1, 2, 2),
        (1, 1, 4, 1),
    ]


def test_split_packs_all_layers_of_several_blocks_when_they_fit() -> None:
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float16)
    spans = plan_chunks(7, layout, max_payload_bytes=layout.block_bytes() * 3 * 3)
    assert [(s.block_offset, s.num_blocks, s.layer_start, s.num_layers) for s in spans] == [
        (0, 3, 0, 3),
        (3, 2, 0, 3),
        (5, 2, 0, 3),
    ]
    assert plan_chunks(0, layout) == []


def test_default_budget_sends_a_realistic_transfer_in_few_messages() -> None:
    # SmolLM2-135M's KV shape: 30 layers, 3 KV heads of 64, 16-token blocks.
    layout = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.bfloat16)
    spans = plan_chunks(64, layout)
    assert all(s.num_layers == 30 for s in spans)
    assert sum(s.num_blocks for s in spans) == 64
    assert max(s.num_blocks for s in spans) * 30 * layout.block_bytes() <= MAX_MESSAGE_BYTES
    blocks_per_message = MAX_MESSAGE_BYTES // (30 * layout.block_bytes())
    assert len(spans) == -(-64 // blocks_per_message)


@pytest.mark.parametrize(
    "layout",
    [
        KVLayout(num_layers=1, num_kv_heads=8, head_dim=256, block_size=512, dtype=torch.float32),
        KVLayout(num_layers=2, num_kv_heads=32, head_dim=128, block_size=512, dtype=torch.bfloat16),
    ],
)
def test_a_block_larger_than_a_message_is_refused_before_streaming(layout: KVLayout) -> None:
    assert layout.block_bytes() > MAX_MESSAGE_BYTES
    k = [torch.zeros((1, *layout.block_shape), dtype=layout.dtype) for _ in range(layout.num_layers)]
    with pytest.raises(KVPayloadSizeError, match="message budget"):
        encode_blocks(k, k, [0], 0, 1, layout, num_tokens=1)  # raises on the call, not on first iteration


def test_a_custom_budget_below_one_block_is_refused() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2, dtype=torch.float32)
    k, v = _random_caches(layout, 2, seed=0)
    with pytest.raises(KVPayloadSizeError):
        encode_blocks(k, v, [0, 1], 0, 2, layout, num_tokens=4, max_payload_bytes=layout.block_bytes() - 1)


def test_sender_rejects_a_range_outside_its_block_table() -> None:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, block_size=2, dtype=torch.float32)
    k, v = _random_caches(layout, 4, seed=0)
    with pytest.raises(ValueError, match="block table"):
        encode_blocks(k, v, [0, 1], 1, 2, layout, num_tokens=4)
    with pytest.raises(ValueError, match="outside the cache"):
        encode_blocks(k, v, [0, 9], 0, 2, layout, num_tokens=4)
    with pytest.raises(ValueError, match="past the request's 2 tokens"):
        encode_blocks(k, v, [0, 1], 0, 2, layout, num_tokens=2)


# --- receiver rejects every corruption and writes nothing ---------------------------------------

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32)
RESERVED = 4  # blocks the receiver reserved for the request
RECEIVER_TABLE = [5, 2, 7, 0, 3]  # one entry more than reserved: a block of some other request


@dataclass
class Receiver:
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    chunk: prefill_pb2.KVChunk

    def assert_untouched_after(self, chunk: prefill_pb2.KVChunk, error: type[KVTransferError], match: str):
        """Both as protobuf parsed it and as the receiver's own parser frames it, the chunk is refused."""
        before = (_snapshot(self.k), _snapshot(self.v))
        framed = parse_response(prefill_pb2.PrefillResponse(kv=chunk).SerializeToString())
        for received in (chunk, framed):
            with pytest.raises(error, match=match):
                write_chunk(received, LAYOUT, RECEIVER_TABLE, RESERVED, self.k, self.v)
        assert (_snapshot(self.k), _snapshot(self.v)) == before


def _as_proto(frame: KVFrame) -> prefill_pb2.KVChunk:
    """The frame as any protobuf client parses it."""
    return prefill_pb2.PrefillResponse.FromString(frame.data).kv


@pytest.fixture
def receiver() -> Receiver:
    """A receiver cache and a valid chunk for logical blocks [1, 3) of the request, all layers."""
    k_src, v_src = _random_caches(LAYOUT, 6, seed=1)
    (frame,) = encode_blocks(k_src, v_src, [4, 1, 0, 5], 1, 2, LAYOUT, num_tokens=16)
    k_dst, v_dst = _random_caches(LAYOUT, 8, seed=2)
    return Receiver(k_dst, v_dst, _as_proto(frame))


def _corrupted(chunk: prefill_pb2.KVChunk, **fields) -> prefill_pb2.KVChunk:
    copy = prefill_pb2.KVChunk()
    copy.CopyFrom(chunk)
    for name, value in fields.items():
        if name == "shape":
            del copy.shape[:]
            copy.shape.extend(value)
        else:
            setattr(copy, name, value)
    return copy


def _with_payload(chunk: prefill_pb2.KVChunk, payload: bytes) -> prefill_pb2.KVChunk:
    """Replace the payload and fix its checksum, so only the size is wrong."""
    return _corrupted(chunk, payload=payload, crc32c=crc32c.crc32c(payload))


def test_valid_chunk_is_accepted(receiver: Receiver) -> None:
    assert write_chunk(receiver.chunk, LAYOUT, RECEIVER_TABLE, RESERVED, receiver.k, receiver.v) > 0


@settings(max_examples=50, deadline=None)
@given(position=st.integers(0, 2 * 3 * 2 * 4 * 2 * 4 * 4 - 1), bit=st.integers(0, 7))
def test_any_flipped_payload_bit_fails_the_checksum(position: int, bit: int) -> None:
    k_src, v_src = _random_caches(LAYOUT, 6, seed=1)
    (frame,) = encode_blocks(k_src, v_src, [4, 1, 0, 5], 1, 2, LAYOUT, num_tokens=16)
    chunk = _as_proto(frame)
    assert len(chunk.payload) == 2 * 3 * 2 * 4 * 2 * 4 * 4
    payload = bytearray(chunk.payload)
    payload[position] ^= 1 << bit
    k_dst, v_dst = _random_caches(LAYOUT, 8, seed=2)
    Receiver(k_dst, v_dst, chunk).assert_untouched_after(
        _corrupted(chunk, payload=bytes(payload)), KVChecksumError, "CRC32C"
    )


CORRUPTIONS: list[tuple[str, Callable[[prefill_pb2.KVChunk], prefill_pb2.KVChunk], type, str]] = [
    ("wrong checksum", lambda c: _corrupted(c, crc32c=c.crc32c ^ 1), KVChecksumError, "CRC32C"),
    # Same element count, different meaning: only the shape check can catch this.
    (
        "swapped heads and head_dim",
        lambda c: _corrupted(c, shape=[2, 3, 2, 4, 4, 2]),
        KVLayoutMismatchError,
        "shape",
    ),
    (
        "shape of fewer layers",
        lambda c: _corrupted(c, shape=[2, 2, 2, 4, 2, 4]),
        KVLayoutMismatchError,
        "shape",
    ),
    (
        "shape missing a dimension",
        lambda c: _corrupted(c, shape=[2, 3, 2, 4, 8]),
        KVLayoutMismatchError,
        "shape",
    ),
    ("negative shape", lambda c: _corrupted(c, shape=[2, 3, 2, 4, 2, -4]), KVLayoutMismatchError, "shape"),
    ("other float dtype", lambda c: _corrupted(c, dtype="bfloat16"), KVLayoutMismatchError, "dtype"),
    ("unknown dtype", lambda c: _corrupted(c, dtype="int8"), KVLayoutMismatchError, "dtype"),
    (
        "layer start past the end",
        lambda c: _corrupted(c, layer_start=3, num_layers=1),
        KVRangeError,
        "layers",
    ),
    ("layer range overhangs", lambda c: _corrupted(c, layer_start=1), KVRangeError, "layers"),
    ("no layers", lambda c: _corrupted(c, num_layers=0), KVRangeError, "layers"),
    ("huge layer start", lambda c: _corrupted(c, layer_start=2**32 - 1), KVRangeError, "layers"),
    ("block in another request's slot", lambda c: _corrupted(c, block_start=3), KVRangeError, "blocks"),
    ("block far out of range", lambda c: _corrupted(c, block_start=2**32 - 2), KVRangeError, "blocks"),
    ("no blocks", lambda c: _corrupted(c, num_blocks=0), KVRangeError, "blocks"),
    ("truncated payload", lambda c: _with_payload(c, c.payload[:-4]), KVPayloadSizeError, "bytes"),
    ("payload cut mid-element", lambda c: _with_payload(c, c.payload[:-1]), KVPayloadSizeError, "bytes"),
    ("empty payload", lambda c: _with_payload(c, b""), KVPayloadSizeError, "bytes"),
    (
        "payload with extra bytes",
        lambda c: _with_payload(c, c.payload + b"\0" * 4),
        KVPayloadSizeError,
        "bytes",
    ),
]


@pytest.mark.parametrize(
    ("corrupt", "error", "match"),
    [case[1:] for case in CORRUPTIONS],
    ids=[case[0] for case in CORRUPTIONS],
)
def test_corrupted_chunk_is_rejected_and_writes_nothing(
    receiver: Receiver, corrupt, error: type[KVTransferError], match: str
) -> None:
    receiver.assert_untouched_after(corrupt(receiver.chunk), error, match)


@pytest.mark.parametrize(
    "sender_layout",
    [
        dataclasses.replace(LAYOUT, block_size=2),
        dataclasses.replace(LAYOUT, num_kv_heads=1, head_dim=8),
        dataclasses.replace(LAYOUT, dtype=torch.bfloat16),
    ],
    ids=["block_size", "heads", "dtype"],
)
def test_chunk_from_a_peer_with_another_layout_is_rejected(
    receiver: Receiver, sender_layout: KVLayout
) -> None:
    k_src, v_src = _random_caches(sender_layout, 4, seed=3)
    (frame,) = encode_blocks(k_src, v_src, [0, 1], 0, 2, sender_layout, num_tokens=8)
    receiver.assert_untouched_after(_as_proto(frame), KVLayoutMismatchError, "layout")


def test_all_wire_errors_are_tandem_errors() -> None:
    from base.errors import TandemError

    for error in (KVChecksumError, KVLayoutMismatchError, KVRangeError, KVPayloadSizeError):
        assert issubclass(error, KVTransferError) and issubclass(error, TandemError)


# --- layout and compatibility hash ---------------------------------------------------------------


def test_layout_proto_round_trip() -> None:
    for dtype in DTYPES:
        layout = dataclasses.replace(LAYOUT, dtype=dtype)
        message = prefill_pb2.KVLayout.FromString(layout.to_proto().SerializeToString())
        assert KVLayout.from_proto(message) == layout
    assert LAYOUT.to_proto().dtype == "float32"
    assert dataclasses.replace(LAYOUT, dtype=torch.bfloat16).to_proto().dtype == "bfloat16"


def test_block_bytes_counts_k_and_v() -> None:
    assert LAYOUT.block_bytes() == 2 * 4 * 2 * 4 * 4
    assert dataclasses.replace(LAYOUT, dtype=torch.float16).block_bytes() == 2 * 4 * 2 * 4 * 2


@pytest.mark.parametrize(
    "message",
    [
        prefill_pb2.KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=1, dtype="int16"),
        prefill_pb2.KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=1, dtype=""),
        prefill_pb2.KVLayout(num_layers=0, num_kv_heads=1, head_dim=1, block_size=1, dtype="float32"),
        prefill_pb2.KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=0, dtype="float16"),
    ],
)
def test_invalid_peer_layout_is_rejected(message: prefill_pb2.KVLayout) -> None:
    with pytest.raises(KVLayoutMismatchError):
        KVLayout.from_proto(message)


def test_unsupported_local_dtype_is_rejected() -> None:
    with pytest.raises(KVLayoutMismatchError, match="float64"):
        dataclasses.replace(LAYOUT, dtype=torch.float64)


def test_compatibility_hash_changes_with_every_input() -> None:
    base = compatibility_hash("smollm2-135m@abc", LAYOUT)
    assert base == compatibility_hash("smollm2-135m@abc", dataclasses.replace(LAYOUT))
    assert len(base) == 64 and int(base, 16) >= 0
    variants = [
        compatibility_hash("smollm2-135m@abd", LAYOUT),
        compatibility_hash("", LAYOUT),
        compatibility_hash("smollm2-135m@abc", dataclasses.replace(LAYOUT, num_layers=4)),
        compatibility_hash("smollm2-135m@abc", dataclasses.replace(LAYOUT, num_kv_heads=3)),
        compatibility_hash("smollm2-135m@abc", dataclasses.replace(LAYOUT, head_dim=8)),
        compatibility_hash("smollm2-135m@abc", dataclasses.replace(LAYOUT, block_size=8)),
        compatibility_hash("smollm2-135m@abc", dataclasses.replace(LAYOUT, dtype=torch.bfloat16)),
        compatibility_hash("smollm2-135m@abc", dataclasses.replace(LAYOUT, dtype=torch.float16)),
        compatibility_hash("smollm2-135m@abc", dataclasses.replace(LAYOUT, dtype=torch.int8)),
        compatibility_hash("smollm2-135m@abc", dataclasses.replace(LAYOUT, dtype=torch.float8_e4m3fn)),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_compatibility_hash_does_not_run_fields_together() -> None:
    # Swapping values between two fields must not give the same hash.
    swapped = dataclasses.replace(LAYOUT, num_kv_heads=LAYOUT.head_dim, head_dim=LAYOUT.num_kv_heads)
    assert compatibility_hash("m", swapped) != compatibility_hash("m", LAYOUT)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_round_trip_between_gpu_caches() -> None:
    layout = dataclasses.replace(LAYOUT, dtype=torch.bfloat16)
    k_src, v_src = _random_caches(layout, 6, seed=4, device="cuda")
    k_dst, v_dst = _random_caches(layout, 6, seed=5, device="cuda")
    frames = encode_blocks(
        k_src, v_src, [3, 0, 5], 0, 3, layout, num_tokens=12, max_payload_bytes=layout.block_bytes()
    )
    for frame in frames:
        write_chunk(_wire(frame), layout, [1, 4, 2], 3, k_dst, v_dst)
    for layer in range(layout.num_layers):
        assert torch.equal(k_dst[layer][[1, 4, 2]], k_src[layer][[3, 0, 5]])
        assert torch.equal(v_dst[layer][[1, 4, 2]], v_src[layer][[3, 0, 5]])


# --- framing: the bytes on the wire ---------------------------------------------------------------


def test_frames_and_protobuf_read_each_other() -> None:
    k, v = _random_caches(LAYOUT, 4, seed=6)
    (frame,) = encode_blocks(k, v, [2, 0], 0, 2, LAYOUT, num_tokens=8)
    chunk = _as_proto(frame)
    assert chunk.payload == bytes(frame.payload) and chunk.crc32c == crc32c.crc32c(chunk.payload)
    assert (chunk.block_start, chunk.num_blocks, list(chunk.shape)) == (0, 2, [2, 3, 2, 4, 2, 4])
    reparsed = parse_response(prefill_pb2.PrefillResponse(kv=chunk).SerializeToString())
    assert isinstance(reparsed, KVFrame)
    assert bytes(reparsed.payload) == chunk.payload
    header = prefill_pb2.KVChunk()
    header.CopyFrom(chunk)
    header.ClearField("payload")
    assert reparsed.header == header


def test_a_done_message_parses_as_protobuf() -> None:
    done = prefill_pb2.PrefillResponse(done=prefill_pb2.PrefillDone(first_token_id=7, num_prompt_tokens=3))
    parsed = parse_response(serialize_response(done))
    assert parsed == done


def test_fields_protobuf_repeats_or_reorders_are_read_like_protobuf() -> None:
    k, v = _random_caches(LAYOUT, 2, seed=7)
    (frame,) = encode_blocks(k, v, [1], 0, 1, LAYOUT, num_tokens=4)
    chunk = _as_proto(frame)
    # A second, stale payload field first: protobuf keeps the last one, and so must the parser.
    stale = prefill_pb2.KVChunk(payload=b"stale").SerializeToString()
    inner = stale + chunk.SerializeToString()
    data = b"\x0a" + _varint(len(inner)) + inner
    parsed = parse_response(data)
    assert isinstance(parsed, KVFrame) and bytes(parsed.payload) == chunk.payload
    assert prefill_pb2.PrefillResponse.FromString(data).kv.payload == chunk.payload


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    return bytes(out + bytes((value,)))


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"\x0a\x80", "truncated inside a varint"),
        (b"\x0a" + b"\xff" * 10 + b"\x01", "longer than 10 bytes"),
        (b"\x0a\x03\x08\x01\x3a", "truncated inside a varint"),
        (b"\x0a\x04\x08\x01\x3a\x05", "runs past"),
        (b"\x0a\x02\x0b\x0c", "wire type 3"),
        (b"\x0a\x02\x10\x80", "truncated inside a varint"),
        (b"\x12\x05\x08", "undecodable Prefill response"),
        (b"\x0a\x03\x32\x01\xff", "undecodable KVChunk header"),
    ],
    ids=[
        "outer length cut",
        "overlong varint",
        "payload length missing",
        "payload past the end",
        "group wire type",
        "header varint cut",
        "done past the end",
        "shape field garbage",
    ],
)
def test_malformed_messages_are_refused_with_a_framing_error(data: bytes, match: str) -> None:
    with pytest.raises(KVFramingError, match=match):
        parse_response(data)


# --- what leaves the prefill process --------------------------------------------------------------


def test_unused_slots_of_the_last_block_go_out_as_zeros() -> None:
    layout = dataclasses.replace(LAYOUT, block_size=4)
    k, v = _random_caches(layout, 3, seed=8)  # block 2 still holds its previous owner's K/V
    frames = list(encode_blocks(k, v, [0, 2], 0, 2, layout, num_tokens=5))
    payload = torch.cat([torch.frombuffer(bytearray(f.payload), dtype=layout.dtype) for f in frames])
    sent = payload.view(2, layout.num_layers, 2, *layout.block_shape)
    assert torch.equal(sent[0, :, 1, :1], torch.stack(k)[:, 2, :1])
    assert torch.equal(sent[1, :, 1, :1], torch.stack(v)[:, 2, :1])
    assert not sent[:, :, 1, 1:].any()
    assert torch.stack(k)[:, 2, 1:].any()  # the stale K/V is there, it just was not sent


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from conftest import save_tiny_model

    directory = tmp_path_factory.mktemp("tiny-kv-wire-model")
    save_tiny_model(directory, 22)
    return directory


def test_prefill_never_sends_the_previous_owner_kv_of_a_reused_block(tiny_model_dir) -> None:
    """Issue 13 item 2: a 29-token prompt, then a 17-token one in the same two blocks (16 tokens each).

    The second prompt's last block holds one of its tokens and 12 of the first prompt's; a caller who
    asks for the second prompt must receive zeros there, not the first prompt's K/V.
    """
    from test_prefill_server import BLOCK_SIZE, start_server

    server = start_server(tiny_model_dir, num_blocks=2)
    try:
        for tokens in (list(range(3, 32)), list(range(40, 57))):
            request = prefill_pb2.PrefillRequest(
                request_id=f"p{len(tokens)}",
                prompt_token_ids=tokens,
                compatibility_hash=server.compatibility_hash,
            )
            chunks = [r.kv for r in server.stub.Prefill(request, timeout=60) if r.WhichOneof("kind") == "kv"]
        used = 17 - BLOCK_SIZE
        cache = server.engine.kv_cache
        stale = [cache.k[0][block, used:] for block in range(2)]
        assert any(slots.any() for slots in stale), (
            "the reused block should still hold the first prompt's K/V"
        )
        last_block = [chunk for chunk in chunks if chunk.block_start + chunk.num_blocks == 2]
        assert last_block
        for chunk in last_block:
            data = torch.frombuffer(bytearray(chunk.payload), dtype=torch.float32).view(tuple(chunk.shape))
            assert data[:, :, -1, :used].any()
            assert not data[:, :, -1, used:].any()
    finally:
        server.close()


_FAULTS_PER_MESSAGE = """
import resource, sys
from kv_transfer.heap import keep_message_buffers_in_heap

if sys.argv[1] == "kept" and not keep_message_buffers_in_heap():
    sys.exit(3)


def page_faults_of_one_message() -> int:
    # Receive 4 MiB as gRPC Python does: a bytearray grown piece by piece, then copied into bytes.
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    received = bytearray()
    for _ in range(64):
        received += b"\\x01" * (64 << 10)
    message = bytes(received)
    del received, message
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


page_faults_of_one_message()
print(min(page_faults_of_one_message() for _ in range(4)))
"""


def _page_faults_per_message(mode: str) -> int:
    result = subprocess.run(
        [sys.executable, "-c", _FAULTS_PER_MESSAGE, mode], capture_output=True, text=True, timeout=120
    )
    if result.returncode == 3:
        pytest.skip("no glibc mallopt here")
    assert result.returncode == 0, result.stderr
    return int(result.stdout)


def test_freed_message_buffers_are_reused_without_faulting_their_pages_in_again() -> None:
    pages = (4 << 20) // 4096
    assert _page_faults_per_message("kept") < pages // 16
    # With glibc's defaults every message faults its pages in again: the test can tell the difference.
    assert _page_faults_per_message("default") > pages // 2


class _OneFrame:
    """A Prefill servicer that streams one prepared frame."""

    def __init__(self, frame: KVFrame) -> None:
        self.frame = frame

    async def GetInfo(self, request, context):  # noqa: N802 (gRPC's name)
        return prefill_pb2.PrefillInfo()

    async def Prefill(self, request, context):  # noqa: N802 (gRPC's name)
        yield self.frame


def test_a_message_of_the_full_payload_budget_crosses_grpc_with_the_product_limits() -> None:
    # 128 KiB blocks: 32 of them fill the budget exactly.
    layout = KVLayout(num_layers=1, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.float32)
    num_blocks = MAX_MESSAGE_BYTES // layout.block_bytes()
    assert num_blocks * layout.block_bytes() == MAX_MESSAGE_BYTES
    k_src, v_src = _random_caches(layout, num_blocks, seed=7)
    table = list(reversed(range(num_blocks)))
    (frame,) = encode_blocks(k_src, v_src, table, 0, num_blocks, layout, num_tokens=num_blocks * 16)
    assert frame.payload.nbytes == MAX_MESSAGE_BYTES

    async def round_trip() -> list:
        limits = [
            ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
        ]
        server = grpc.aio.server(options=limits)
        add_prefill_servicer(_OneFrame(frame), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        address = f"127.0.0.1:{port}"
        try:
            async with grpc.aio.insecure_channel(address, options=CLIENT_CHANNEL_OPTIONS) as channel:
                stream = PrefillStub(channel).Prefill(prefill_pb2.PrefillRequest())
                return [message async for message in stream]
        finally:
            await server.stop(0)

    (received,) = asyncio.run(round_trip())
    assert isinstance(received, KVFrame)
    k_dst, v_dst = _random_caches(layout, num_blocks, seed=8)
    assert write_chunk(received, layout, table, num_blocks, k_dst, v_dst) == MAX_MESSAGE_BYTES
    assert _snapshot(k_dst) == _snapshot(k_src) and _snapshot(v_dst) == _snapshot(v_src)
