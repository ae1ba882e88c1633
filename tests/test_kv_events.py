"""KV cache events in vLLM's wire format, read by a subscriber written from vLLM's published schema.

The subscriber below has its own msgspec Structs, as a router (llm-d, Dynamo) decodes vLLM's events:
the batch an array, events maps tagged by class name. It must see a `BlockStored` for every block a
request commits (hashes, token ids and parent chain equal to the block manager's own) and a
`BlockRemoved` for every eviction, so that its view of the cache ends equal to the cache; numbers
without gaps; missed batches replayed; a subscriber that never reads slowing nothing; a full queue
dropping and counting, the drop a visible gap; groups named on a sliding-window model; bad
configuration refused at start; and both tiers publishing when served.

A SUB socket misses what was sent before its subscription reached the publisher (ZMQ's slow joiner),
so tests either prime the stream until a batch arrives or fetch the start by replay, as routers do.
Waits poll with generous timeouts; no assertion is about time.
"""

from __future__ import annotations

import itertools
import json
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import zmq
from conftest import engine_for, free_ports, random_prompts, save_tiny_model, tiny_hf_model, wait_until
from prometheus_client import generate_latest
from test_core_process import ProcessServer, greedy
from test_disagg_serving import RunningDecode, RunningPrefill, prompts_of
from test_kv_groups import windowed_hf_model

from base.errors import ConfigError
from decode_service.engine_core.messages import CoreStats
from decode_service.metrics import DecodeMetrics
from engine.block_manager import BlockManager
from engine.engine import Engine, GenerateRequest
from engine.kv_event_publisher import KVEventPublisher
from engine.kv_events import BlockStored as TandemBlockStored
from engine.kv_events import KVEventsConfig
from engine.model_store import model_fingerprint
from engine.params import SamplingParams, StoppingParams
from engine.sequence import Sequence
from prefill_service.config import PrefillServiceConfig
from prefill_service.server import PrefillServer
from tandem.cli import build_parser

BS = 4
LOOPBACK = "tcp://127.0.0.1:*"  # bound by the publisher on a free loopback port
FRESH = itertools.count()  # numbers the priming prompts, so that no two are ever alike


# -- vLLM's schema, as a subscriber reads it (vllm/distributed/kv_events.py) -------------------------


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(KVEventBatch)
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class Subscriber:
    """A router's connection: SUB on the events endpoint, DEALER on the replay endpoint."""

    def __init__(
        self, endpoint: str, replay_endpoint: str | None = None, options: dict[int, int] | None = None
    ) -> None:
        """`options`: socket options of the SUB socket, set before it connects."""
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        for option, value in (options or {}).items():
            self.sub.setsockopt(option, value)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        # Batches in the order they arrived live: (sequence number, topic, raw payload).
        self.live: list[tuple[int, bytes, bytes]] = []

    def receive(self, until: Callable[[], bool], timeout: float = 60.0) -> bool:
        """Read live batches until `until()` holds (True) or the safety timeout passes (False)."""
        return wait_until(lambda: self._drain() or until(), timeout)

    def _drain(self) -> bool:
        while self.sub.poll(0):
            topic, number, payload = self.sub.recv_multipart()
            assert len(number) == 8
            self.live.append((int.from_bytes(number, "big"), topic, payload))
        return False

    @property
    def live_numbers(self) -> list[int]:
        return [number for number, _, _ in self.live]

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        """The kept batches from `start` on, as the replay socket answers: (number, payload) pairs, up to
        and excluding the end marker (which must come)."""
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        batches = []
        try:
            while True:
                assert dealer.poll(60_000), "no answer from the replay socket"
                empty, number, payload = dealer.recv_multipart()
                assert empty == b""
                if number == END_OF_REPLAY:
                    assert payload == b""
                    return batches
                batches.append((int.from_bytes(number, "big"), payload))
        finally:
            dealer.close()

    def close(self) -> None:
        self.context.destroy(linger=0)


def external(digest: bytes) -> int:
    """What vLLM's readers expect for a bytes hash: its last 8 bytes, big-endian."""
    return int.from_bytes(digest[-8:], "big")


class Spy:
    """Records every batch the engine hands to a publisher (index = its sequence number)."""

    def __init__(self, publisher: KVEventPublisher) -> None:
        self.batches: list[list[Any]] = []
        self._publish = publisher.publish
        publisher.publish = self

    def __call__(self, events: list[Any]) -> None:
        self.batches.append(list(events))
        self._publish(events)


def events_engine(hf_model, num_blocks: int, **config_kwargs) -> tuple[Engine, KVEventPublisher, Spy]:
    engine = engine_for(hf_model, block_size=BS, num_blocks=num_blocks)
    config = KVEventsConfig(True, endpoint=LOOPBACK, replay_endpoint=LOOPBACK, **config_kwargs)
    publisher = KVEventPublisher(config)
    spy = Spy(publisher)
    engine.attach_kv_events(publisher)
    return engine, publisher, spy


def greedy_request(prompt: list[int], max_tokens: int = 4) -> GenerateRequest:
    return GenerateRequest(
        prompt, SamplingParams(temperature=0.0), StoppingParams(max_tokens, ignore_eos=True)
    )


def prime(engine: Engine, subscriber: Subscriber, spy: Spy) -> int:
    """Commit fresh one-block prompts until one of their batches arrives live: from then on the
    subscription is in place at the publisher. Returns the first live number."""
    for _ in range(200):
        batches, fresh = len(spy.batches), next(FRESH)
        engine.generate([greedy_request([7, 7, 3 + fresh // 300, 3 + fresh % 300, 1], max_tokens=1)])
        assert len(spy.batches) == batches + 1, "a fresh block is announced in one batch"
        if subscriber.receive(lambda: bool(subscriber.live), timeout=0.5):
            return subscriber.live[0][0]
    raise AssertionError("no batch ever arrived live")


def decoded(payload: bytes) -> KVEventBatch:
    return DECODER.decode(payload)


class CacheView:
    """What a router believes a replica caches, built from the events alone."""

    def __init__(self) -> None:
        self.blocks: dict[tuple[int | None, int], tuple[int | None, list[int]]] = {}

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                for index, block in enumerate(event.block_hashes):
                    key = (event.group_idx, block)
                    assert key not in self.blocks, "a block announced twice without its removal"
                    tokens = event.token_ids[index * event.block_size : (index + 1) * event.block_size]
                    self.blocks[key] = (parent, tokens)
                    parent = block
            else:
                assert isinstance(event, BlockRemoved)
                for block in event.block_hashes:
                    assert self.blocks.pop((event.group_idx, block), None) is not None, "removed unknown"


def chain_of(seq: Sequence, manager: BlockManager) -> dict[int, tuple[int | None, list[int]]]:
    """Each full computed block of `seq` as the block manager hashed it: hash -> (parent, token ids)."""
    full = (seq.num_tokens - 1) // BS
    hashes = manager.block_hashes(seq, full)
    return {
        external(digest): (external(hashes[i - 1]) if i else None, seq.token_ids[i * BS : (i + 1) * BS])
        for i, digest in enumerate(hashes)
    }


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model(0)


# -- the events ----------------------------------------------------------------------------------------


def test_every_committed_block_is_stored_evictions_removed_and_numbers_have_no_gaps(hf_model):
    # 24 blocks of 4 tokens: the prompts below need far more, so LRU blocks are evicted along the way.
    engine, publisher, spy = events_engine(hf_model, num_blocks=24)
    publisher.start()
    subscriber = Subscriber(publisher.endpoint, publisher.replay_endpoint)
    try:
        first_live = prime(engine, subscriber, spy)
        prompts = random_prompts(10, 3, min_len=9, max_len=30)
        prompts += [prompts[0] + [5, 6, 7, 8, 9], prompts[1][:12] + [4]]  # cached prefixes: no re-announce
        finished = engine.generate([greedy_request(p, max_tokens=6) for p in prompts])
        assert all(seq.is_finished for seq in finished)
        last = len(spy.batches) - 1
        assert subscriber.receive(lambda: bool(subscriber.live) and subscriber.live[-1][0] == last)
        assert wait_until(lambda: publisher.num_published == len(spy.batches))
        assert publisher.num_dropped == 0

        live = subscriber.live_numbers
        assert live == list(range(first_live, last + 1)), "live numbers run on without a gap"
        replayed = subscriber.replay(0)
        assert [number for number, _ in replayed] == list(range(last + 1))
        payloads = dict(replayed)
        assert all(payloads[number] == payload for number, _, payload in subscriber.live)

        # The wire shape vLLM's readers decode: [ts, events, rank], events maps tagged by "type".
        raw = msgspec.msgpack.decode(payloads[0])
        assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 0
        stored = raw[1][0]
        assert stored["type"] == "BlockStored" and stored["block_size"] == BS
        assert stored["medium"] == ("GPU" if engine.device.type == "cuda" else "CPU")
        assert stored["lora_id"] is None and stored["lora_name"] is None
        assert "group_idx" not in stored and "extra_keys" not in stored, "one group: no group fields"

        view = CacheView()
        batches = [decoded(payloads[number]) for number in range(last + 1)]
        for batch in batches:
            view.apply(batch)
        chains: dict[int, tuple[int | None, list[int]]] = {}
        for seq in finished:
            chains.update(chain_of(seq, engine.block_manager))
        announced = {
            block
            for batch in batches
            for e in batch.events
            if isinstance(e, BlockStored)
            for block in e.block_hashes
        }
        assert set(chains) <= announced, "every block a request committed was announced"
        for batch in batches:
            for event in batch.events:
                if isinstance(event, BlockStored) and event.block_hashes[0] in chains:
                    parent = event.parent_block_hash
                    for index, block in enumerate(event.block_hashes):
                        assert chains[block] == (parent, event.token_ids[index * BS : (index + 1) * BS])
                        parent = block
        removed = sum(len(e.block_hashes) for b in batches for e in b.events if isinstance(e, BlockRemoved))
        assert removed > 0, "the pool was too large to evict"
        assert len(view.blocks) == engine.block_manager.num_cached_blocks, "the router's view is the cache"
    finally:
        subscriber.close()
        engine.stop_kv_events()


def test_a_late_subscriber_gets_the_missed_batches_back_by_replay(hf_model):
    engine, publisher, spy = events_engine(hf_model, num_blocks=64, buffer_steps=3)
    publisher.start()
    try:
        engine.generate([greedy_request(p) for p in random_prompts(6, 4, min_len=8, max_len=20)])
        total = len(spy.batches)
        assert total > 3
        assert wait_until(lambda: publisher.num_published == total)
        late = Subscriber(publisher.endpoint, publisher.replay_endpoint)
        try:
            # Only the last `buffer_steps` batches are kept; asking from 0 gets those, then the marker.
            replayed = late.replay(0)
            assert [number for number, _ in replayed] == list(range(total - 3, total))
            for number, payload in replayed:
                stored = [e for e in decoded(payload).events if isinstance(e, BlockStored)]
                sent = [e for e in spy.batches[number] if type(e).__name__ == "BlockStored"]
                assert [e.block_hashes for e in stored] == [e.block_hashes for e in sent]
            assert [number for number, _ in late.replay(total - 1)] == [total - 1]
            assert late.replay(total) == [], "nothing from a number not sent yet, but the marker"
        finally:
            late.close()
    finally:
        engine.stop_kv_events()


def test_a_subscriber_that_never_reads_slows_nothing(hf_model):
    # hwm 1: the publisher holds one batch per subscriber, then drops that subscriber's batches.
    engine, publisher, spy = events_engine(hf_model, num_blocks=64, hwm=1, buffer_steps=4)
    publisher.start()
    sleeper = Subscriber(publisher.endpoint, options={zmq.RCVHWM: 1, zmq.RCVBUF: 4096})
    try:
        prime(engine, sleeper, spy)  # subscribed for sure: it read one batch, and now reads no more
        first = engine.generate([greedy_request(p, max_tokens=8) for p in random_prompts(8, 5, 8, 24)])
        # Far more than socket buffers hold: 200 batches of 64k token ids each (~40 MB on the wire).
        token_ids = list(range(65_536))
        for number in range(200):
            publisher.publish([TandemBlockStored([number], None, token_ids, BS, None, "CPU", None)])
        then = engine.generate([greedy_request(p) for p in random_prompts(4, 6, min_len=8, max_len=24)])
        assert all(seq.is_finished for seq in first + then)
        total = len(spy.batches)
        assert wait_until(lambda: publisher.num_published == total, timeout=120), "the publisher stalled"
        assert publisher.num_dropped == 0
        # And it goes on publishing: a fresh reader gets the next batches live.
        reader = Subscriber(publisher.endpoint)
        try:
            prime(engine, reader, spy)
        finally:
            reader.close()
    finally:
        sleeper.close()
        engine.stop_kv_events()


def test_a_full_queue_drops_and_counts_and_the_drop_is_a_gap(hf_model):
    engine, publisher, spy = events_engine(hf_model, num_blocks=64, max_queue_size=1)
    try:
        # The sending thread has not started: the first batch fills the queue, the others are dropped.
        engine.generate([greedy_request(p) for p in random_prompts(4, 7, min_len=8, max_len=20)])
        sent = len(spy.batches)
        assert sent > 2
        assert (publisher.num_published, publisher.num_dropped) == (0, sent - 1)
        publisher.start()
        assert wait_until(lambda: publisher.num_published == 1)
        engine.generate([greedy_request([9, 8, 7, 6, 5], max_tokens=1)])
        assert len(spy.batches) == sent + 1, "one new block, one batch"
        assert wait_until(lambda: publisher.num_published == 2)
        subscriber = Subscriber(publisher.endpoint, publisher.replay_endpoint)
        try:
            numbers = [number for number, _ in subscriber.replay(0)]
        finally:
            subscriber.close()
        assert numbers == [0, sent], "batches 1 .. sent-1 are missing: a gap a subscriber sees"
        assert publisher.num_dropped == sent - 1
    finally:
        engine.stop_kv_events()


def test_a_sliding_window_model_names_each_group_and_its_kind():
    # Qwen2 with layers 0, 1, 3 sliding over 8 tokens and layer 2 global: four KV groups, full first.
    engine, publisher, spy = events_engine(windowed_hf_model("qwen2", 3), num_blocks=64)
    try:
        engine.generate(
            [greedy_request(p, max_tokens=6) for p in random_prompts(8, 8, min_len=20, max_len=40)]
        )
        events = [event for batch in spy.batches for event in batch]
        wire = [msgspec.msgpack.decode(msgspec.msgpack.encode(event)) for event in events]
        stored = [e for e in wire if e["type"] == "BlockStored"]
        assert {e["group_idx"] for e in stored} == {0, 1, 2, 3}
        for event in stored:
            if event["group_idx"] == 0:
                assert event["kv_cache_spec_kind"] == "full_attention"
                assert "kv_cache_spec_sliding_window" not in event
            else:
                assert event["kv_cache_spec_kind"] == "sliding_window"
                assert event["kv_cache_spec_sliding_window"] == 8
        removed = [e for e in wire if e["type"] == "BlockRemoved"]
        assert removed and all(e["group_idx"] in (0, 1, 2, 3) for e in removed)
        view = CacheView()
        view.apply(DECODER.decode(msgspec.msgpack.encode([0.0, events, 0])))
        assert len(view.blocks) == engine.block_manager.num_cached_blocks
    finally:
        engine.stop_kv_events()


# -- configuration -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"enable_kv_cache_events": true, "port": 5557}', "unknown field 'port'"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be true or false"),
        ('{"hwm": true}', "hwm must be an integer"),
        ('{"replay_endpoint": 5558}', "replay_endpoint must be a string or null"),
        ('{"publisher": "kafka"}', "publisher must be one of zmq, null"),
        ('{"publisher": 1}', "publisher must be a string or null"),
        ('{"endpoint": null}', "endpoint must be a string"),
        ('{"endpoint": "localhost:5557"}', "endpoint must be a ZMQ endpoint"),
        ('{"endpoint": "udp://*:5557"}', "endpoint must be a ZMQ endpoint"),
        ('{"endpoint": "ipc://"}', "endpoint must be a ZMQ endpoint"),
        ('{"endpoint": "tcp://*"}', "endpoint must be tcp://HOST:PORT"),
        ('{"endpoint": "tcp://:5557"}', "endpoint must be tcp://HOST:PORT"),
        ('{"endpoint": "tcp://*:65536"}', "endpoint must be tcp://HOST:PORT with a port of 0-65535"),
        ('{"endpoint": "tcp://*:http"}', "endpoint must be tcp://HOST:PORT with a port of 0-65535"),
        ('{"endpoint": "tcp://::1:5557"}', "endpoint must put an IPv6 host in brackets"),
        ('{"replay_endpoint": "tcp://127.0.0.1:-1"}', "replay_endpoint must be tcp://HOST:PORT"),
        ('{"replay_endpoint": "inproc:/x"}', "replay_endpoint must be a ZMQ endpoint"),
        ('{"buffer_steps": "10"}', "buffer_steps must be an integer"),
        ('{"buffer_steps": 0}', "buffer_steps must be >= 1"),
        ('{"hwm": -1}', "hwm must be >= 0"),
        ('{"max_queue_size": 1.5}', "max_queue_size must be an integer"),
        ('{"max_queue_size": 0}', "max_queue_size must be >= 1"),
        ('{"topic": null}', "topic must be a string"),
        ("[true]", "must be a JSON object"),
        ("{enable}", "not valid JSON"),
    ],
)
def test_a_bad_config_is_refused_naming_the_field(text, message):
    with pytest.raises(ConfigError, match="--kv-events-config") as refused:
        KVEventsConfig.from_flag(text, "127.0.0.1")
    assert message in str(refused.value)


def test_the_flag_reaches_both_tiers_configs_and_defaults_to_off():
    from decode_service.cli import service_config_from_args as decode_config
    from prefill_service.cli import service_config_from_args as prefill_config

    parser = build_parser()
    flag = ["--kv-events-config", '{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:5558"}']
    for tier, parse in (("decode", decode_config), ("prefill", prefill_config)):
        assert not parse(parser.parse_args(["serve", tier])).kv_events.enabled
        config = parse(parser.parse_args(["serve", tier, *flag])).kv_events
        # vLLM's `*` is the server's --host, whose default is every IPv4 interface.
        assert config.enabled
        assert (config.endpoint, config.replay_endpoint) == ("tcp://0.0.0.0:5557", "tcp://0.0.0.0:5558")
        with pytest.raises(ConfigError, match="unknown field 'bogus'"):
            parse(parser.parse_args(["serve", tier, "--kv-events-config", '{"bogus": 1}']))
    assert not KVEventsConfig(True, publisher="null").enabled, "the null publisher records nothing"


def held_port() -> tuple[socket.socket, int]:
    holder = socket.socket()
    holder.bind(("0.0.0.0", 0))
    holder.listen()
    return holder, holder.getsockname()[1]


def test_a_taken_port_or_a_bad_endpoint_fails_at_start():
    holder, port = held_port()
    try:
        with pytest.raises(
            ConfigError, match=rf"KV events endpoint tcp://\*:{port} is not available: Address"
        ):
            KVEventPublisher(KVEventsConfig(True, endpoint=f"tcp://*:{port}"))
        replay = KVEventsConfig(True, endpoint=LOOPBACK, replay_endpoint=f"tcp://*:{port}")
        with pytest.raises(ConfigError, match="KV events replay endpoint .* is not available"):
            KVEventPublisher(replay)
    finally:
        holder.close()
    with pytest.raises(ConfigError, match="endpoint must be a ZMQ endpoint .* not 'nope://x'"):
        KVEventPublisher(KVEventsConfig(True, endpoint="nope://x"))


# -- where the sockets listen, and what a peer may send them ----------------------------------------------


def accepts(address: str, port: int) -> bool:
    """True when a TCP connection to `address`:`port` is accepted (something listens there for it)."""
    try:
        socket.create_connection((address, port), timeout=10).close()
    except OSError:
        return False
    return True


def require_a_second_loopback_address() -> None:
    """Skip unless 127.0.0.2 reaches this machine's loopback, where a socket on every interface would
    accept it: the probe that tells one interface from all."""
    holder, port = held_port()
    try:
        if not accepts("127.0.0.2", port):
            pytest.skip("127.0.0.2 is not routed to loopback here")
    finally:
        holder.close()


def until_one_arrives(publisher: KVEventPublisher, subscriber: Subscriber) -> bool:
    """Publish empty batches until one reaches `subscriber` (its subscription has reached the publisher)."""

    def arrived() -> bool:
        publisher.publish([])
        return subscriber.receive(lambda: bool(subscriber.live), timeout=0.05)

    return wait_until(arrived)


def decode_config(*flags: str) -> KVEventsConfig:
    from decode_service.cli import service_config_from_args

    return service_config_from_args(build_parser().parse_args(["serve", "decode", *flags])).kv_events


def test_vllms_wildcard_endpoints_bind_only_the_servers_host():
    # 127.0.0.2 is this machine's loopback too: a socket on every interface would accept it.
    require_a_second_loopback_address()
    port, replay_port = free_ports(2)
    events = json.dumps(served_events(f"tcp://*:{port}", f"tcp://*:{replay_port}"))
    config = decode_config("--host", "127.0.0.1", "--kv-events-config", events)
    publisher = KVEventPublisher(config)
    try:
        assert (publisher.endpoint, publisher.replay_endpoint) == (
            f"tcp://127.0.0.1:{port}",
            f"tcp://127.0.0.1:{replay_port}",
        )
        assert accepts("127.0.0.1", port) and accepts("127.0.0.1", replay_port)
        assert not accepts("127.0.0.2", port) and not accepts("127.0.0.2", replay_port)
    finally:
        publisher.close()
    default = decode_config("--host", "127.0.0.1", "--kv-events-config", '{"enable_kv_cache_events": true}')
    assert default.endpoint == "tcp://127.0.0.1:5557", "vLLM's default endpoint follows --host"


def test_an_ipv6_host_is_bracketed_and_bound_as_ipv6():
    config = KVEventsConfig.from_flag('{"enable_kv_cache_events": true, "endpoint": "tcp://*:*"}', "::1")
    assert config.endpoint == "tcp://[::1]:*"
    try:
        publisher = KVEventPublisher(config)
    except ConfigError:
        pytest.skip("no IPv6 loopback here")
    try:
        assert publisher.endpoint.startswith("tcp://[::1]:")
    finally:
        publisher.close()


def test_every_interface_only_when_the_endpoint_names_it():
    require_a_second_loopback_address()
    (port,) = free_ports(1)
    text = json.dumps(served_events(f"tcp://0.0.0.0:{port}", None))
    publisher = KVEventPublisher(KVEventsConfig.from_flag(text, "127.0.0.1"))
    try:
        assert publisher.endpoint == f"tcp://0.0.0.0:{port}"
        assert accepts("127.0.0.2", port)
    finally:
        publisher.close()


def test_a_tcp_address_of_this_machine_is_bound_and_one_elsewhere_connected():
    (port,) = free_ports(1)
    publisher = KVEventPublisher(KVEventsConfig(True, endpoint=f"tcp://127.0.0.1:{port}"))
    subscriber = Subscriber(f"tcp://127.0.0.1:{port}")
    try:
        assert accepts("127.0.0.1", port), "the publisher listens on the address it was given"
        assert publisher.bound and publisher.endpoint == f"tcp://127.0.0.1:{port}"
        publisher.start()
        # The subscriber reaches the bound socket.
        assert until_one_arrives(publisher, subscriber)
    finally:
        subscriber.close()
        publisher.close()
    # TEST-NET-3 is nobody's address: a bind cannot take it, so the publisher connects, as vLLM's does.
    elsewhere = KVEventPublisher(KVEventsConfig(True, endpoint="tcp://203.0.113.7:5557"))
    try:
        assert not elsewhere.bound and elsewhere.endpoint == "tcp://203.0.113.7:5557"
    finally:
        elsewhere.close()


def resident_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def zmtp_handshake(peer: socket.socket, socket_type: bytes) -> None:
    """A raw ZMTP 3.0 peer's greeting and NULL-mechanism READY, as any client may send them."""
    greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)
    name = b"Socket-Type"
    body = b"\x05READY" + bytes([len(name)]) + name + len(socket_type).to_bytes(4, "big") + socket_type
    peer.sendall(greeting + b"\x04" + bytes([len(body)]) + body)


ANNOUNCED_BYTES = 2**30  # what the peer says its frame holds
SENT_BYTES = 96 * 2**20  # what it sends of it unless it is cut off


@pytest.mark.parametrize(("which", "socket_type"), [("endpoint", b"SUB"), ("replay_endpoint", b"DEALER")])
def test_a_peer_announcing_a_frame_over_the_cap_is_cut_off_and_grows_nothing(which, socket_type):
    publisher = KVEventPublisher(KVEventsConfig(True, endpoint=LOOPBACK, replay_endpoint=LOOPBACK))
    publisher.start()
    host, port = getattr(publisher, which).removeprefix("tcp://").rsplit(":", 1)
    chunk = bytes(2**20)
    before = resident_bytes()
    sent = 0
    try:
        with socket.create_connection((host, int(port)), timeout=30) as peer:
            zmtp_handshake(peer, socket_type)
            # A long message frame: flags 0x02, then its 8-byte size.
            peer.sendall(b"\x02" + ANNOUNCED_BYTES.to_bytes(8, "big"))
            try:
                while sent < SENT_BYTES:
                    peer.sendall(chunk)
                    sent += len(chunk)
            except OSError:
                pass
            # Measured while the peer is still connected: closing it frees what the server took.
            grown = resident_bytes() - before
    finally:
        publisher.close()
    assert grown < 32 * 2**20, f"the server grew by {grown} bytes of a {sent}-byte frame"
    assert sent < SENT_BYTES, "the server kept reading a frame larger than the cap"


def test_the_cap_leaves_room_for_a_subscription_to_a_long_topic():
    topic = "t" * 10_000
    publisher = KVEventPublisher(KVEventsConfig(True, endpoint=LOOPBACK, topic=topic))
    subscriber = Subscriber(publisher.endpoint)
    subscriber.sub.setsockopt(zmq.UNSUBSCRIBE, b"")
    subscriber.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    try:
        assert publisher.max_inbound_bytes > len(topic)
        publisher.start()
        assert until_one_arrives(publisher, subscriber)
        assert subscriber.live[0][1] == topic.encode()
    finally:
        subscriber.close()
        publisher.close()


def test_the_counters_are_exported_under_tandem_names():
    stats = CoreStats(kv_events_published=7, kv_events_dropped=2)
    text = generate_latest(DecodeMetrics(lambda: stats).registry).decode()
    assert "tandem:kv_events_published_total 7.0" in text
    assert "tandem:kv_events_dropped_total 2.0" in text


# -- served --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kv-events-model")
    save_tiny_model(directory, 36)
    return directory


def served_events(endpoint: str, replay_endpoint: str | None) -> dict:
    return {"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay_endpoint}


def stored_hashes(subscriber: Subscriber) -> set[int]:
    """Every block hash the replay socket's kept batches announce as stored."""
    return {
        block
        for _, payload in subscriber.replay(0)
        for event in decoded(payload).events
        if isinstance(event, BlockStored)
        for block in event.block_hashes
    }


@pytest.mark.slow
def test_a_decode_server_with_its_core_process_publishes_a_generate_calls_blocks(model_dir):
    port, replay_port = free_ports(2)
    config = KVEventsConfig(**served_events(f"tcp://*:{port}", f"tcp://*:{replay_port}"))
    server = ProcessServer(model_dir, kv_events=config)
    subscriber = Subscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}")
    try:
        prompt = prompts_of([37], seed=2)[0]
        responses = list(server.stub.Generate(greedy(prompt, 5), timeout=60))
        assert responses[-1].finish_reason
        # 37 prompt tokens and 4 computed outputs in blocks of 8: five full blocks.
        assert wait_until(lambda: len(stored_hashes(subscriber)) >= 5, timeout=60)
        # The counters cross with each step's message: the next request's steps carry them.
        assert list(server.stub.Generate(greedy(prompt[:9], 2), timeout=60))[-1].finish_reason
        assert wait_until(lambda: server.core.stats.kv_events_published >= 1)
        scrape = generate_latest(server.server.metrics.registry).decode()
        assert "tandem:kv_events_published_total" in scrape
    finally:
        subscriber.close()
        server.close()


class EventsPrefill(RunningPrefill):
    """A prefill server whose config turns KV events on, on free loopback ports."""

    async def _create(self, model_dir, tls) -> PrefillServer:
        events = KVEventsConfig(True, endpoint=LOOPBACK, replay_endpoint=LOOPBACK)
        config = PrefillServiceConfig(host="127.0.0.1", port=0, tls=tls, kv_events=events)
        return PrefillServer(self.engine, model_fingerprint(model_dir), config)


@pytest.mark.slow
def test_the_prefill_tier_publishes_what_it_prefills(model_dir):
    prefill = EventsPrefill(model_dir)
    decode = RunningDecode(model_dir, prefill=prefill.address)
    subscriber = Subscriber(prefill.engine.kv_events.endpoint, prefill.engine.kv_events.replay_endpoint)
    try:
        prompt = prompts_of([50], seed=3)[0]
        assert decode.generate(prompt, 3, "kv-events-prefill")[-1].finish_reason
        assert "kv-events-prefill" in prefill.prefilled_request_ids()
        # 50 prompt tokens in blocks of 16: the prefill tier commits three full blocks.
        assert wait_until(lambda: len(stored_hashes(subscriber)) >= 3, timeout=60)
        scrape = generate_latest(prefill.server.metrics.registry).decode()
        assert "tandem:kv_events_published_total" in scrape
    finally:
        subscriber.close()
        decode.close()
        prefill.close()


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["decode", "prefill"])
def test_serve_exits_non_zero_naming_a_taken_events_port(tier, model_dir):
    holder, port = held_port()
    try:
        events = f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{port}"}}'
        command = [sys.executable, "-m", "tandem.cli", "serve", tier, "--model", str(model_dir)]
        command += ["--host", "127.0.0.1", "--port", "0", "--threads", "1", "--block-size", "8"]
        command += ["--kv-cache-memory", "4MiB", "--kv-events-config", events]
        # The timeout only catches a process that would serve instead of failing.
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    finally:
        holder.close()
    assert result.returncode != 0
    endpoint = f"tcp://127.0.0.1:{port}"
    assert f"KV events endpoint {endpoint} is not available: Address already in use" in result.stderr
    assert f"{tier} server serving" not in result.stderr
