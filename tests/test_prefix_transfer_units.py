"""Prefix caching across the tiers without servers: the cache-aware choice of prefill replica (rendezvous
hashing with a load bound) and a KV transfer into a sequence whose leading blocks decode already holds."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import torch
from test_disagg_units import LAYOUT, Clock, FakePool, FakeStub, caches, done, info_for, sent_chunks

from decode_service.engine_core.remote_prefill.pool import AFFINITY_LOAD_FACTOR, AFFINITY_LOAD_SLACK
from decode_service.engine_core.remote_prefill.transfer import KVTransfer
from decode_service.engine_core.request import ServedRequest
from engine.params import SamplingParams, StoppingParams
from engine.sequence import Sequence
from kv_transfer import KVRangeError, PagedKV


def three_replicas() -> FakePool:
    stubs = {f"10.0.0.{i}:50052": FakeStub(info_for(LAYOUT)) for i in range(3)}
    pool = FakePool(",".join(stubs), stubs, Clock())
    asyncio.run(pool.refresh())
    return pool


def key(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def test_a_prefix_goes_to_its_home_replica_whatever_the_order_of_calls():
    pool = three_replicas()
    homes = {}
    for name in [f"prefix-{i}" for i in range(12)] * 2:
        replica = pool.acquire(affinity=key(name))
        assert homes.setdefault(name, replica.address) == replica.address
        pool.release(replica)
    assert len(set(homes.values())) == 3, "different prefixes spread over the replicas"


def test_removing_a_replica_moves_only_the_prefixes_it_was_home_to():
    pool = three_replicas()
    names = [f"prefix-{i}" for i in range(24)]

    def homes() -> dict[str, str]:
        chosen = {}
        for name in names:
            replica = pool.acquire(affinity=key(name))
            chosen[name] = replica.address
            pool.release(replica)
        return chosen

    before = homes()
    gone = pool.replicas[0]
    pool.report_failure(gone, "test: the replica went away")
    after = homes()
    assert all(after[n] == before[n] for n in names if before[n] != gone.address)
    assert all(after[n] != gone.address for n in names)


def test_load_wins_over_affinity_beyond_the_bound():
    pool = three_replicas()
    home = pool.acquire(affinity=key("hot"))
    pool.release(home)
    others = [r for r in pool.replicas if r is not home]
    home.in_flight = AFFINITY_LOAD_SLACK
    assert pool.acquire(affinity=key("hot")) is home, "within the bound the cache wins"
    home.in_flight = AFFINITY_LOAD_FACTOR * 1 + AFFINITY_LOAD_SLACK + 1
    for other in others:
        other.in_flight = 1
    assert pool.acquire(affinity=key("hot")) in others, "beyond the bound the least loaded wins"
    assert pool.acquire(affinity=b"") in others


def held_transfer(num_tokens: int, table: list[int], held_blocks: int, k, v) -> KVTransfer:
    seq = Sequence(
        "t", list(range(num_tokens)), SamplingParams(temperature=0.0), StoppingParams(max_tokens=4)
    )
    seq.block_table = list(table)
    seq.num_computed_tokens = held_blocks * LAYOUT.block_size
    return KVTransfer(ServedRequest(seq), PagedKV(k, v, LAYOUT), held_prefix_hash=b"h" * 32)


def test_a_transfer_takes_only_the_blocks_after_those_decode_holds():
    src_k, src_v = caches(8, seed=11)
    dst_k, dst_v = caches(8, seed=12)
    held_before = [t[[6, 1]].clone() for t in dst_k]
    transfer = held_transfer(10, [6, 1, 4], 2, dst_k, dst_v)  # blocks 0 and 1 are cached here
    chunks = sent_chunks(10, [0, 2, 5], src_k, src_v)
    with pytest.raises(KVRangeError, match="held here"):
        transfer.write(chunks[0])
    for chunk in chunks:
        if chunk.header.block_start >= 2:
            transfer.write(chunk)
    transfer.check_complete(done(10), vocab_size=100)
    for layer in range(LAYOUT.num_layers):
        assert torch.equal(dst_k[layer][4, :2], src_k[layer][5, :2])
        assert torch.equal(dst_k[layer][[6, 1]], held_before[layer]), "shared cached blocks untouched"
    transfer.restart()
    with pytest.raises(KVRangeError, match="never sent"):
        transfer.check_complete(done(10), vocab_size=100)
    assert transfer.num_held_blocks == 2 and transfer.cache_salt == ""
