"""The Responses API's store: bounded by bytes (oldest evicted first), by age (TTL), and per tenant (another
tenant's id reads as absent)."""

from __future__ import annotations

import pytest

from base.errors import ConfigError
from decode_service.front_door.openai_http.response_store import ResponseStore, StoredResponse
from protos.tandem.v1 import generation_pb2 as pb


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def response(size: int) -> StoredResponse:
    """A response of exactly `size` bytes as the store counts them."""
    turn = pb.ChatMessage(role="user", content="hi")
    return StoredResponse.of({"id": "x", "output": []}, [turn], size - turn.ByteSize())


def test_the_oldest_responses_are_evicted_to_stay_within_the_byte_bound():
    store = ResponseStore(max_bytes=300, ttl_s=60)
    for name in ("a", "b", "c"):
        assert store.put("t", name, response(100))
    assert store.bytes == 300
    assert store.put("t", "d", response(150))
    assert store.get("t", "a") is None and store.get("t", "b") is None
    assert store.get("t", "c") is not None and store.get("t", "d") is not None
    assert store.bytes == 250 and len(store) == 2


def test_a_response_larger_than_the_whole_store_is_not_kept_and_evicts_nothing():
    store = ResponseStore(max_bytes=300, ttl_s=60)
    store.put("t", "a", response(100))
    assert not store.put("t", "big", response(301))
    assert store.get("t", "big") is None and store.get("t", "a") is not None
    assert store.bytes == 100


def test_responses_expire_after_the_ttl():
    clock = Clock()
    store = ResponseStore(max_bytes=10_000, ttl_s=60, clock=clock)
    store.put("t", "old", response(100))
    clock.now += 30
    store.put("t", "new", response(100))
    clock.now += 31
    assert store.get("t", "old") is None
    assert store.get("t", "new") is not None
    assert store.bytes == 100
    clock.now += 30
    assert store.get("t", "new") is None and store.bytes == 0 and len(store) == 0


def test_a_tenant_never_reads_or_deletes_another_tenants_response():
    store = ResponseStore(max_bytes=10_000, ttl_s=60)
    kept = response(100)
    store.put("alice", "resp_1", kept)
    assert store.get("bob", "resp_1") is None
    assert store.get("", "resp_1") is None
    assert not store.delete("bob", "resp_1")
    assert store.get("alice", "resp_1") is kept
    assert store.delete("alice", "resp_1")
    assert store.get("alice", "resp_1") is None and store.bytes == 0
    assert not store.delete("alice", "resp_1")


def test_storing_an_id_again_replaces_it_without_counting_it_twice():
    store = ResponseStore(max_bytes=1000, ttl_s=60)
    store.put("t", "a", response(100))
    store.put("t", "a", response(200))
    assert store.bytes == 200 and len(store) == 1


@pytest.mark.parametrize("max_bytes, ttl_s", [(0, 60), (100, 0), (100, float("nan"))])
def test_bounds_must_be_positive(max_bytes, ttl_s):
    with pytest.raises(ConfigError):
        ResponseStore(max_bytes, ttl_s)
