"""The KV wire with a quantized cache (int8, fp8 e4m3): elements and their scales cross together, in a
quarter of fp32's bytes, and a peer whose KV dtype differs is refused."""

from __future__ import annotations

import dataclasses
import random

import crc32c
import pytest
import torch

from kernels import torch_reference as ref
from kv_transfer import (
    KVLayout,
    KVLayoutMismatchError,
    KVPayloadSizeError,
    PagedKV,
    compatibility_hash,
    encode_blocks,
    parse_response,
    serialize_response,
    write_chunk,
)
from kv_transfer.framing import KVFrame, frame_kv
from kv_transfer.layout import WIRE_FORMAT_VERSION
from protos.tandem.internal.v1 import prefill_pb2

QUANTIZED = [torch.int8, torch.float8_e4m3fn]
# SmolLM2-135M's KV heads and head size, fewer layers: the byte ratio is per block and layer.
SMOLLM2 = KVLayout(num_layers=4, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)


@dataclasses.dataclass
class QuantizedCaches:
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    k_scales: list[torch.Tensor]
    v_scales: list[torch.Tensor]

    @classmethod
    def random(cls, layout: KVLayout, num_blocks: int, seed: int) -> QuantizedCaches:
        """Caches quantized from random fp32 rows by the reference, as the cache write stores them."""
        gen = torch.Generator().manual_seed(seed)
        parts: dict[str, list[torch.Tensor]] = {"k": [], "v": [], "k_scales": [], "v_scales": []}
        for _ in range(layout.num_layers):
            for name in ("k", "v"):
                rows = torch.randn(num_blocks, *layout.block_shape, generator=gen) * 3
                stored, scales = ref.quantize_kv(rows, layout.dtype)
                parts[name].append(stored)
                parts[f"{name}_scales"].append(scales)
        return cls(**parts)

    @property
    def tensors(self) -> tuple[list[torch.Tensor], ...]:
        return self.k, self.v, self.k_scales, self.v_scales

    def paged(self, layout: KVLayout) -> PagedKV:
        return PagedKV(self.k, self.v, layout, self.k_scales, self.v_scales)

    def block_bytes(self, which: int, layer: int, block: int) -> bytes:
        return self.tensors[which][layer][block].contiguous().view(torch.uint8).numpy().tobytes()


def _wire(frame: KVFrame) -> KVFrame:
    parsed = parse_response(serialize_response(frame))
    assert isinstance(parsed, KVFrame)
    return parsed


@pytest.mark.parametrize("dtype", QUANTIZED)
@pytest.mark.parametrize(("heads", "head_dim", "block_size", "num_tokens"), [(3, 64, 16, 70), (2, 5, 3, 10)])
def test_round_trip_carries_the_elements_and_their_scales(dtype, heads, head_dim, block_size, num_tokens):
    """Logical blocks 1.. of a request land in the receiver's own blocks, elements and scales alike; the
    last block's slots past the request's tokens arrive as zeros (scale 0: value 0)."""
    layout = KVLayout(num_layers=3, num_kv_heads=heads, head_dim=head_dim, block_size=block_size, dtype=dtype)
    num_logical = -(-num_tokens // block_size)
    sender = QuantizedCaches.random(layout, num_logical + 3, seed=1)
    receiver = QuantizedCaches.random(layout, num_logical + 2, seed=2)
    rng = random.Random(3)
    sender_table = rng.sample(range(num_logical + 3), num_logical)
    receiver_table = rng.sample(range(num_logical + 2), num_logical)
    budget = 2 * layout.block_bytes()  # several messages, runs of layers
    frames = encode_blocks(
        sender.k,
        sender.v,
        sender_table,
        1,
        num_logical - 1,
        layout,
        num_tokens=num_tokens,
        max_payload_bytes=budget,
        k_scales=sender.k_scales,
        v_scales=sender.v_scales,
    )
    written = 0
    for frame in frames:
        assert frame.header.dtype == {torch.int8: "int8", torch.float8_e4m3fn: "float8_e4m3fn"}[dtype]
        written += receiver.paged(layout).write(_wire(frame), receiver_table, num_logical)
    assert written == layout.num_layers * (num_logical - 1) * layout.block_bytes()
    for logical in range(1, num_logical):
        used = min(block_size, num_tokens - logical * block_size)
        for which in range(4):
            slot = len(sender.block_bytes(which, 0, 0)) // block_size
            for layer in range(layout.num_layers):
                sent = sender.block_bytes(which, layer, sender_table[logical])
                got = receiver.block_bytes(which, layer, receiver_table[logical])
                assert got == sent[: used * slot] + bytes((block_size - used) * slot)


def test_quantized_bytes_on_the_wire_are_under_0_3x_of_float32():
    """A 1000-token prompt of SmolLM2's KV shape, as whole messages (headers and framing included)."""
    num_tokens, num_blocks = 1000, 63
    table = list(range(num_blocks))
    fp32 = SMOLLM2
    k = [torch.zeros(num_blocks, *fp32.block_shape) for _ in range(fp32.num_layers)]
    fp32_bytes = sum(
        len(f.data) for f in encode_blocks(k, k, table, 0, num_blocks, fp32, num_tokens=num_tokens)
    )
    for dtype in QUANTIZED:
        layout = dataclasses.replace(SMOLLM2, dtype=dtype)
        caches = QuantizedCaches.random(layout, num_blocks, seed=4)
        frames = caches.paged(layout).frames(table, 0, num_blocks, num_tokens=num_tokens)
        ratio = sum(len(f.data) for f in frames) / fp32_bytes
        # (64 one-byte elements + one 4-byte scale) / (64 four-byte elements) per token and head.
        assert ratio == pytest.approx(68 / 256, abs=0.002) and ratio <= 0.3


def test_block_bytes_count_the_scales():
    int8 = dataclasses.replace(SMOLLM2, dtype=torch.int8)
    assert int8.data_bytes() == 16 * 3 * 64 and int8.scale_bytes() == 16 * 3 * 4
    assert int8.block_bytes() == 2 * (16 * 3 * 64 + 16 * 3 * 4)
    assert SMOLLM2.scale_bytes() == 0 and SMOLLM2.block_bytes() == 2 * 16 * 3 * 64 * 4


def test_a_payload_without_its_scales_is_refused():
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.int8)
    caches = QuantizedCaches.random(layout, 2, seed=5)
    (frame,) = caches.paged(layout).frames([0, 1], 0, 2, num_tokens=8)
    elements_only = frame.payload[: 2 * layout.num_layers * 2 * layout.data_bytes()]
    header = prefill_pb2.KVChunk()
    header.CopyFrom(frame.header)
    header.crc32c = crc32c.crc32c(elements_only)
    truncated = frame_kv(header, [elements_only])
    receiver = QuantizedCaches.random(layout, 2, seed=6)
    before = [receiver.block_bytes(w, 0, 0) for w in range(4)]
    with pytest.raises(KVPayloadSizeError, match="payload is"):
        receiver.paged(layout).write(_wire(truncated), [0, 1], 2)
    assert [receiver.block_bytes(w, 0, 0) for w in range(4)] == before


@pytest.mark.parametrize(
    ("sender", "receiver"), [(torch.int8, torch.float32), (torch.float8_e4m3fn, torch.int8)]
)
def test_a_chunk_of_another_kv_dtype_is_refused(sender, receiver):
    sender_layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=4, block_size=4, dtype=sender)
    caches = QuantizedCaches.random(sender_layout, 1, seed=7)
    (frame,) = caches.paged(sender_layout).frames([0], 0, 1, num_tokens=4)
    receiver_layout = dataclasses.replace(sender_layout, dtype=receiver)
    shape = (1, *receiver_layout.block_shape)
    k, v = [torch.zeros(shape, dtype=receiver)], [torch.zeros(shape, dtype=receiver)]
    scales = [torch.zeros(shape[:3])] if receiver_layout.quantized else None
    with pytest.raises(KVLayoutMismatchError, match="dtype"):
        write_chunk(_wire(frame), receiver_layout, [0], 1, k, v, scales, scales)


def test_a_quantized_layout_needs_scales_and_only_it():
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.int8)
    caches = QuantizedCaches.random(layout, 2, seed=8)
    with pytest.raises(KVLayoutMismatchError, match="needs both K and V scales"):
        PagedKV(caches.k, caches.v, layout)
    fp32 = dataclasses.replace(layout, dtype=torch.float32)
    k = [torch.zeros(2, *fp32.block_shape)]
    with pytest.raises(KVLayoutMismatchError, match="needs no K and V scales"):
        PagedKV(k, k, fp32, caches.k_scales, caches.v_scales)
    with pytest.raises(KVLayoutMismatchError, match="expected"):
        PagedKV(caches.k, caches.v, layout, [s[:, :2].contiguous() for s in caches.k_scales], caches.v_scales)


def test_kv_dtypes_change_the_compatibility_hash_and_the_wire_version():
    hashes = {
        compatibility_hash("m", dataclasses.replace(SMOLLM2, dtype=dtype))
        for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn)
    }
    assert len(hashes) == 4
    assert WIRE_FORMAT_VERSION >= 3, "quantized KV payloads need wire version 3 or later"
    for dtype in QUANTIZED:
        layout = dataclasses.replace(SMOLLM2, dtype=dtype)
        assert (
            KVLayout.from_proto(prefill_pb2.KVLayout.FromString(layout.to_proto().SerializeToString()))
            == layout
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", QUANTIZED)
def test_round_trip_between_gpu_caches(dtype):
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype)
    sender = QuantizedCaches.random(layout, 4, seed=9)
    receiver = QuantizedCaches.random(layout, 4, seed=10)
    on_gpu = [[t.cuda() for t in tensors] for tensors in (*sender.tensors, *receiver.tensors)]
    src, dst = PagedKV(*on_gpu[:2], layout, *on_gpu[2:4]), PagedKV(*on_gpu[4:6], layout, *on_gpu[6:])
    for frame in src.frames([3, 1], 0, 2, num_tokens=8):
        dst.write(_wire(frame), [0, 2], 2)
    for which in range(4):
        for layer in range(2):
            for s, d in ((3, 0), (1, 2)):
                got, sent = on_gpu[4 + which][layer][d], on_gpu[which][layer][s]
                assert torch.equal(got.cpu().view(torch.uint8), sent.cpu().view(torch.uint8))
