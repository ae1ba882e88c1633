"""The ZMQ side of KV events (`engine.kv_events` has the wire format): a publisher that never holds up
the engine.

The engine thread hands each step's events to `publish`, which numbers the batch and puts it on a
bounded queue without waiting; when the queue is full the batch is dropped and counted (its number is
then missing from the stream, so subscribers see the gap). A daemon thread encodes the batches, sends
them on the PUB socket and keeps the last `buffer_steps` for replay, which it serves between batches.
A PUB socket drops rather than waits for a subscriber whose high-water mark is reached, so a subscriber
that stops reading slows nothing but itself.

The sockets are opened (bound or connected) in the constructor, so a taken port or a bad endpoint fails
at start with a ConfigError; after `start` only the thread touches them (ZMQ sockets are not
thread-safe; starting a thread is the memory barrier that hands them over).

Bind or connect: the replay ROUTER is always bound, as vLLM's. vLLM binds the PUB socket only for a
`*` or `::` host, ipc:// or inproc:// and connects to any other, so an operator could not make it
listen on one interface. Here a TCP endpoint is bound whenever its address is this machine's (the bind
is tried), and connected only when it is not, which keeps vLLM's layout where the subscriber binds and
each replica connects to it (llm-d's indexer behind a Service name).

Both sockets receive from whoever reaches them (subscriptions on PUB, replay requests on ROUTER), and a
peer may announce any frame size: ZMQ would allocate it and fill it with what the peer sends. Every
socket therefore caps inbound messages (ZMQ_MAXMSGSIZE) to what a subscription or a replay request
can be, and ZMQ drops the connection of a peer that announces more.
"""

from __future__ import annotations

import errno
import itertools
import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from base.errors import ConfigError
from engine import kv_event_endpoints
from engine.kv_events import Event, KVEventBatch, KVEventsConfig

logger = logging.getLogger(__name__)

# How long the idle thread waits for a batch before it looks at replay requests (and stopping) again.
POLL_SECONDS = 0.05
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
# One engine per replica: tandem has no data-parallel ranks, so every batch says rank 0.
DATA_PARALLEL_RANK = 0
# Room for ZMTP's own commands and a CURVE box around the largest message a peer has reason to send: a
# subscription (one byte and a topic prefix; one longer than the topic matches nothing) or a replay
# request (8 bytes).
INBOUND_OVERHEAD_BYTES = 4096
# What a failed bind says when the TCP address is not this machine's: connect to it instead.
NOT_LOCAL = (errno.EADDRNOTAVAIL, errno.ENODEV)


def max_inbound_bytes(topic: bytes) -> int:
    """The ZMQ_MAXMSGSIZE of every socket: the longest useful subscription, with room for the protocol."""
    return INBOUND_OVERHEAD_BYTES + len(topic)


class KVEventPublisher:
    """Publishes event batches as `config` says; `publish` is for one engine thread, counters are read
    anywhere (`num_published`: batches sent, `num_dropped`: batches that never went out)."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self.num_published = 0
        # Single writers each: batches the engine thread found no room for, and the thread failed to send.
        self._num_refused = 0
        self._num_failed = 0
        config.validate()
        self._topic = config.topic.encode()
        self.max_inbound_bytes = max_inbound_bytes(self._topic)
        self._numbers = itertools.count()
        self._queue: queue.Queue[tuple[int, KVEventBatch]] = queue.Queue(config.max_queue_size)
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._context = zmq.Context()
        self._replay: zmq.Socket | None = None
        # Where the sockets are: a bound endpoint with its port resolved (`tcp://127.0.0.1:*` binds a
        # free one), a connected one as given; `bound` says which the PUB socket is.
        self.endpoint = config.endpoint
        self.bound = True
        self.replay_endpoint: str | None = None
        try:
            self._pub = self._socket(zmq.PUB, config.endpoint, config.hwm)
            self.bound = self._bind_or_connect(self._pub, config.endpoint, "KV events endpoint")
            if self.bound:
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if config.replay_endpoint is not None:
                # Room for one whole replay per subscriber: a ROUTER drops what passes its high-water mark.
                self._replay = self._socket(zmq.ROUTER, config.replay_endpoint, config.buffer_steps + 1)
                self._bind(self._replay, config.replay_endpoint, "KV events replay endpoint")
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except ConfigError:
            self._context.destroy(linger=0)
            raise

    def _socket(self, kind: int, endpoint: str, hwm: int) -> zmq.Socket:
        """A socket of `kind` for `endpoint`, its options set before any connection exists so that they
        hold for every one: no linger, `hwm`, the inbound cap, IPv6 for an IPv6 address."""
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        socket.set_hwm(hwm)
        socket.setsockopt(zmq.MAXMSGSIZE, self.max_inbound_bytes)
        if kv_event_endpoints.is_ipv6(endpoint):
            socket.setsockopt(zmq.IPV6, 1)
        return socket

    def _bind_or_connect(self, socket: zmq.Socket, endpoint: str, what: str) -> bool:
        """Bind `socket` to `endpoint` (True), or connect it there when that is a TCP address of another
        machine, which a bind cannot take (False): vLLM's publisher that connects to its subscriber."""
        if kv_event_endpoints.split_tcp(endpoint) is None or kv_event_endpoints.is_wildcard(endpoint):
            self._bind(socket, endpoint, what)
            return True
        try:
            socket.bind(endpoint)
        except zmq.ZMQError as exc:
            if exc.errno not in NOT_LOCAL:
                self._refuse(socket, endpoint, what, exc)
        else:
            return True
        try:
            socket.connect(endpoint)
        except zmq.ZMQError as exc:
            self._refuse(socket, endpoint, what, exc)
        return False

    def _bind(self, socket: zmq.Socket, endpoint: str, what: str) -> None:
        try:
            socket.bind(endpoint)
        except zmq.ZMQError as exc:
            self._refuse(socket, endpoint, what, exc)

    @staticmethod
    def _refuse(socket: zmq.Socket, endpoint: str, what: str, exc: zmq.ZMQError) -> None:
        """Close `socket` and raise the ConfigError that names `endpoint` and why it could not be opened."""
        socket.close(linger=0)
        raise ConfigError(f"{what} {endpoint} is not available: {zmq.strerror(exc.errno)}") from None

    @property
    def num_dropped(self) -> int:
        """Batches that never went out: no room on the queue, or the send failed."""
        return self._num_refused + self._num_failed

    def start(self) -> None:
        """Start the sending thread; batches published before it starts wait on the queue."""
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        where = self.endpoint if self.bound else f"to {self.endpoint} (connected: not this machine's address)"
        replay = f", replay on {self.replay_endpoint}" if self.replay_endpoint is not None else ""
        logger.info("publishing KV events on %s%s", where, replay)

    def publish(self, events: list[Event]) -> None:
        """Queue one step's events as the next batch; never waits: a full queue drops the batch."""
        number = next(self._numbers)
        try:
            self._queue.put_nowait((number, KVEventBatch(time.time(), events, DATA_PARALLEL_RANK)))
        except queue.Full:
            self._num_refused += 1
            if self._num_refused == 1:
                logger.warning(
                    "KV events queue full (%d batches): dropping batches, counted in "
                    "tandem:kv_events_dropped_total; subscribers see the gaps",
                    self.config.max_queue_size,
                )

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then close the sockets (linger 0); a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        if self._thread is None:
            self._close_sockets()
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the KV events thread did not stop within %s s", timeout)

    # -- the sending thread --------------------------------------------------------------------------

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        try:
            while True:
                self._serve_replays()
                try:
                    number, batch = self._queue.get(timeout=POLL_SECONDS)
                except queue.Empty:
                    if self._stopping.is_set():
                        return
                    continue
                try:
                    payload = encoder.encode(batch)
                    self._pub.send_multipart((self._topic, number.to_bytes(8, "big"), payload))
                except Exception:
                    logger.exception("sending KV events batch %d failed", number)
                    self._num_failed += 1
                    continue
                self._kept.append((number, payload))
                self.num_published += 1
        finally:
            self._close_sockets()

    def _serve_replays(self) -> None:
        """Answer every waiting replay request with the kept batches from its start number on."""
        replay = self._replay
        while replay is not None and replay.poll(0):
            frames = replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("ignored a malformed KV events replay request (%d frames)", len(frames))
                continue
            identity, _, start = frames
            first = int.from_bytes(start, "big")
            for number, payload in self._kept:
                if number >= first:
                    replay.send_multipart((identity, b"", number.to_bytes(8, "big"), payload))
            replay.send_multipart((identity, b"", END_OF_REPLAY, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()
