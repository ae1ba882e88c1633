"""Prefix-affine choice of a decode replica: send each request where its prompt's prefix is cached.

A replica's prefix cache serves only the prompts it saw, so round robin sends a conversation's next turn
to a replica that must compute its whole history again. With `affinity=True` a client keeps one channel
per replica and chooses the replica itself, as SGLang's cache-aware router does, from what it sent
where: it remembers, per replica, the chain hashes of the prompts' leading blocks (64-byte pieces of the
prompt text or the chat messages, or 16-token pieces of token ids; salt and tenant at the root, as the
server's cache keys them) and sends a request to the replica holding the longest run of its leading
blocks. So turns of one conversation meet their history, and prompts sharing a system prompt meet it
too, without the client knowing the server's tokenizer.

Load bounds the affinity (consistent hashing with bounded loads): a replica may take a call only while
it would then have at most `LOAD_BOUND` x the mean calls in flight, rounded up; among those, the one
with the longest match wins (ties: fewer calls in flight, then least recently chosen). So a hot prefix
or a shared system prompt spreads instead of piling on one replica, and without a match the
least-loaded replica takes the request.

Replicas come and go: a `dns:` target is resolved again every `RESOLVE_INTERVAL_S` and when every
replica is failing; a new address joins with nothing remembered, a vanished one is dropped with what it
held. A replica whose call fails with UNAVAILABLE before any response sits out a growing backoff and
forgets what it held (a restarted server's cache is empty); the call is retried on the next best.

gRPC's own ring_hash policy keyed by a request header cannot do this: a hash of the first blocks sends
every conversation with one system prompt to the same replica, and the header key is experimental in
grpcio (GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import socket
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import grpc

from protos.tandem.v1 import generation_pb2 as pb
from tandem.client.errors import Unavailable

BLOCK_BYTES = 64
BLOCK_TOKENS = 16
# Chain hashes remembered per replica (LRU): 64k blocks cover ~4 MB of prompt text.
MAX_REMEMBERED_BLOCKS = 65536
LOAD_BOUND = 1.25
RESOLVE_INTERVAL_S = 30.0
BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0
# Replicas one call is tried on when each fails with UNAVAILABLE before any response.
MAX_ATTEMPTS = 3

Stub = TypeVar("Stub")


def retries_elsewhere(error: grpc.RpcError, received: bool) -> bool:
    """Whether a failed call may be sent to another replica: the replica was unavailable and the call
    had produced nothing yet (a call that streamed tokens is the caller's to retry)."""
    return not received and getattr(error, "code", lambda: None)() == grpc.StatusCode.UNAVAILABLE


def _prompt_bytes(request: pb.GenerateRequest) -> tuple[bytes, int]:
    """The prompt as bytes and the block length that cuts it: token ids, the text, or the messages."""
    if request.token_ids:
        return array("i", request.token_ids).tobytes(), BLOCK_TOKENS * 4
    if request.messages:
        parts = []
        for message in request.messages:
            parts.append(message.role.encode() + b"\x00" + message.content.encode())
            for call in message.tool_calls:
                parts.append(call.name.encode() + b"\x00" + call.arguments.encode())
        return b"\x1e".join(parts) + b"\x1e", BLOCK_BYTES
    return request.prompt.encode(), BLOCK_BYTES


def prefix_chain(request: pb.GenerateRequest) -> list[bytes]:
    """Chain hashes of the request's full leading blocks: hash i stands for blocks 0..i together."""
    data, block = _prompt_bytes(request)
    parent = hashlib.sha256(
        b"tandem-affinity/1\x00" + request.cache_salt.encode() + b"\x00" + request.tenant.encode()
    ).digest()
    chain = []
    for start in range(0, len(data) - block + 1, block):
        parent = hashlib.sha256(parent + data[start : start + block]).digest()
        chain.append(parent)
    return chain


def resolve_addresses(target: str) -> list[str]:
    """The replica addresses a target names: an `ipv4:`/`ipv6:` list, a `dns:` name (resolved now), or
    one `host:port`."""
    for scheme in ("ipv4:", "ipv6:"):
        if target.startswith(scheme):
            return [address for address in target[len(scheme) :].split(",") if address]
    if not target.startswith("dns:"):
        return [target]
    name = target[len("dns:") :].lstrip("/")
    if "/" in name:  # dns://authority/host:port: the authority is a DNS server, which we leave to the OS
        name = name.split("/", 1)[1]
    host, _, port = name.rpartition(":")
    host = host.strip("[]")
    infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    addresses = []
    for family, _, _, _, sockaddr in infos:
        host = f"[{sockaddr[0]}]" if family == socket.AF_INET6 else sockaddr[0]
        address = f"{host}:{sockaddr[1]}"
        if address not in addresses:
            addresses.append(address)
    return addresses


@dataclass(eq=False)
class Replica(Generic[Stub]):
    """One decode replica: its address, the stub of its own channel, load and failures, what it holds."""

    address: str
    stub: Stub
    close: Callable[[], object]
    in_flight: int = 0
    last_chosen: int = 0
    failures: int = 0
    down_until: float = 0.0
    blocks: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    def matched(self, chain: Sequence[bytes]) -> int:
        """Leading blocks of `chain` this replica was sent (a chain hash stands for its whole prefix)."""
        for length in range(len(chain), 0, -1):
            if chain[length - 1] in self.blocks:
                return length
        return 0

    def remember(self, chain: Sequence[bytes]) -> None:
        for digest in chain:
            self.blocks[digest] = None
            self.blocks.move_to_end(digest)
        while len(self.blocks) > MAX_REMEMBERED_BLOCKS:
            self.blocks.popitem(last=False)


class ReplicaPicker(Generic[Stub]):
    """The replicas behind one target and the choice among them; one per client, safe to share between
    threads."""

    def __init__(
        self,
        target: str,
        connect: Callable[[str], tuple[Stub, Callable[[], object]]],
        resolve: Callable[[str], list[str]] = resolve_addresses,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.target = target
        self._connect = connect
        self._resolve = resolve
        self._clock = clock
        self._replicas: dict[str, Replica[Stub]] = {}
        self._choices = itertools.count(1)
        self._resolved_at = -RESOLVE_INTERVAL_S
        self._retired: list[Replica[Stub]] = []
        self._lock = threading.RLock()
        self.refresh()

    @property
    def replicas(self) -> list[Replica[Stub]]:
        return list(self._replicas.values())

    def refresh(self) -> None:
        """Resolve the target again: new addresses join, vanished ones leave (closed once idle)."""
        with self._lock:
            self._refresh()

    def _refresh(self) -> None:
        self._resolved_at = self._clock()
        try:
            addresses = self._resolve(self.target)
        except OSError:
            return  # keep what we have; a name that does not resolve now may later
        for address in addresses:
            if address not in self._replicas:
                stub, close = self._connect(address)
                self._replicas[address] = Replica(address, stub, close)
        for address in [a for a in self._replicas if a not in addresses]:
            self._retired.append(self._replicas.pop(address))
        self._close_idle_retired()

    def acquire(self, chain: Sequence[bytes], exclude: Iterable[Replica[Stub]] = ()) -> Replica[Stub] | None:
        """The replica for a prompt with leading blocks `chain`, counted as one more call in flight;
        None when every replica is excluded."""
        with self._lock:
            return self._acquire(chain, exclude)

    def _acquire(self, chain: Sequence[bytes], exclude: Iterable[Replica[Stub]]) -> Replica[Stub] | None:
        now = self._clock()
        if now - self._resolved_at >= RESOLVE_INTERVAL_S:
            self._refresh()
        excluded = set(map(id, exclude))
        allowed = [r for r in self._replicas.values() if id(r) not in excluded]
        healthy = [r for r in allowed if r.down_until <= now]
        if allowed and not healthy:
            self._refresh()
            allowed = [r for r in self._replicas.values() if id(r) not in excluded]
            healthy = [r for r in allowed if r.down_until <= now]
        candidates = healthy or sorted(allowed, key=lambda r: r.down_until)[:1]
        if not candidates:
            return None
        # The least-loaded candidate always fits this bound, so `eligible` is never empty.
        bound = math.ceil(LOAD_BOUND * (sum(r.in_flight for r in candidates) + 1) / len(candidates))
        eligible = [r for r in candidates if r.in_flight + 1 <= bound]
        replica = max(eligible, key=lambda r: (r.matched(chain), -r.in_flight, -r.last_chosen))
        replica.remember(chain)
        replica.in_flight += 1
        replica.last_chosen = next(self._choices)
        return replica

    def release(self, replica: Replica[Stub], failed: bool = False) -> None:
        """The call `acquire` counted is over; `failed`: the replica did not answer (UNAVAILABLE)."""
        with self._lock:
            self._release(replica, failed)

    def _release(self, replica: Replica[Stub], failed: bool) -> None:
        replica.in_flight -= 1
        if failed:
            replica.failures += 1
            replica.down_until = self._clock() + min(BACKOFF_S * 2 ** (replica.failures - 1), MAX_BACKOFF_S)
            replica.blocks.clear()
        else:
            replica.failures = 0
        self._close_idle_retired()

    def _close_idle_retired(self) -> None:
        for replica in [r for r in self._retired if r.in_flight == 0]:
            self._retired.remove(replica)
            replica.close()

    def close(self) -> list[object]:
        """Close every channel; returns what the closers returned (awaitables for grpc.aio channels)."""
        with self._lock:
            replicas = [*self._replicas.values(), *self._retired]
            self._replicas.clear()
            self._retired.clear()
        return [replica.close() for replica in replicas]


class ReplicaAttempts(Generic[Stub]):
    """One call's tries, replica after replica, as both clients make them: `next` picks a replica for the
    prompt, `received` records the first response (so `abort` can reach the replica running it),
    `failed` says whether the call may go on to another replica, `done` ends a try."""

    def __init__(
        self, picker: ReplicaPicker[Stub], request: pb.GenerateRequest, running: dict[str, Replica[Stub]]
    ) -> None:
        self._picker = picker
        self._chain = prefix_chain(request)
        self._running = running
        self._tried: list[Replica[Stub]] = []
        self._replica: Replica[Stub] | None = None
        self._request_id: str | None = None
        self._failed = False

    def next(self) -> Replica[Stub] | None:
        """The replica for the next try; None when every one was tried (see `exhausted`)."""
        self._replica = self._picker.acquire(self._chain, exclude=self._tried)
        self._request_id, self._failed = None, False
        return self._replica

    def received(self, request_id: str) -> None:
        if self._request_id is None and self._replica is not None:
            self._request_id = request_id
            self._running[request_id] = self._replica

    def failed(self, error: grpc.RpcError) -> bool:
        """Whether the call goes on to another replica (else the caller raises `error`)."""
        if self._replica is not None:
            self._tried.append(self._replica)
        self._failed = retries_elsewhere(error, received=self._request_id is not None)
        return self._failed and len(self._tried) < MAX_ATTEMPTS

    def done(self) -> None:
        """The try is over: its replica's call is released and, if it did not answer, backed off."""
        if self._replica is not None:
            self._picker.release(self._replica, self._failed)
        if self._request_id is not None:
            self._running.pop(self._request_id, None)

    def exhausted(self) -> Unavailable:
        return Unavailable(f"no replica of {self._picker.target} left to try")
