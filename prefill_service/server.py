"""The prefill server: the Prefill service and its engine loop, on the shared `serving.server` shell.

It adds to the shell the chunked-prefill scheduler, the KV sender and the compatibility handshake
(`PrefillInfo`); gRPC messages are sized for the largest KV message plus headroom.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from base.errors import ConfigError
from engine.engine import Engine
from kv_transfer import MAX_MESSAGE_BYTES, compatibility_hash
from kv_transfer.grpc_method import MAX_GRPC_MESSAGE_BYTES, add_prefill_servicer
from kv_transfer.heap import keep_message_buffers_in_heap
from prefill_service.config import PrefillServiceConfig
from prefill_service.engine_loop import PrefillEngineLoop
from prefill_service.kv_sender import KVSender
from prefill_service.metrics import PrefillMetrics
from prefill_service.registry import JobRegistry
from prefill_service.scheduler import ChunkedPrefillScheduler
from prefill_service.servicer import PrefillServicer
from protos.tandem.internal.v1 import prefill_pb2
from serving.event_log import EventLog
from serving.kv_layout import engine_fingerprint, engine_kv_layout
from serving.server import TierServer, serve_until_signalled, server_version

PREFILL_SERVICE = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name


class PrefillServer(TierServer):
    """One prefill replica. Create and use it inside a running asyncio loop.

    In-process observers (tests, benchmarks) read `events` (per-step batch composition), `engine`
    (its block pool) and `registry`; none of it is exposed over the API.
    """

    tier = "prefill"

    def __init__(
        self,
        engine: Engine,
        model_fingerprint: str,
        config: PrefillServiceConfig,
        *,
        metrics_registry: CollectorRegistry | None = None,
        max_concurrent_streams: int | None = None,
    ) -> None:
        super().__init__(
            engine.model_name,
            config,
            max_concurrent_streams=max_concurrent_streams,
            max_message_bytes=MAX_GRPC_MESSAGE_BYTES,
        )
        self.engine = engine
        self.layout = engine_kv_layout(engine)
        model_fingerprint = engine_fingerprint(engine, model_fingerprint)
        if self.layout.block_bytes() > MAX_MESSAGE_BYTES:
            raise ConfigError(
                f"one KV block of one layer is {self.layout.block_bytes()} bytes, more than a KV message may "
                f"carry ({MAX_MESSAGE_BYTES}); use a smaller --block-size"
            )
        self.info = prefill_pb2.PrefillInfo(
            model_fingerprint=model_fingerprint,
            kv_layout=self.layout.to_proto(),
            compatibility_hash=compatibility_hash(model_fingerprint, self.layout),
            version=server_version(),
        )
        self.events = EventLog(config.event_log_size)
        self.registry = JobRegistry(asyncio.get_running_loop(), config.max_queue)
        scheduler = ChunkedPrefillScheduler(
            engine, engine.config.max_num_batched_tokens, engine.config.max_num_seqs
        )
        self.engine_loop = PrefillEngineLoop(engine, scheduler, self.registry.deliver_threadsafe, self.events)
        # The engine thread's steps publish them; a taken events port fails here, at start.
        engine.start_kv_events(config.kv_events)
        keep_message_buffers_in_heap()
        self.sender = KVSender(engine.kv_cache, self.layout, engine.device)
        self.metrics = PrefillMetrics(scheduler, engine, metrics_registry)
        servicer = PrefillServicer(
            engine, self.engine_loop, self.registry, self.sender, self.info, self.metrics, self.watchdog
        )
        # Registered with the KV framing codec: the servicer yields KV frames already serialized.
        self._serve(PREFILL_SERVICE, lambda server: add_prefill_servicer(servicer, server))

    @property
    def compatibility_hash(self) -> str:
        return self.info.compatibility_hash

    def _closed(self) -> None:
        self.sender.close()
        self.engine.stop_kv_events()

    def _serving_details(self) -> str:
        return (
            f"compatibility {self.compatibility_hash[:16]}, {self.engine.num_blocks} KV blocks of "
            f"{self.engine.block_size} tokens, {self.engine_loop.scheduler.max_num_batched_tokens} tokens "
            "per step"
        )


async def serve(
    engine: Engine,
    model_fingerprint: str,
    config: PrefillServiceConfig,
    *,
    metrics_registry: CollectorRegistry | None = None,
    max_concurrent_streams: int | None = None,
) -> int:
    """Run a prefill server until SIGTERM or SIGINT, then drain; returns the process exit status."""
    server = PrefillServer(
        engine,
        model_fingerprint,
        config,
        metrics_registry=metrics_registry,
        max_concurrent_streams=max_concurrent_streams,
    )
    return await serve_until_signalled(server)
