"""The KV wire with sliding-window attention groups: each group's blocks travel on their own, a sliding
group sends only the blocks the decode tier's first query can still read, and replicas that group their
layers differently refuse each other in the handshake."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from test_disagg_units import FINGERPRINT, Clock, FakeChannel, FakeStub, done, info_for

from decode_service.engine_core.remote_prefill.pool import (
    BackoffPolicy,
    PrefillPool,
    PrefillReplica,
    ReplicaState,
)
from decode_service.engine_core.remote_prefill.targets import parse_prefill_targets
from decode_service.engine_core.remote_prefill.transfer import KVTransfer
from decode_service.engine_core.request import ServedRequest
from engine.kv_layout import NULL_BLOCK
from engine.kv_layout import KVLayout as AttentionLayout
from engine.params import SamplingParams, StoppingParams
from engine.sequence import Sequence
from kv_transfer import (
    KVFrame,
    KVLayout,
    KVLayoutMismatchError,
    KVRangeError,
    PagedKV,
    compatibility_hash,
    parse_response,
    serialize_response,
)
from kv_transfer.framing import frame_kv
from kv_transfer.layout import WIRE_FORMAT_VERSION
from kv_transfer.wire import plan_transfer, transfer_payload_bytes
from protos.tandem.internal.v1 import prefill_pb2

WINDOW = 8
# Gemma 3's pattern in small: two local layers to one global, twice. Groups: full [2, 5], window 8
# [0, 1] and [3, 4]; two cache slots.
ATTENTION = AttentionLayout.from_layer_windows((WINDOW, WINDOW, None, WINDOW, WINDOW, None))
LAYOUT = KVLayout(
    num_layers=6, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32, attention=ATTENTION
)
FULL = dataclasses.replace(LAYOUT, attention=None)
NUM_TOKENS = 19  # 5 blocks; the first query after the prompt (position 19) reads keys 12..19: blocks 3, 4
NUM_BLOCKS = 5
FIRST_VISIBLE = 3


def slot_caches(layout: KVLayout, num_blocks: int, seed: int) -> dict[str, list[torch.Tensor]]:
    """Per-layer K/V (and a quantized layout's scales) the way the engine holds them: one tensor per slot,
    layer l's entry being its slot's tensor, shared with the layers of the other groups."""
    attention = layout.attention or AttentionLayout.from_layer_windows((None,) * layout.num_layers)
    generator = torch.Generator().manual_seed(seed)
    shapes = {"k": layout.block_shape, "v": layout.block_shape}
    if layout.quantized:
        shapes |= {"k_scales": layout.scale_shape, "v_scales": layout.scale_shape}
    caches = {}
    for name, shape in shapes.items():
        values = [torch.randn((num_blocks, *shape), generator=generator) for _ in range(attention.num_slots)]
        if name in ("k", "v"):
            values = [value.to(layout.dtype) for value in values]
        else:
            values = [value.abs() + 0.1 for value in values]
        caches[name] = [values[attention.slot_of_layer[layer]] for layer in range(layout.num_layers)]
    return caches


def paged(layout: KVLayout, caches: dict[str, list[torch.Tensor]]) -> PagedKV:
    return PagedKV(caches["k"], caches["v"], layout, caches.get("k_scales"), caches.get("v_scales"))


def tables_for(layout: KVLayout, physical: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Per group, the given physical blocks with the ones that slid out replaced by NULL_BLOCK."""
    return [
        [NULL_BLOCK if i < layout.first_sent_block(g, num_tokens) else b for i, b in enumerate(blocks)]
        for g, blocks in enumerate(physical)
    ]


SENDER_BLOCKS = [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]
RECEIVER_BLOCKS = [[14, 3, 8, 0, 11], [1, 13, 6, 9, 2], [12, 4, 10, 7, 5]]


def wire(frame: KVFrame) -> KVFrame:
    parsed = parse_response(serialize_response(frame))
    assert isinstance(parsed, KVFrame)
    return parsed


def receiving(
    layout: KVLayout, caches: dict[str, list[torch.Tensor]], num_tokens: int, held_blocks: int = 0
) -> KVTransfer:
    seq = Sequence(
        "t", list(range(num_tokens)), SamplingParams(temperature=0.0), StoppingParams(max_tokens=4)
    )
    seq.block_tables = tables_for(layout, RECEIVER_BLOCKS, num_tokens)
    seq.num_computed_tokens = held_blocks * layout.block_size
    held_hash = b"h" * 32 if held_blocks else b""
    return KVTransfer(ServedRequest(seq), paged(layout, caches), held_prefix_hash=held_hash)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("budget_blocks", [1, 3, 64])
def test_each_group_lands_in_its_own_blocks(dtype, budget_blocks):
    layout = dataclasses.replace(LAYOUT, dtype=dtype)
    src, dst = slot_caches(layout, 15, seed=1), slot_caches(layout, 15, seed=2)
    before = {name: [t.clone() for t in tensors] for name, tensors in dst.items()}
    sent = paged(layout, src).frames(
        tables_for(layout, SENDER_BLOCKS, NUM_TOKENS),
        0,
        NUM_BLOCKS,
        num_tokens=NUM_TOKENS,
        max_payload_bytes=budget_blocks * layout.block_bytes(),
    )
    transfer = receiving(layout, dst, NUM_TOKENS)
    for frame in sent:
        transfer.write(wire(frame))
    transfer.check_complete(done(NUM_TOKENS), vocab_size=100)
    used = NUM_TOKENS - (NUM_BLOCKS - 1) * layout.block_size
    for g, group in enumerate(layout.groups):
        first = layout.first_sent_block(g, NUM_TOKENS)
        for layer in group.layers:
            for name in dst:
                for logical in range(NUM_BLOCKS):
                    got = dst[name][layer][RECEIVER_BLOCKS[g][logical]]
                    if logical < first:
                        expected = before[name][layer][RECEIVER_BLOCKS[g][logical]]
                        assert torch.equal(got, expected), "a slid-out block is neither sent nor written"
                        continue
                    sent_block = src[name][layer][SENDER_BLOCKS[g][logical]]
                    if logical == NUM_BLOCKS - 1:
                        assert torch.equal(got[:used], sent_block[:used])
                        assert not got[used:].any(), "slots past the prompt go out as zeros"
                    else:
                        assert torch.equal(got, sent_block)


def test_a_sliding_group_sends_only_the_blocks_its_window_still_reads():
    planned = plan_transfer(LAYOUT, NUM_TOKENS, 0, NUM_BLOCKS, max_payload_bytes=LAYOUT.block_bytes())
    sent = {(span.group, first + span.block_offset, span.layer_start) for first, span in planned}
    assert sent == {(0, b, layer) for b in range(NUM_BLOCKS) for layer in range(2)} | {
        (g, b, layer) for g in (1, 2) for b in (3, 4) for layer in range(2)
    }
    # Streamed as chunks finish (blocks [0, 2), then [2, 5)), the same blocks go out, none twice.
    frames = [
        frame.header
        for start, count in ((0, 2), (2, 3))
        for frame in paged(LAYOUT, slot_caches(LAYOUT, 15, seed=3)).frames(
            tables_for(LAYOUT, SENDER_BLOCKS, NUM_TOKENS), start, count, num_tokens=NUM_TOKENS
        )
    ]
    pairs = [(h.group, h.block_start + b) for h in frames for b in range(h.num_blocks)]
    assert sorted(pairs) == sorted({(0, b) for b in range(5)} | {(g, b) for g in (1, 2) for b in (3, 4)})
    assert transfer_payload_bytes(LAYOUT, NUM_TOKENS) == (2 * 5 + 4 * 2) * LAYOUT.block_bytes()
    assert transfer_payload_bytes(FULL, NUM_TOKENS) == 6 * 5 * LAYOUT.block_bytes()
    # A prompt shorter than the window sends everything; a held prefix is skipped in every group.
    assert transfer_payload_bytes(LAYOUT, 7) == transfer_payload_bytes(FULL, 7)
    assert transfer_payload_bytes(LAYOUT, NUM_TOKENS, first_block=4) == 6 * LAYOUT.block_bytes()


def test_gemma3_270m_layout_puts_under_035x_of_full_attention_on_the_wire():
    """Gemma 3 270M: 18 layers, every sixth global, the rest window 512; 1 KV head of 256, fp32."""
    windows = tuple(None if (layer + 1) % 6 == 0 else 512 for layer in range(18))
    gemma = KVLayout(
        num_layers=18,
        num_kv_heads=1,
        head_dim=256,
        block_size=16,
        dtype=torch.float32,
        attention=AttentionLayout.from_layer_windows(windows),
    )
    full = dataclasses.replace(gemma, attention=None)
    ratio = transfer_payload_bytes(gemma, 4000) / transfer_payload_bytes(full, 4000)
    # 3 layers x 250 blocks + 15 layers x 32 blocks (tokens 3,488.. of 4,000) over 18 x 250 blocks.
    assert ratio == pytest.approx((3 * 250 + 15 * 32) / (18 * 250))
    assert ratio <= 0.35


def test_a_block_that_slid_out_is_refused_and_leaves_the_cache_alone():
    src, dst = slot_caches(LAYOUT, 15, seed=4), slot_caches(LAYOUT, 15, seed=5)
    # A sender that ignores the window (a full-attention peer's plan) sends group 1's blocks 0..2 too.
    frames = [
        frame
        for frame in PagedKV(src["k"], src["v"], FULL).frames(
            SENDER_BLOCKS[0], 0, NUM_BLOCKS, num_tokens=NUM_TOKENS, max_payload_bytes=LAYOUT.block_bytes()
        )
        if frame.header.layer_start == 0
    ]
    early = frames[0]
    header = prefill_pb2.KVChunk()
    header.CopyFrom(early.header)
    header.group, header.num_layers = 1, 1
    forged = wire(frame_kv(header, [early.payload]))
    transfer = receiving(LAYOUT, dst, NUM_TOKENS)
    snapshot = [t.clone() for t in dst["k"]]
    with pytest.raises(KVRangeError, match="slid out"):
        transfer.write(forged)
    with pytest.raises(KVRangeError, match="slid out"):
        paged(LAYOUT, dst).write(forged, tables_for(LAYOUT, RECEIVER_BLOCKS, NUM_TOKENS), NUM_BLOCKS)
    header.group = 3
    with pytest.raises(KVRangeError, match="group 3"):
        transfer.write(wire(frame_kv(header, [early.payload])))
    assert all(torch.equal(a, b) for a, b in zip(snapshot, dst["k"], strict=True))
    with pytest.raises(KVRangeError, match="never sent"):
        transfer.check_complete(done(NUM_TOKENS), vocab_size=100)


def test_a_held_prefix_and_the_window_both_cut_what_is_sent():
    src, dst = slot_caches(LAYOUT, 15, seed=6), slot_caches(LAYOUT, 15, seed=7)
    for held, sliding_first in ((1, FIRST_VISIBLE), (4, 4)):
        transfer = receiving(LAYOUT, dst, NUM_TOKENS, held_blocks=held)
        assert transfer.first_blocks == (held, sliding_first, sliding_first)
        frames = list(
            paged(LAYOUT, src).frames(
                tables_for(LAYOUT, SENDER_BLOCKS, NUM_TOKENS),
                held,
                NUM_BLOCKS - held,
                num_tokens=NUM_TOKENS,
                max_payload_bytes=LAYOUT.block_bytes(),
            )
        )
        assert {(f.header.group, f.header.block_start) for f in frames} == {
            (g, b) for g in range(3) for b in range(transfer.first_blocks[g], NUM_BLOCKS)
        }
        for frame in frames:
            transfer.write(wire(frame))
        transfer.check_complete(done(NUM_TOKENS), vocab_size=100)


def test_a_receiver_missing_a_visible_block_is_a_local_bug():
    seq = Sequence("t", list(range(NUM_TOKENS)), SamplingParams(), StoppingParams(max_tokens=4))
    seq.block_tables = tables_for(LAYOUT, RECEIVER_BLOCKS, NUM_TOKENS)
    seq.block_tables[1][FIRST_VISIBLE] = NULL_BLOCK
    with pytest.raises(ValueError, match="group 1"):
        KVTransfer(ServedRequest(seq), paged(LAYOUT, slot_caches(LAYOUT, 15, seed=8)))


def test_one_group_messages_are_todays_bytes():
    """A model whose layers all attend alike sends no group field: its messages are the KVChunks of wire
    version 3, byte for byte in length."""
    src = slot_caches(FULL, 6, seed=9)
    for frame in PagedKV(src["k"], src["v"], FULL).frames([2, 0, 5], 0, 3, num_tokens=10):
        h = frame.header
        plain = prefill_pb2.PrefillResponse(
            kv=prefill_pb2.KVChunk(
                block_start=h.block_start,
                num_blocks=h.num_blocks,
                layer_start=h.layer_start,
                num_layers=h.num_layers,
                dtype=h.dtype,
                shape=h.shape,
                payload=bytes(frame.payload),
                crc32c=h.crc32c,
            )
        )
        # Same fields and the same length (the frame puts the payload last, protobuf in field order).
        assert prefill_pb2.PrefillResponse.FromString(frame.data) == plain
        assert len(frame.data) == len(plain.SerializeToString())


def test_the_attention_layout_is_in_the_handshake():
    assert WIRE_FORMAT_VERSION == 4
    assert compatibility_hash("m", LAYOUT) != compatibility_hash("m", FULL)
    other_window = dataclasses.replace(
        LAYOUT, attention=AttentionLayout.from_layer_windows((16, 16, None, 16, 16, None))
    )
    assert compatibility_hash("m", LAYOUT) != compatibility_hash("m", other_window)
    message = prefill_pb2.KVLayout.FromString(LAYOUT.to_proto().SerializeToString())
    assert KVLayout.from_proto(message) == LAYOUT
    assert KVLayout.from_proto(FULL.to_proto()) == FULL and not FULL.to_proto().groups
    assert KVLayout(6, 2, 4, 4, torch.float32, AttentionLayout.from_layer_windows((None,) * 6)) == FULL
    (difference,) = LAYOUT.differences(FULL)
    assert "attention layout full:[2, 5] window 8:[0, 1] window 8:[3, 4] != ours full:[0, 1, 2, 3, 4, 5]" in (
        difference
    )


@pytest.mark.parametrize(
    "groups",
    [
        [prefill_pb2.KVGroup(layers=[0, 1, 2])],
        [prefill_pb2.KVGroup(layers=[0, 1, 2, 3, 4, 5]), prefill_pb2.KVGroup(window=4, layers=[5])],
        [prefill_pb2.KVGroup(layers=[0, 1, 2, 3, 4, 9])],
        [prefill_pb2.KVGroup(layers=[0, 1, 2, 3, 4, 5]), prefill_pb2.KVGroup(window=4)],
    ],
)
def test_a_peer_layout_whose_groups_do_not_cover_the_layers_is_refused(groups):
    message = FULL.to_proto()
    message.groups.extend(groups)
    with pytest.raises(KVLayoutMismatchError, match="exactly once"):
        KVLayout.from_proto(message)


class GroupedPool(PrefillPool):
    def __init__(self, layout: KVLayout, stubs: dict[str, FakeStub]) -> None:
        targets = parse_prefill_targets(",".join(stubs))
        super().__init__(targets, FINGERPRINT, layout, backoff=BackoffPolicy(1.0, 8.0), clock=Clock())
        self.stubs = stubs

    def _new_replica(self, target, address) -> PrefillReplica:
        return PrefillReplica(address, FakeChannel(), self.stubs[address])


def test_a_replica_that_groups_layers_differently_is_refused_with_a_clear_reason():
    stubs = {"a:1": FakeStub(info_for(LAYOUT)), "b:1": FakeStub(info_for(FULL))}
    pool = GroupedPool(LAYOUT, stubs)
    asyncio.run(pool.refresh())
    states = {replica.address: replica for replica in pool.replicas}
    assert states["a:1"].state is ReplicaState.READY
    assert states["b:1"].state is ReplicaState.INCOMPATIBLE
    assert "attention layout full:[0, 1, 2, 3, 4, 5] != ours full:[2, 5]" in states["b:1"].reason
