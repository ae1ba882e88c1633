"""The prefill replicas a decode replica may call: discovery, compatibility handshake, health, choice.

Every replica gets a `GetInfo` handshake before it is used, and again after it failed: one whose
compatibility hash differs from ours (another model, dtype, block size or KV wire format) is refused
with an error log, because its KV would decode to garbage that looks like an answer. A replica that
fails a call is put in backoff (exponential, capped) and handshaken again when it ends, so a restarted
pod comes back by itself and a dead one costs one failed call per backoff period, not one per request.

Calls go to the ready replica with the fewest calls in flight (ties: the least recently chosen), which
spreads a burst evenly and steers away from a replica that is slow to finish its streams. A call with
an affinity key (the prefix-cache hash of its prompt's first blocks) goes instead to the key's home
replica by rendezvous hashing (highest SHA-256 of key + address), so prompts sharing a prefix meet the
prefill replica whose cache holds it, and a replica joining or leaving moves only its share of keys;
unless the home has more than `AFFINITY_LOAD_FACTOR` x the least-loaded replica's calls in flight plus
`AFFINITY_LOAD_SLACK`, in which case load wins (a hot prefix must not pile up on one replica).

Everything here runs on the decode server's asyncio loop, except `has_ready`, which the engine thread
reads as a hint (a stale answer only changes where one request is prefilled, never its result).
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import grpc

from decode_service.engine_core.remote_prefill.targets import PrefillTarget, resolve_target
from kv_transfer import KVLayout, compatibility_hash
from kv_transfer.errors import KVLayoutMismatchError
from kv_transfer.grpc_method import CLIENT_CHANNEL_OPTIONS, PrefillStub
from protos.tandem.internal.v1 import prefill_pb2

logger = logging.getLogger(__name__)

AFFINITY_LOAD_FACTOR = 2
AFFINITY_LOAD_SLACK = 2
HANDSHAKE_TIMEOUT_S = 5.0


class ReplicaState(enum.Enum):
    """CHECKING: not handshaken yet. READY: compatible and healthy. BACKOFF: failed; handshaken again
    at `retry_at`. INCOMPATIBLE: refused; checked again at `retry_at` (it may be redeployed)."""

    CHECKING = "checking"
    READY = "ready"
    BACKOFF = "backoff"
    INCOMPATIBLE = "incompatible"


@dataclass(eq=False)
class PrefillReplica:
    """One prefill server: its channel, and what decode knows about its health and load."""

    address: str
    channel: grpc.aio.Channel
    stub: PrefillStub
    state: ReplicaState = ReplicaState.CHECKING
    in_flight: int = 0
    consecutive_failures: int = 0
    retry_at: float = 0.0
    reason: str = ""
    last_chosen: int = -1
    retired: bool = False
    # What this replica delivered, for logs and tests (totals over its lifetime in this pool).
    kv_bytes_received: int = 0
    prefills_completed: int = 0
    info: prefill_pb2.PrefillInfo | None = field(default=None, repr=False)


@dataclass(frozen=True)
class BackoffPolicy:
    """Seconds a failed replica sits out: base * 2**(failures - 1), at most `max_s`."""

    base_s: float = 0.5
    max_s: float = 30.0

    def delay(self, consecutive_failures: int) -> float:
        return min(self.max_s, self.base_s * 2 ** max(0, consecutive_failures - 1))


def describe_incompatibility(
    info: prefill_pb2.PrefillInfo, own_fingerprint: str, own_layout: KVLayout
) -> str:
    """What differs between a replica's PrefillInfo and ours, in words an operator can act on."""
    differences = []
    if info.model_fingerprint != own_fingerprint:
        differences.append(f"model fingerprint {info.model_fingerprint!r} != ours {own_fingerprint!r}")
    try:
        layout = KVLayout.from_proto(info.kv_layout)
    except KVLayoutMismatchError as exc:
        differences.append(f"unusable KV layout ({exc})")
    else:
        differences.extend(layout.differences(own_layout))
    if not differences:
        differences.append("KV wire format version differs")
    return "; ".join(differences)


class PrefillPool:
    """The replicas behind `--prefill`, kept fresh by a background task started with `start()`."""

    def __init__(
        self,
        targets: Iterable[PrefillTarget],
        model_fingerprint: str,
        layout: KVLayout,
        credentials: grpc.ChannelCredentials | None = None,
        resolve_interval_s: float = 30.0,
        backoff: BackoffPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.targets = tuple(targets)
        self.model_fingerprint = model_fingerprint
        self.layout = layout
        self.compatibility_hash = compatibility_hash(model_fingerprint, layout)
        self.backoff = backoff or BackoffPolicy()
        self.resolve_interval_s = resolve_interval_s
        self._credentials = credentials
        self._clock = clock
        self._replicas: dict[str, PrefillReplica] = {}
        self._by_target: dict[PrefillTarget, set[str]] = {target: set() for target in self.targets}
        self._next_resolve = 0.0
        self._choices = itertools.count()
        self._task: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self.has_ready = False

    # -- lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Resolve the targets and handshake every replica once, then keep doing so in the background."""
        await self.refresh()
        ready = sum(r.state is ReplicaState.READY for r in self._replicas.values())
        if ready == 0:
            logger.warning("no prefill replica is ready at start-up: %s", self.describe())
        else:
            logger.info("%d of %d prefill replicas ready", ready, len(self._replicas))
        self._task = asyncio.create_task(self._maintain(), name="prefill-pool")

    async def close(self) -> None:
        """Stop the background task and close every channel (calls still open on them are cancelled)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*(r.channel.close() for r in self._replicas.values()), *self._closing)
        self._replicas.clear()

    async def _maintain(self) -> None:
        tick = min(1.0, self.backoff.base_s)
        while True:
            await asyncio.sleep(tick)
            try:
                await self.refresh()
            except Exception:
                logger.exception("refreshing the prefill replicas failed")

    async def refresh(self) -> None:
        """Re-resolve the targets when due, then handshake every replica that is due for one."""
        now = self._clock()
        if now >= self._next_resolve:
            self._next_resolve = now + self.resolve_interval_s
            await self._resolve_all()
        waiting = (ReplicaState.BACKOFF, ReplicaState.INCOMPATIBLE)
        due = [
            replica
            for replica in self._replicas.values()
            if replica.state is ReplicaState.CHECKING
            or (replica.state in waiting and now >= replica.retry_at)
        ]
        if due:
            await asyncio.gather(*(self._handshake(replica) for replica in due))
        self._update_has_ready()

    # -- discovery -----------------------------------------------------------------------------------

    async def _resolve_all(self) -> None:
        for target in self.targets:
            try:
                addresses = set(await resolve_target(target))
            except OSError as exc:
                logger.warning(
                    "cannot resolve prefill target %s (%s); keeping its last addresses", target, exc
                )
                continue
            known = self._by_target[target]
            for address in sorted(addresses - known):
                if address not in self._replicas:
                    self._replicas[address] = self._new_replica(target, address)
                    logger.info("prefill replica %s appeared (target %s)", address, target)
            for address in sorted(known - addresses):
                self._retire(address)
                logger.info("prefill replica %s is gone from target %s", address, target)
            self._by_target[target] = addresses

    def _new_replica(self, target: PrefillTarget, address: str) -> PrefillReplica:
        options: list[tuple[str, int | str]] = [
            *CLIENT_CHANNEL_OPTIONS,
            # Come back quickly after a prefill pod restarts; our own backoff spaces the attempts.
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", int(self.backoff.max_s * 1000)),
        ]
        if self._credentials is None:
            channel = grpc.aio.insecure_channel(address, options=options)
        else:
            if target.resolve:
                # We dial the pod's address, but its certificate names the Service.
                options.append(("grpc.ssl_target_name_override", target.host))
            channel = grpc.aio.secure_channel(address, self._credentials, options=options)
        return PrefillReplica(address, channel, PrefillStub(channel))

    def _retire(self, address: str) -> None:
        replica = self._replicas.pop(address, None)
        if replica is None:
            return
        replica.retired = True
        if replica.in_flight == 0:
            self._close_later(replica)

    def _close_later(self, replica: PrefillReplica) -> None:
        task = asyncio.get_running_loop().create_task(replica.channel.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    # -- health --------------------------------------------------------------------------------------

    async def _handshake(self, replica: PrefillReplica) -> None:
        try:
            info = await replica.stub.GetInfo(prefill_pb2.GetInfoRequest(), timeout=HANDSHAKE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            self._back_off(replica, f"GetInfo failed: {exc.code().name}: {exc.details()}")
            return
        replica.info = info
        if info.compatibility_hash != self.compatibility_hash:
            differences = describe_incompatibility(info, self.model_fingerprint, self.layout)
            self.report_incompatible(
                replica,
                f"compatibility hash {info.compatibility_hash[:16]}... differs from ours "
                f"{self.compatibility_hash[:16]}... ({differences})",
            )
            return
        if replica.state is not ReplicaState.READY:
            logger.info(
                "prefill replica %s is ready (version %s)", replica.address, info.version or "unknown"
            )
        replica.state, replica.reason = ReplicaState.READY, ""

    def _back_off(self, replica: PrefillReplica, reason: str) -> None:
        replica.consecutive_failures += 1
        delay = self.backoff.delay(replica.consecutive_failures)
        replica.state, replica.reason = ReplicaState.BACKOFF, reason
        replica.retry_at = self._clock() + delay
        logger.warning(
            "prefill replica %s failed (%s); not used for %.1f s (failure %d in a row)",
            replica.address,
            reason,
            delay,
            replica.consecutive_failures,
        )
        self._update_has_ready()

    def report_failure(self, replica: PrefillReplica, reason: str) -> None:
        """A call to the replica failed in a way another replica may not: back off from it.

        Only a ready replica's first failure counts: when a replica dies, every call in flight on it
        fails at once, and that is one failure, not one per call.
        """
        if replica.state is ReplicaState.READY:
            self._back_off(replica, reason)

    def report_slow(self, replica: PrefillReplica, reason: str) -> None:
        """A call to the replica timed out: slow (overloaded), not necessarily dead.

        Backing off from the only ready replica would turn one slow prompt into UNAVAILABLE for every
        request until the backoff ends, so slowness ejects a replica only when another is ready to
        take its calls; a dead one shows up as UNAVAILABLE (and in the handshake) all the same.
        """
        others = any(r is not replica and r.state is ReplicaState.READY for r in self._replicas.values())
        if others:
            self.report_failure(replica, reason)
        else:
            logger.warning(
                "prefill replica %s is slow (%s); kept: it is the only ready one", replica.address, reason
            )

    def report_success(self, replica: PrefillReplica) -> None:
        """The replica delivered a whole prefill: its failure streak ends."""
        replica.consecutive_failures = 0
        replica.prefills_completed += 1

    def report_kv_received(self, replica: PrefillReplica, num_bytes: int) -> None:
        replica.kv_bytes_received += num_bytes

    def report_incompatible(self, replica: PrefillReplica, reason: str) -> None:
        """Refuse a replica whose KV would not fit ours; it is checked again after the longest backoff."""
        if replica.state is not ReplicaState.INCOMPATIBLE or replica.reason != reason:
            logger.error(
                "refusing prefill replica %s: %s. No request is sent to it; fix the deployment so both "
                "tiers run the same model, dtype and block size",
                replica.address,
                reason,
            )
        replica.state, replica.reason = ReplicaState.INCOMPATIBLE, f"incompatible: {reason}"
        replica.retry_at = self._clock() + self.backoff.max_s
        self._update_has_ready()

    def _update_has_ready(self) -> None:
        self.has_ready = any(r.state is ReplicaState.READY for r in self._replicas.values())

    # -- choice --------------------------------------------------------------------------------------

    @property
    def replicas(self) -> list[PrefillReplica]:
        return list(self._replicas.values())

    def acquire(self, exclude: Iterable[PrefillReplica] = (), affinity: bytes = b"") -> PrefillReplica | None:
        """A ready replica not in `exclude`, counted as one more call in flight: the home of `affinity`
        unless it is loaded beyond the bound, else the one with the fewest calls in flight."""
        excluded = set(map(id, exclude))
        candidates = [
            r for r in self._replicas.values() if r.state is ReplicaState.READY and id(r) not in excluded
        ]
        if not candidates:
            return None
        replica = min(candidates, key=lambda r: (r.in_flight, r.last_chosen))
        if affinity:
            home = max(candidates, key=lambda r: hashlib.sha256(affinity + r.address.encode()).digest())
            if home.in_flight <= AFFINITY_LOAD_FACTOR * replica.in_flight + AFFINITY_LOAD_SLACK:
                replica = home
        replica.in_flight += 1
        replica.last_chosen = next(self._choices)
        return replica

    def release(self, replica: PrefillReplica) -> None:
        """The call `acquire` counted is over."""
        replica.in_flight -= 1
        if replica.retired and replica.in_flight == 0:
            self._close_later(replica)

    def describe(self) -> str:
        """Each replica's state and why, for error messages and logs."""
        if not self._replicas:
            return "no prefill replica was found (targets: " + ", ".join(map(str, self.targets)) + ")"
        now = self._clock()
        parts = []
        for replica in self._replicas.values():
            text = f"{replica.address} {replica.state.value}"
            if replica.reason:
                text += f" ({replica.reason})"
            if replica.state is ReplicaState.BACKOFF:
                text += f", retried in {max(0.0, replica.retry_at - now):.1f} s"
            parts.append(text)
        return "; ".join(parts)
