"""KV cache events in vLLM's wire format: how a cache-aware router learns which blocks a replica holds.

llm-d's precise prefix-cache scorer and Dynamo's KV router subscribe to each vLLM replica's KV events
and keep an index of the prefixes it caches. tandem publishes the same messages from both tiers'
prefix caches (`--kv-events-config`), so those routers steer to tandem replicas unchanged. This module
is the schema, the configuration and the recorder a `BlockManager` fills; the ZMQ side is
`engine.kv_event_publisher`.

Wire format (vLLM's `vllm/distributed/kv_events.py`, as vLLM 0.24-0.26 send it):

- A ZMQ PUB socket at `endpoint`. vLLM binds it when the endpoint has `*` or `::` or is
  `ipc://`/`inproc://` and connects otherwise; tandem reads a `*` host as the server's `--host` and also
  binds a TCP address of this machine, connecting only to one elsewhere (`engine.kv_event_endpoints`,
  `engine.kv_event_publisher`). Each batch is one 3-frame message: the topic (bytes), the sequence number
  (8-byte big-endian unsigned; 0 first, one more per batch) and the msgpack payload. A number is taken
  when the batch is queued, so a batch dropped on a full queue leaves a gap subscribers can see.
- The payload is the batch as a msgpack array `[ts, events, data_parallel_rank]`: a float Unix time,
  the events, and rank 0.
- Each event is a msgpack map tagged by `"type"`, the class name:
  `BlockStored` {block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
  and only when set: extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window};
  `BlockRemoved` {block_hashes, medium, and only when set: group_idx}; `AllBlocksCleared` {}.
  Fields without a default are always present (lora_id, lora_name: null; tandem serves no adapter).
- Block hashes are ints. tandem's chain hash is SHA-256 (`engine.block_manager.chain_hash`); an event
  carries the digest's last 8 bytes as a big-endian unsigned int, the way vLLM turns its own bytes
  hashes into ints. `parent_block_hash` is the previous block's hash, or null for a chain's first block
  (its parent is tandem's root hash of model namespace and cache salt, which is no block).
- `medium` is where the block lives: "GPU" on a CUDA engine, "CPU" on a CPU one.
- A model with several KV groups (sliding-window layers, `engine.kv_layout`) sends `group_idx`,
  `kv_cache_spec_kind` ("full_attention" or "sliding_window") and the window; a one-group layout
  leaves them out.
- Replay: with `replay_endpoint` (a `*` host again the server's `--host`), a ROUTER socket bound there.
  A subscriber (DEALER, or REQ, which adds the empty delimiter itself) sends `[b"", start_seq]`
  (8-byte big-endian); the answer is one
  `[b"", seq, payload]` per batch kept (the last `buffer_steps`) with seq >= start_seq, then
  `[b"", -1 as 8-byte signed big-endian, b""]`.

One message per engine step that changed the cache: `BlockStored` when a step's computed blocks are
registered (one per group and run of consecutive new blocks; a block whose content another block
already caches is not registered, so not announced), `BlockRemoved` when an allocation evicts one.
Nothing clears tandem's cache at once, so `AllBlocksCleared` is never sent; it is here for readers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import msgspec

from base.errors import ConfigError
from engine import kv_event_endpoints

# The flag both tiers take the config from, named in every error about it, and its help.
FLAG = "--kv-events-config"
FLAG_HELP = (
    "publish the prefix cache's KV events (BlockStored, BlockRemoved) over ZMQ in vLLM's format, for "
    "cache-aware routers (llm-d's precise prefix-cache scorer, Dynamo's KV router): vLLM's KVEventsConfig "
    'as JSON, e.g. \'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": '
    '"tcp://*:5558"}\'; fields enable_kv_cache_events, publisher (zmq or null), endpoint, replay_endpoint, '
    "buffer_steps, hwm, max_queue_size, topic; a * host is --host's address (tcp://0.0.0.0:PORT: every "
    "interface), an address of this machine is bound, another connected to (default: off)"
)
MEDIUM_BY_DEVICE = {"cuda": "GPU", "cpu": "CPU"}
PUBLISHERS = ("zmq", "null")


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """An event: a msgpack map whose "type" is the class name; fields at their default are left out."""


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


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    """One message's payload: a msgpack array, as every consumer of vLLM's events decodes it."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


def external_hash(digest: bytes) -> int:
    """The int a router sees for a chain hash: its last 8 bytes, big-endian, as vLLM converts its own."""
    return int.from_bytes(digest[-8:], "big")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig fields, with its defaults; `publisher` None means zmq when enabled."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        """True when events are recorded and sent (enabled, with the zmq publisher)."""
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    @classmethod
    def from_flag(cls, text: str | None, host: str) -> KVEventsConfig:
        """The validated config a `--kv-events-config` JSON object describes (None: events off), its `*`
        hosts bound to the server's `host` (`on_host`); ConfigError names what is wrong (bad JSON, an
        unknown field, a wrong type or value)."""
        if text is None:
            return cls()
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{FLAG} is not valid JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ConfigError(f'{FLAG} must be a JSON object, e.g. {{"enable_kv_cache_events": true}}')
        known = [f.name for f in fields(cls)]
        for name in values:
            if name not in known:
                raise ConfigError(f"{FLAG}: unknown field {name!r}; known: {', '.join(known)}")
        config = cls(**values)
        config.validate()
        return config.on_host(host)

    def on_host(self, host: str) -> KVEventsConfig:
        """This config with a `*` TCP host in either endpoint replaced by `host`, the address the server
        listens on: vLLM's default `tcp://*:5557` must not publish prompts' token ids on every interface
        of a server told to listen on one. `tcp://0.0.0.0:PORT` or `tcp://[::]:PORT` still mean all."""
        replay = self.replay_endpoint
        return replace(
            self,
            endpoint=kv_event_endpoints.on_host(self.endpoint, host),
            replay_endpoint=None if replay is None else kv_event_endpoints.on_host(replay, host),
        )

    def validate(self) -> None:
        """Check each field's type and range (the JSON may hold anything), naming the field."""
        for name, kinds in _FIELD_TYPES.items():
            value = getattr(self, name)
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                wanted = " or ".join("null" if kind is type(None) else _TYPE_NAMES[kind] for kind in kinds)
                raise ConfigError(f"{FLAG}: {name} must be {wanted}, not {value!r}")
        if self.publisher is not None and self.publisher not in PUBLISHERS:
            raise ConfigError(
                f"{FLAG}: publisher must be one of {', '.join(PUBLISHERS)}, not {self.publisher!r}"
            )
        for name in ("endpoint", "replay_endpoint"):
            endpoint = getattr(self, name)
            if endpoint is not None:
                kv_event_endpoints.check(endpoint, FLAG, name)
        for name in ("buffer_steps", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{FLAG}: {name} must be >= 1, got {getattr(self, name)}")
        if self.hwm < 0:
            raise ConfigError(f"{FLAG}: hwm must be >= 0 (0: no limit), got {self.hwm}")


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "enable_kv_cache_events": (bool,),
    "publisher": (str, type(None)),
    "endpoint": (str,),
    "replay_endpoint": (str, type(None)),
    "buffer_steps": (int,),
    "hwm": (int,),
    "max_queue_size": (int,),
    "topic": (str,),
}
_TYPE_NAMES = {bool: "true or false", int: "an integer", str: "a string"}


class KVEventRecorder:
    """The events of one engine's `BlockManager` since the last `take`, already in wire form.

    Only the engine thread records and takes (no lock). `windows` are the KV groups' windows; with
    more than one group each event names its group and the group's attention kind.
    """

    def __init__(self, block_size: int, medium: str, windows: Sequence[int | None]) -> None:
        self.block_size = block_size
        self.medium = medium
        self._groups: list[dict[str, Any]] = (
            [{}]
            if len(windows) == 1
            else [
                {
                    "group_idx": group,
                    "kv_cache_spec_kind": "full_attention" if window is None else "sliding_window",
                    "kv_cache_spec_sliding_window": window,
                }
                for group, window in enumerate(windows)
            ]
        )
        self._events: list[Event] = []

    def stored(
        self, group: int, indices: Sequence[int], hashes: Sequence[bytes], token_ids: Sequence[int]
    ) -> None:
        """Group `group` registered the sequence's blocks `indices` (ascending), whose chain hashes are
        `hashes[index]`: one BlockStored per run of consecutive blocks, chained to the block before."""
        bs, start = self.block_size, 0
        for end in range(1, len(indices) + 1):
            if end < len(indices) and indices[end] == indices[end - 1] + 1:
                continue
            first, last = indices[start], indices[end - 1]
            self._events.append(
                BlockStored(
                    block_hashes=[external_hash(digest) for digest in hashes[first : last + 1]],
                    parent_block_hash=external_hash(hashes[first - 1]) if first else None,
                    token_ids=list(token_ids[first * bs : (last + 1) * bs]),
                    block_size=bs,
                    lora_id=None,
                    medium=self.medium,
                    lora_name=None,
                    **self._groups[group],
                )
            )
            start = end

    def removed(self, group: int, digest: bytes) -> None:
        """Group `group`'s block with chain hash `digest` was evicted from the cache."""
        self._events.append(
            BlockRemoved([external_hash(digest)], self.medium, self._groups[group].get("group_idx"))
        )

    def take(self) -> list[Event]:
        """The events recorded since the last call, oldest first."""
        events, self._events = self._events, []
        return events
