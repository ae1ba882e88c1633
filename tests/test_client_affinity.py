"""Prefix-affine replica choice (`tandem.client.affinity`): the picker's decisions on fake replicas, then
a client against two real decode servers: a conversation's turns meet their cached history, several
conversations spread, and a replica that goes away loses no conversation."""

from __future__ import annotations

import asyncio
import itertools
import math
import threading

import grpc
import pytest
from conftest import tiny_hf_model, wait_until
from tiny_tokenizer import TINY_VOCAB_SIZE, build_tiny_tokenizer

from protos.tandem.v1 import generation_pb2 as pb
from tandem.client import AsyncTandemClient, TandemClient
from tandem.client.affinity import (
    BLOCK_BYTES,
    LOAD_BOUND,
    ReplicaPicker,
    prefix_chain,
    resolve_addresses,
    retries_elsewhere,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Addresses:
    """A resolver whose answer the test changes (replicas joining and leaving)."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)
        self.closed: list[str] = []

    def resolve(self, target: str) -> list[str]:
        return list(self.addresses)

    def connect(self, address: str) -> tuple[str, object]:
        return address, lambda: self.closed.append(address)


def picker_for(*addresses: str) -> tuple[ReplicaPicker[str], Addresses, FakeClock]:
    book, clock = Addresses(*addresses), FakeClock()
    return ReplicaPicker("dns:///decode:50051", book.connect, book.resolve, clock), book, clock


def text(prompt: str, salt: str = "") -> list[bytes]:
    return prefix_chain(pb.GenerateRequest(prompt=prompt, cache_salt=salt))


SYSTEM = "You are a careful assistant who answers in short sentences. " * 4


def conversation(index: int, turns: int) -> str:
    return SYSTEM + "".join(
        f"[user {index}.{t}: tell me about topic {index * 7 + t}, please.] " for t in range(turns)
    )


def chat(index: int, turns: int) -> str:
    """A conversation sharing no system prompt with the others."""
    return "".join(
        f"<{index}> turn {t} of conversation {index}, no shared preamble at all. " * 2 for t in range(turns)
    )


def test_prefix_chain_is_a_chain_over_full_blocks_keyed_by_salt_and_prompt_form():
    chain = text("x" * (3 * BLOCK_BYTES + 5))
    assert len(chain) == 3
    assert text("x" * (2 * BLOCK_BYTES)) == chain[:2]
    assert text("x" * (3 * BLOCK_BYTES), salt="tenant-a")[0] != chain[0]
    tokens = prefix_chain(pb.GenerateRequest(token_ids=list(range(40))))
    assert len(tokens) == 2 and tokens == prefix_chain(pb.GenerateRequest(token_ids=list(range(32))))
    messages = [pb.ChatMessage(role="system", content=SYSTEM), pb.ChatMessage(role="user", content="hi")]
    first = prefix_chain(pb.GenerateRequest(messages=messages))
    longer = prefix_chain(
        pb.GenerateRequest(messages=[*messages, pb.ChatMessage(role="user", content="x" * 99)])
    )
    assert first and longer[: len(first) - 1] == first[:-1]


def test_a_conversation_returns_to_the_replica_that_holds_its_history():
    picker, _, _ = picker_for("a:1", "b:1")
    homes = []
    for turn in range(1, 5):
        replica = picker.acquire(text(conversation(0, turn)))
        homes.append(replica.address)
        picker.release(replica)
    assert len(set(homes)) == 1


def test_conversations_spread_and_each_keeps_its_replica_despite_a_shared_system_prompt():
    picker, _, _ = picker_for("a:1", "b:1")
    first = {}
    for index in range(4):  # four conversations start together: the least-loaded replica takes each
        first[index] = picker.acquire(text(conversation(index, 1)))
    assert {r.address for r in first.values()} == {"a:1", "b:1"}
    for replica in first.values():
        picker.release(replica)
    for turn in range(2, 5):
        for index in range(4):
            replica = picker.acquire(text(conversation(index, turn)))
            assert replica is first[index], (index, turn)
            picker.release(replica)


def test_a_busy_home_gives_way_past_the_load_bound():
    picker, _, _ = picker_for("a:1", "b:1")
    home = picker.acquire(text(conversation(0, 1)))
    held = [home]
    # The home keeps its prefix while it would hold at most LOAD_BOUND x the mean calls (rounded up).
    while True:
        replica = picker.acquire(text(conversation(0, 2)))
        held.append(replica)
        if replica is not home:
            break
    total = len(held) - 1  # in flight when the last call was placed
    assert home.in_flight + 1 > math.ceil(LOAD_BOUND * (total + 1) / 2)  # it no longer fitted the bound
    assert home.in_flight == total and replica.in_flight == 1  # and had taken every call before
    for replica in held:
        picker.release(replica)


def test_a_burst_sharing_a_system_prompt_is_split_evenly():
    picker, _, _ = picker_for("a:1", "b:1")
    burst = [picker.acquire(text(conversation(index, 1))) for index in range(8)]
    assert sorted(r.in_flight for r in picker.replicas) == [4, 4]
    for replica in burst:
        picker.release(replica)


def test_an_unavailable_replica_sits_out_forgets_its_cache_and_returns_after_backoff():
    picker, _, clock = picker_for("a:1", "b:1")
    home = picker.acquire(text(conversation(0, 1)))
    picker.release(home, failed=True)
    retry = picker.acquire(text(conversation(0, 1)), exclude=[home])
    assert retry is not home
    picker.release(retry)
    assert picker.acquire(text(conversation(0, 2))) is retry  # the history now lives on the other one
    picker.release(retry)
    assert home.matched(text(conversation(0, 2))) == 0
    unrelated = text("an unrelated prompt that shares no block with the conversation " * 3)
    assert picker.acquire(unrelated) is retry  # still backing off: not a candidate
    picker.release(retry)
    clock.now += 1.0  # past the first backoff: idle and least recently chosen, it takes the next one
    assert picker.acquire(text("another prompt of its own, sharing nothing either " * 3)) is home


def test_every_replica_excluded_means_none_and_a_down_replica_is_still_tried_when_alone():
    picker, _, _ = picker_for("a:1")
    only = picker.acquire(text("x" * 100))
    picker.release(only, failed=True)
    assert picker.acquire(text("x" * 100), exclude=[only]) is None
    assert picker.acquire(text("x" * 100)) is only  # down, but nothing else exists: try it


def test_replicas_join_and_leave_on_resolution_and_leavers_close_once_idle():
    picker, book, clock = picker_for("a:1", "b:1")
    homes = {}
    for i in range(4):
        homes[i] = picker.acquire(text(chat(i, 1)))
        picker.release(homes[i])
    assert {r.address for r in homes.values()} == {"a:1", "b:1"}
    busy = picker.acquire(text(chat(next(i for i, r in homes.items() if r.address == "b:1"), 2)))
    assert busy.address == "b:1"
    book.addresses = ["a:1", "c:1"]
    clock.now += 60.0  # past the resolution interval: b leaves, c joins
    newcomer = picker.acquire(text(chat(99, 1)))
    assert {r.address for r in picker.replicas} == {"a:1", "c:1"}
    assert newcomer.address == "c:1"  # idle: a new conversation goes there
    assert book.closed == []  # b still has a call in flight
    picker.release(busy)
    assert book.closed == ["b:1"]
    for i, replica in homes.items():  # a's conversations keep it
        if replica.address == "a:1":
            again = picker.acquire(text(chat(i, 2)))
            assert again.address == "a:1"
            picker.release(again)


def test_targets_resolve_to_replica_addresses():
    assert resolve_addresses("ipv4:127.0.0.1:1,127.0.0.1:2") == ["127.0.0.1:1", "127.0.0.1:2"]
    assert resolve_addresses("localhost:7") == ["localhost:7"]
    assert "127.0.0.1:7" in resolve_addresses("dns:///localhost:7")


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


def test_only_an_unavailable_call_that_produced_nothing_moves_to_another_replica():
    assert retries_elsewhere(_Failed(grpc.StatusCode.UNAVAILABLE), received=False)
    assert not retries_elsewhere(_Failed(grpc.StatusCode.UNAVAILABLE), received=True)
    assert not retries_elsewhere(_Failed(grpc.StatusCode.INVALID_ARGUMENT), received=False)


# -- against two real decode servers ----------------------------------------------------------------------

SAFETY_TIMEOUT = 60.0


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory):
    """Two aggregated decode servers over one tiny model, on one event-loop thread; yields (ports,
    servers, call) where `call` runs a coroutine on that loop."""
    from decode_service.config import DecodeServiceConfig
    from decode_service.server import DecodeServer
    from engine.config import CacheConfig, EngineConfig
    from engine.engine import Engine

    model_dir = tmp_path_factory.mktemp("tiny-model")
    tiny_hf_model(23, vocab_size=TINY_VOCAB_SIZE).save_pretrained(model_dir)
    build_tiny_tokenizer(model_dir)
    config = EngineConfig(
        cache=CacheConfig(block_size=8, num_blocks=256),
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=128,
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(SAFETY_TIMEOUT)

    def start(port: int = 0) -> tuple[DecodeServer, int]:
        engine = Engine.from_pretrained(model_dir, config)

        async def create() -> DecodeServer:
            return DecodeServer(engine, DecodeServiceConfig(host="127.0.0.1", port=port))

        server = call(create())
        return server, call(server.start())

    servers, ports = zip(*(start() for _ in range(2)), strict=True)
    state = {"servers": list(servers), "ports": list(ports), "call": call, "start": start}
    yield state
    for server in state["servers"]:
        call(server.stop())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(SAFETY_TIMEOUT)
    loop.close()


def _turns(client: TandemClient, index: int, turns: int) -> list[int]:
    """Run one conversation of token-id turns; the cached prompt tokens of each turn."""
    history: list[int] = [3 + index, 40 + index, 77, 91] * 6
    cached = []
    for turn in range(turns):
        history += [100 + (index * 13 + turn * 5 + k) % 150 for k in range(12)]
        completion = client.complete(token_ids=history, temperature=0.0, max_tokens=6, ignore_eos=True)
        cached.append(completion.usage.cached_tokens)
        history += list(completion.token_ids)
    return cached


def test_turns_hit_their_history_and_conversations_use_both_replicas(two_replicas):
    target = "ipv4:" + ",".join(f"127.0.0.1:{p}" for p in two_replicas["ports"])
    with TandemClient(target, timeout=SAFETY_TIMEOUT, affinity=True) as client:
        for index in range(4):
            cached = _turns(client, index, 3)
            # Turn 1 shares nothing cached beyond other conversations' blocks; every later turn finds
            # its whole previous prompt (whole blocks of it) on the replica it goes back to.
            assert all(hit >= 24 for hit in cached[1:]), cached
        served = [r.last_chosen > 0 for r in client._picker.replicas]
    assert all(served)


def test_a_replica_that_stops_loses_no_conversation_and_one_that_returns_is_used_again(two_replicas):
    ports, servers, call = two_replicas["ports"], two_replicas["servers"], two_replicas["call"]
    target = "ipv4:" + ",".join(f"127.0.0.1:{p}" for p in ports)
    with TandemClient(target, timeout=SAFETY_TIMEOUT, affinity=True) as client:
        picker = client._picker
        _turns(client, 7, 1)
        home = next(r for r in picker.replicas if r.last_chosen)
        index = ports.index(int(home.address.rsplit(":", 1)[1]))
        call(servers[index].stop())
        # The next turns find the replica gone (UNAVAILABLE before any token) and move to the other.
        assert len(_turns(client, 7, 2)) == 2
        assert home.failures == 1 and not home.blocks
        servers[index], _ = two_replicas["start"](ports[index])
        conversations = itertools.count(20)

        def home_serves_again() -> bool:
            home.down_until = 0.0  # skip our backoff: what we wait for is the channel reconnecting
            _turns(client, next(conversations), 1)
            return home.failures == 0  # a call it answered

        assert wait_until(home_serves_again, SAFETY_TIMEOUT)


def test_the_async_client_routes_the_same_way(two_replicas):
    target = "ipv4:" + ",".join(f"127.0.0.1:{p}" for p in two_replicas["ports"])

    async def conversation() -> list[int]:
        async with AsyncTandemClient(target, timeout=SAFETY_TIMEOUT, affinity=True) as client:
            history, cached = [9, 8, 7, 6] * 8, []
            for turn in range(3):
                history += [120 + turn * 3 + k for k in range(10)]
                completion = await client.complete(
                    token_ids=history, temperature=0.0, max_tokens=4, ignore_eos=True
                )
                cached.append(completion.usage.cached_tokens)
                history += list(completion.token_ids)
            return cached

    cached = asyncio.run(conversation())
    assert all(hit >= 32 for hit in cached[1:]), cached
