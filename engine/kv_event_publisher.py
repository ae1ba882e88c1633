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
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque

import msgspec
import zmq

from base.errors import ConfigError
from engine.kv_events import Event, KVEventBatch, KVEventsConfig

logger = logging.getLogger(__name__)

# How long the idle thread waits for a batch before it looks at replay requests (and stopping) again.
POLL_SECONDS = 0.05
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
# One engine per replica: tandem has no data-parallel ranks, so every batch says rank 0.
DATA_PARALLEL_RANK = 0


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, IPv6-any, ipc:// or inproc:// endpoint, connect to any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Publishes event batches as `config` says; `publish` is for one engine thread, counters are read
    anywhere (`num_published`: batches sent, `num_dropped`: batches that never went out)."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self.num_published = 0
        # Single writers each: batches the engine thread found no room for, and the thread failed to send.
        self._num_refused = 0
        self._num_failed = 0
        self._topic = config.topic.encode()
        self._numbers = itertools.count()
        self._queue: queue.Queue[tuple[int, KVEventBatch]] = queue.Queue(config.max_queue_size)
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._context = zmq.Context()
        self._replay: zmq.Socket | None = None
        # Where the sockets are: a bound endpoint with its port resolved (`tcp://127.0.0.1:*` binds a
        # free one), a connected one as given.
        self.endpoint = config.endpoint
        self.replay_endpoint: str | None = None
        try:
            self._pub = self._open(zmq.PUB, config.endpoint, "KV events endpoint", config.hwm)
            if binds(config.endpoint):
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if config.replay_endpoint is not None:
                # Room for one whole replay per subscriber: a ROUTER drops what passes its high-water mark.
                self._replay = self._open(
                    zmq.ROUTER, config.replay_endpoint, "KV events replay endpoint", config.buffer_steps + 1
                )
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except ConfigError:
            self._context.destroy(linger=0)
            raise

    def _open(self, kind: int, endpoint: str, what: str, hwm: int | None = None) -> zmq.Socket:
        """A socket of `kind` bound to `endpoint` (a ROUTER always is, as vLLM's) or connected to it;
        `hwm` is set first, so that it holds for a connection made now."""
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        if hwm is not None:
            socket.set_hwm(hwm)
        try:
            if kind == zmq.ROUTER or binds(endpoint):
                socket.bind(endpoint)
            else:
                socket.connect(endpoint)
        except zmq.ZMQError as exc:
            socket.close(linger=0)
            raise ConfigError(f"{what} {endpoint} is not available: {zmq.strerror(exc.errno)}") from None
        return socket

    @property
    def num_dropped(self) -> int:
        """Batches that never went out: no room on the queue, or the send failed."""
        return self._num_refused + self._num_failed

    def start(self) -> None:
        """Start the sending thread; batches published before it starts wait on the queue."""
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        where = self.endpoint if binds(self.config.endpoint) else f"to {self.endpoint}"
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
