"""The pieces of disaggregated prefill without servers: `--prefill` parsing and resolution, the flags,
the replica pool's handshake/choice/backoff (fake stubs, fake clock), and a KV transfer's checks."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from base.errors import ConfigError
from decode_service.cli import service_config_from_args
from decode_service.config import DecodeServiceConfig
from decode_service.engine_core.remote_prefill.pool import (
    BackoffPolicy,
    PrefillPool,
    PrefillReplica,
    ReplicaState,
)
from decode_service.engine_core.remote_prefill.targets import (
    PrefillTarget,
    PrefillTargetError,
    parse_prefill_targets,
    resolve_target,
)
from decode_service.engine_core.remote_prefill.transfer import KVTransfer, TransferCancelledError
from decode_service.engine_core.request import ServedRequest
from engine.params import SamplingParams, StoppingParams
from engine.sequence import Sequence
from kv_transfer import KVFrame, KVLayout, KVRangeError, PagedKV, compatibility_hash, encode_blocks
from protos.tandem.internal.v1 import prefill_pb2
from tandem.cli import build_parser

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
FINGERPRINT = "f" * 16


# --- targets and flags ------------------------------------------------------------------------------


def test_prefill_targets_parse():
    assert parse_prefill_targets("") == ()
    assert parse_prefill_targets("10.0.0.1:50052, prefill-0.local:7000") == (
        PrefillTarget("10.0.0.1", 50052, resolve=False),
        PrefillTarget("prefill-0.local", 7000, resolve=False),
    )
    (dns,) = parse_prefill_targets("dns:///tandem-prefill.inference.svc.cluster.local:50052")
    assert dns == PrefillTarget("tandem-prefill.inference.svc.cluster.local", 50052, resolve=True)
    assert str(dns) == "dns:///tandem-prefill.inference.svc.cluster.local:50052"
    (ipv6,) = parse_prefill_targets("[::1]:50052")
    assert ipv6.address == "[::1]:50052"


@pytest.mark.parametrize(
    "text",
    [
        "prefill",
        "prefill:",
        ":50052",
        "prefill:0",
        "prefill:70000",
        "dns://prefill:1",
        "[::zz]:5",
        "a:1,a:1",
        "http://prefill:1",
    ],
)
def test_prefill_targets_refuse_nonsense(text):
    with pytest.raises(PrefillTargetError):
        parse_prefill_targets(text)


def test_dns_target_resolves_to_addresses():
    static = PrefillTarget("prefill-0", 50052, resolve=False)
    assert asyncio.run(resolve_target(static)) == ["prefill-0:50052"]
    addresses = asyncio.run(resolve_target(PrefillTarget("localhost", 50052, resolve=True)))
    assert "127.0.0.1:50052" in addresses
    assert all(a in ("127.0.0.1:50052", "[::1]:50052") for a in addresses)


def test_serve_decode_takes_the_helm_chart_prefill_flags(monkeypatch):
    monkeypatch.delenv("TANDEM_AUTH_TOKEN", raising=False)
    args = build_parser().parse_args(
        [
            "serve",
            "decode",
            "--model",
            "/models/m",
            "--prefill",
            "dns:///llm-tandem-prefill.inference.svc.cluster.local:50052",
            "--local-prefill-threshold",
            "256",
            "--fallback-local",
            "--prefill-timeout",
            "12.5",
            "--prefill-tls-ca",
            "/etc/tandem/tls/prefill-client/ca.crt",
            "--prefill-tls-cert",
            "/etc/tandem/tls/prefill-client/tls.crt",
            "--prefill-tls-key",
            "/etc/tandem/tls/prefill-client/tls.key",
        ]
    )
    config = service_config_from_args(args)
    remote = config.core.remote_prefill
    assert config.disaggregated and remote.prefill_tls and remote.fallback_local
    assert remote.prefill_targets == (
        PrefillTarget("llm-tandem-prefill.inference.svc.cluster.local", 50052, resolve=True),
    )
    assert (config.local_prefill_threshold, config.prefill_timeout_s) == (256, 12.5)
    aggregated = service_config_from_args(build_parser().parse_args(["serve", "decode"]))
    assert not aggregated.disaggregated and not aggregated.fallback_local


@pytest.mark.parametrize(
    "change",
    [
        {"prefill": "nowhere"},
        {"local_prefill_threshold": -1},
        {"prefill_timeout_s": 0},
        {"prefill_max_attempts": 0},
        {"prefill_resolve_interval_s": 0},
        {"prefill_tls_cert": "c.pem"},
    ],
)
def test_config_refuses_bad_prefill_settings(change):
    DecodeServiceConfig(prefill="p:1").validate()
    with pytest.raises(ConfigError):
        DecodeServiceConfig(**{"prefill": "p:1", **change}).validate()


# --- the replica pool -------------------------------------------------------------------------------


class FakeStub:
    """GetInfo answers with `info`, or fails with UNAVAILABLE while `down`."""

    def __init__(self, info: prefill_pb2.PrefillInfo) -> None:
        self.info = info
        self.down = False
        self.calls = 0

    async def GetInfo(self, request, timeout=None):
        self.calls += 1
        if self.down:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "connection refused"
            )
        return self.info


class FakeChannel:
    closed = False

    async def close(self) -> None:
        self.closed = True


def info_for(layout: KVLayout, fingerprint: str = FINGERPRINT) -> prefill_pb2.PrefillInfo:
    return prefill_pb2.PrefillInfo(
        model_fingerprint=fingerprint,
        kv_layout=layout.to_proto(),
        compatibility_hash=compatibility_hash(fingerprint, layout),
        version="test",
    )


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakePool(PrefillPool):
    """A pool whose replicas talk to fake stubs (one per address) instead of the network."""

    def __init__(self, targets: str, stubs: dict[str, FakeStub], clock: Clock) -> None:
        super().__init__(
            parse_prefill_targets(targets), FINGERPRINT, LAYOUT, backoff=BackoffPolicy(1.0, 8.0), clock=clock
        )
        self.stubs = stubs

    def _new_replica(self, target, address) -> PrefillReplica:
        return PrefillReplica(address, FakeChannel(), self.stubs[address])


def test_handshake_admits_compatible_replicas_and_refuses_the_rest():
    stubs = {
        "a:1": FakeStub(info_for(LAYOUT)),
        "b:1": FakeStub(info_for(KVLayout(3, 2, 8, 8, torch.float32))),
        "c:1": FakeStub(info_for(LAYOUT, fingerprint="other-model")),
        "d:1": FakeStub(info_for(LAYOUT)),
    }
    stubs["d:1"].down = True
    pool = FakePool("a:1,b:1,c:1,d:1", stubs, Clock())
    asyncio.run(pool.refresh())
    states = {r.address: r.state for r in pool.replicas}
    assert states == {
        "a:1": ReplicaState.READY,
        "b:1": ReplicaState.INCOMPATIBLE,
        "c:1": ReplicaState.INCOMPATIBLE,
        "d:1": ReplicaState.BACKOFF,
    }
    assert pool.has_ready
    reasons = {r.address: r.reason for r in pool.replicas}
    assert "block_size 8 != ours 4" in reasons["b:1"]
    assert "model fingerprint 'other-model'" in reasons["c:1"]
    assert "connection refused" in reasons["d:1"]
    described = pool.describe()
    assert all(address in described for address in stubs)


def test_choice_prefers_the_fewest_calls_in_flight_then_the_least_recently_chosen():
    stubs = {f"r{i}:1": FakeStub(info_for(LAYOUT)) for i in range(3)}
    pool = FakePool(",".join(stubs), stubs, Clock())
    asyncio.run(pool.refresh())
    first = [pool.acquire() for _ in range(3)]
    assert sorted(r.address for r in first) == sorted(stubs), "a burst is spread over every replica"
    pool.release(first[1])
    assert pool.acquire() is first[1], "the replica with a free slot goes next"
    assert pool.acquire(exclude=[first[0]]) is not first[0]
    for replica in pool.replicas:
        replica.in_flight = 0
    rotation = [pool.acquire().address for _ in range(6)]
    assert rotation[:3] == rotation[3:] and len(set(rotation[:3])) == 3


def test_backoff_doubles_up_to_its_cap():
    assert [BackoffPolicy(1.0, 8.0).delay(n) for n in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_failed_replica_backs_off_then_comes_back():
    stub = FakeStub(info_for(LAYOUT))
    clock = Clock()
    pool = FakePool("a:1", stubs={"a:1": stub}, clock=clock)

    async def scenario() -> None:
        await pool.refresh()
        (replica,) = pool.replicas
        assert pool.acquire() is replica
        pool.report_failure(replica, "UNAVAILABLE: connection reset")
        pool.report_failure(replica, "UNAVAILABLE: connection reset")  # same outage, other call
        pool.release(replica)
        assert replica.state is ReplicaState.BACKOFF and replica.consecutive_failures == 1
        assert pool.acquire() is None and not pool.has_ready
        stub.down = True
        clock.now += 0.5
        await pool.refresh()
        assert stub.calls == 1, "handshaken again before its backoff ended"
        clock.now += 0.6
        await pool.refresh()  # still down: the next wait doubles
        assert stub.calls == 2 and replica.consecutive_failures == 2
        assert replica.retry_at == pytest.approx(clock.now + 2.0)
        stub.down = False
        clock.now += 2.0
        await pool.refresh()
        assert replica.state is ReplicaState.READY and pool.has_ready
        pool.report_success(replica)
        assert replica.consecutive_failures == 0

    asyncio.run(scenario())


def test_replicas_follow_the_dns_answer(monkeypatch):
    answers = {"prefill": ["10.0.0.1:7", "10.0.0.2:7"]}

    async def fake_resolve(target):
        return list(answers[target.host])

    monkeypatch.setattr("decode_service.engine_core.remote_prefill.pool.resolve_target", fake_resolve)
    stubs = {f"10.0.0.{i}:7": FakeStub(info_for(LAYOUT)) for i in (1, 2, 3)}
    clock = Clock()
    pool = FakePool("dns:///prefill:7", stubs, clock)

    async def scenario() -> None:
        await pool.refresh()
        assert sorted(r.address for r in pool.replicas) == ["10.0.0.1:7", "10.0.0.2:7"]
        gone = next(r for r in pool.replicas if r.address == "10.0.0.1:7")
        busy = pool.acquire(exclude=[r for r in pool.replicas if r is not gone])
        assert busy is gone
        answers["prefill"] = ["10.0.0.2:7", "10.0.0.3:7"]
        clock.now += pool.resolve_interval_s
        await pool.refresh()
        assert sorted(r.address for r in pool.replicas) == ["10.0.0.2:7", "10.0.0.3:7"]
        assert all(r.state is ReplicaState.READY for r in pool.replicas), "a new replica is handshaken"
        assert not gone.channel.closed, "a call still runs on the retired replica"
        pool.release(gone)
        await asyncio.sleep(0)
        assert gone.channel.closed

    asyncio.run(scenario())


# --- one transfer -----------------------------------------------------------------------------------


def caches(num_blocks: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    shape = (num_blocks, *LAYOUT.block_shape)
    k = [torch.randn(shape, generator=generator) for _ in range(LAYOUT.num_layers)]
    v = [torch.randn(shape, generator=generator) for _ in range(LAYOUT.num_layers)]
    return k, v


def transfer_for(num_tokens: int, block_table: list[int], k, v) -> KVTransfer:
    greedy, stopping = SamplingParams(temperature=0.0), StoppingParams(max_tokens=4)
    seq = Sequence("t", list(range(num_tokens)), greedy, stopping)
    seq.block_table = list(block_table)
    return KVTransfer(ServedRequest(seq), PagedKV(k, v, LAYOUT))


def sent_chunks(num_tokens: int, src_table: list[int], k, v) -> list[KVFrame]:
    num_blocks = -(-num_tokens // LAYOUT.block_size)
    # A small payload budget: one block of one layer per message, so a transfer has many messages.
    budget = LAYOUT.block_bytes()
    frames = encode_blocks(
        k, v, src_table, 0, num_blocks, LAYOUT, num_tokens=num_tokens, max_payload_bytes=budget
    )
    return list(frames)


def done(num_tokens: int, token: int = 5) -> prefill_pb2.PrefillDone:
    return prefill_pb2.PrefillDone(first_token_id=token, num_prompt_tokens=num_tokens)


def test_transfer_writes_every_block_into_the_reserved_ones():
    src_k, src_v = caches(8, seed=1)
    dst_k, dst_v = caches(10, seed=2)
    transfer = transfer_for(10, [9, 2, 5], dst_k, dst_v)
    chunks = sent_chunks(10, [3, 0, 6], src_k, src_v)
    assert len(chunks) == 3 * LAYOUT.num_layers
    written = sum(transfer.write(chunk) for chunk in chunks)
    assert written == 3 * LAYOUT.num_layers * LAYOUT.block_bytes()
    transfer.check_complete(done(10), vocab_size=100)
    for layer in range(LAYOUT.num_layers):
        for dst, src in ((dst_k, src_k), (dst_v, src_v)):
            # 10 tokens: two full blocks and 2 slots of the third; its other slots arrive as zeros.
            assert torch.equal(dst[layer][[9, 2]], src[layer][[3, 0]])
            assert torch.equal(dst[layer][5, :2], src[layer][6, :2])
            assert not dst[layer][5, 2:].any()


def test_transfer_refuses_an_incomplete_or_mismatched_done():
    src_k, src_v = caches(8, seed=3)
    dst_k, dst_v = caches(8, seed=4)
    transfer = transfer_for(10, [1, 2, 3], dst_k, dst_v)
    chunks = sent_chunks(10, [0, 1, 2], src_k, src_v)
    for chunk in chunks[:-1]:
        transfer.write(chunk)
    with pytest.raises(KVRangeError, match="never sent"):
        transfer.check_complete(done(10), vocab_size=100)
    transfer.write(chunks[-1])
    with pytest.raises(KVRangeError, match="prompt tokens"):
        transfer.check_complete(done(11), vocab_size=100)
    with pytest.raises(KVRangeError, match="vocabulary"):
        transfer.check_complete(done(10, token=100), vocab_size=100)
    transfer.check_complete(done(10), vocab_size=100)
    transfer.restart()  # a retry on another replica must send everything again
    with pytest.raises(KVRangeError, match="never sent"):
        transfer.check_complete(done(10), vocab_size=100)


def test_cancelled_transfer_never_writes_again():
    src_k, src_v = caches(8, seed=5)
    dst_k, dst_v = caches(8, seed=6)
    before = [t.clone() for t in dst_k]
    transfer = transfer_for(5, [4, 7], dst_k, dst_v)
    chunks = sent_chunks(5, [0, 1], src_k, src_v)
    transfer.cancel()
    with pytest.raises(TransferCancelledError):
        transfer.write(chunks[0])
    assert all(torch.equal(a, b) for a, b in zip(before, dst_k, strict=True))


def test_transfer_needs_the_prompt_blocks_reserved():
    k, v = caches(8, seed=7)
    with pytest.raises(ValueError, match="blocks reserved"):
        transfer_for(10, [1, 2], k, v)


def test_a_timeout_does_not_eject_the_only_ready_replica():
    """Issue 13 item 6: one DEADLINE_EXCEEDED from an overloaded replica put the only replica in a
    growing backoff, so every following request failed at once. Slow is not dead: with no other ready
    replica it stays; with another one ready, the slow one sits out."""
    stubs = {"a:1": FakeStub(info_for(LAYOUT)), "b:1": FakeStub(info_for(LAYOUT))}
    alone = FakePool("a:1", {"a:1": stubs["a:1"]}, Clock())
    pair = FakePool("a:1,b:1", stubs, Clock())

    async def scenario() -> None:
        await alone.refresh()
        await pair.refresh()
        (only,) = alone.replicas
        alone.report_slow(only, "no PrefillDone within the 1 s prefill timeout")
        assert only.state is ReplicaState.READY and alone.acquire() is only
        slow = pair.replicas[0]
        pair.report_slow(slow, "no PrefillDone within the 1 s prefill timeout")
        assert slow.state is ReplicaState.BACKOFF
        assert pair.acquire() is pair.replicas[1]

    asyncio.run(scenario())
