"""The prefill server: gRPC plumbing (Prefill, health, reflection) around one engine loop, and drain.

Lifecycle: `start()` binds the port with health NOT_SERVING, starts the engine thread (which runs a
warm-up forward) and flips health to SERVING once that forward is done. `drain()` is what SIGTERM
triggers: health NOT_SERVING, new calls refused with UNAVAILABLE, in-flight prefills finish within the
grace period (the rest fail with UNAVAILABLE), then the server and the engine thread stop.
"""

from __future__ import annotations

import asyncio
import logging
from importlib.metadata import PackageNotFoundError, version

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from engine.engine import Engine
from engine.errors import ConfigError
from kv_transfer import MAX_MESSAGE_BYTES, KVLayout, compatibility_hash
from prefill_service.config import PrefillServiceConfig
from prefill_service.engine_loop import PrefillEngineLoop
from prefill_service.event_log import EventLog
from prefill_service.kv_sender import KVSender
from prefill_service.metrics import PrefillMetrics
from prefill_service.registry import JobRegistry
from prefill_service.scheduler import ChunkedPrefillScheduler
from prefill_service.servicer import PrefillServicer
from protos.tandem.internal.v1 import prefill_pb2, prefill_pb2_grpc
from tandem.security import server_credentials
from tandem.serving import serve_until_signalled

logger = logging.getLogger(__name__)

PREFILL_SERVICE = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name
HEALTH_SERVICES = ("", PREFILL_SERVICE)

# Room for a KVChunk's fields around its payload, and for long prompts in a PrefillRequest.
MESSAGE_HEADROOM_BYTES = 64 * 1024
MAX_GRPC_MESSAGE_BYTES = MAX_MESSAGE_BYTES + MESSAGE_HEADROOM_BYTES


def server_version() -> str:
    try:
        return version("tandem-serve")
    except PackageNotFoundError:
        return "unknown"


def kv_layout(engine: Engine) -> KVLayout:
    """The layout of the KV this engine computes (and therefore sends)."""
    model = engine.model_config
    return KVLayout(
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        block_size=engine.block_size,
        dtype=engine.dtype,
    )


class PrefillServer:
    """One prefill replica. Create and use it inside a running asyncio loop.

    In-process observers (tests, benchmarks) read `events` (per-step batch composition), `engine`
    (its block pool) and `registry`; none of it is exposed over the API.
    """

    def __init__(
        self,
        engine: Engine,
        model_fingerprint: str,
        config: PrefillServiceConfig,
        *,
        metrics_registry: CollectorRegistry | None = None,
        max_concurrent_streams: int | None = None,
    ) -> None:
        config.validate()
        self.engine = engine
        self.config = config
        self.layout = kv_layout(engine)
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
        self.sender = KVSender(engine.kv_cache, self.layout, engine.device)
        self.metrics = PrefillMetrics(scheduler, engine, metrics_registry)
        self.health = HealthServicer()
        options = [
            ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
        ]
        if max_concurrent_streams:
            # A hard cap on concurrent streams per connection, so one caller cannot open unbounded calls.
            options.append(("grpc.max_concurrent_streams", max_concurrent_streams))
        self._server = grpc.aio.server(options=options)
        prefill_pb2_grpc.add_PrefillServicer_to_server(
            PrefillServicer(engine, self.engine_loop, self.registry, self.sender, self.info, self.metrics),
            self._server,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        health_service = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        reflection.enable_server_reflection(
            (PREFILL_SERVICE, health_service, reflection.SERVICE_NAME), self._server
        )
        self.port = 0
        self._stopped = asyncio.Event()

    @property
    def compatibility_hash(self) -> str:
        return self.info.compatibility_hash

    async def start(self) -> int:
        """Bind and start serving; returns the bound port (useful with port 0). SERVING after warm-up."""
        for service in HEALTH_SERVICES:
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{self.config.host}:{self.config.port}"
        if self.config.tls is None:
            self.port = self._server.add_insecure_port(address)
        else:
            tls = self.config.tls
            self.port = self._server.add_secure_port(
                address, server_credentials(tls.cert, tls.key, tls.client_ca)
            )
        await self._server.start()
        self.engine_loop.start(warm_up=self.config.warm_up)
        await asyncio.to_thread(self.engine_loop.wait_ready)
        for service in HEALTH_SERVICES:
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        logger.info(
            "prefill server serving %s on %s:%d (compatibility %s, %d KV blocks of %d tokens, "
            "%d tokens per step%s)",
            self.engine.model_name,
            self.config.host,
            self.port,
            self.compatibility_hash[:16],
            self.engine.block_manager.allocator.num_blocks,
            self.engine.block_size,
            self.engine.config.max_num_batched_tokens,
            ", TLS" if self.config.tls else "",
        )
        return self.port

    async def drain(self, grace_seconds: float | None = None) -> bool:
        """Stop taking requests, let in-flight ones finish (up to the grace period), then stop.

        Returns True when every in-flight request finished on its own within the grace period.
        """
        grace = self.config.drain_grace_seconds if grace_seconds is None else grace_seconds
        logger.info("draining: %d in-flight prefills, grace %.1f s", len(self.registry), grace)
        await self.health.enter_graceful_shutdown()
        self.registry.begin_drain()
        finished = await self.registry.wait_empty(grace)
        if not finished:
            logger.warning("drain grace period over; failing %d prefills", len(self.registry))
        await self.stop()
        return finished

    async def stop(self) -> None:
        """Stop at once: unfinished prefills fail with UNAVAILABLE, then the port closes and threads exit."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.registry.begin_drain()
        await asyncio.to_thread(self.engine_loop.stop)
        # Let the UNAVAILABLE of unfinished prefills reach their callers before the port closes.
        await self.registry.wait_empty(1.0)
        await self._server.stop(grace=1.0)
        self.sender.close()
        logger.info("prefill server stopped")

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


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
