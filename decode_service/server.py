"""The decode server: gRPC plumbing (Generation, health, reflection) around one engine loop, and drain.

Lifecycle: `start()` binds the port with health NOT_SERVING, starts the engine thread (which runs a
warm-up forward) and flips health to SERVING once that forward is done. `drain()` is what SIGTERM
triggers: health NOT_SERVING, new calls refused with UNAVAILABLE, running requests finish within the
grace period (the rest are aborted), then the server and the engine thread stop.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from decode_service.config import DecodeServiceConfig
from decode_service.engine_loop import EngineLoop
from decode_service.event_log import EventLog
from decode_service.metrics import DecodeMetrics
from decode_service.policies import make_policy
from decode_service.remote_prefill import RemotePrefill
from decode_service.scheduler import ContinuousScheduler, StaticScheduler
from decode_service.servicer import GenerationServicer
from decode_service.stream_interval import StreamIntervalBuffer
from decode_service.streams import StreamHub
from engine.engine import Engine
from engine.errors import ConfigError
from protos.tandem.v1 import generation_pb2, generation_pb2_grpc
from tandem.security import BearerTokenInterceptor, server_credentials
from tandem.serving import serve_until_signalled

logger = logging.getLogger(__name__)

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
HEALTH_SERVICES = ("", GENERATION_SERVICE)


def server_version() -> str:
    try:
        return version("tandem-serve")
    except PackageNotFoundError:
        return "unknown"


class DecodeServer:
    """One decode replica: aggregated, or with a prefill tier when `config.prefill` names one (then
    `model_fingerprint` is required, for the compatibility handshake). Create and use it inside a
    running asyncio loop.

    In-process observers (tests, benchmarks) read `events` (per-step batch composition),
    `scheduler` and `engine_loop`; none of it is exposed over the public API.
    """

    def __init__(
        self,
        engine: Engine,
        config: DecodeServiceConfig,
        *,
        metrics_registry: CollectorRegistry | None = None,
        max_concurrent_streams: int | None = None,
        model_fingerprint: str | None = None,
    ) -> None:
        config.validate()
        self.engine = engine
        self.config = config
        policy = make_policy(config.policy, config.tenant_weights, config.sjf_aging_tokens_per_second)
        scheduler_type = StaticScheduler if config.batching == "static" else ContinuousScheduler
        # Disaggregated: the prefill tier's KV must match ours, and the model fingerprint is half of that.
        self.remote_prefill: RemotePrefill | None = None
        if config.disaggregated:
            if model_fingerprint is None:
                raise ConfigError("disaggregated prefill needs the model fingerprint to check replicas")
            self.remote_prefill = RemotePrefill(engine, config, model_fingerprint)
        stage = self.remote_prefill.stage if self.remote_prefill is not None else None
        self.scheduler = scheduler_type(engine, policy, config, prefill_stage=stage)
        self.events = EventLog(config.event_log_size)
        capacity = engine.config.max_num_seqs + config.max_queue
        self.hub = StreamHub(asyncio.get_running_loop(), capacity)
        self.metrics = DecodeMetrics(self.scheduler, engine, metrics_registry)
        if self.remote_prefill is not None:
            self.metrics.watch_prefill_transfer(self.remote_prefill.stats)
        batched = StreamIntervalBuffer(config.stream_interval, self.hub.deliver_threadsafe)
        deliver = self.metrics.observing(batched)
        self.engine_loop = EngineLoop(engine, self.scheduler, deliver, self.events)
        self._validation_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="validate")
        self.health = HealthServicer()
        interceptors = [BearerTokenInterceptor(config.auth_token)] if config.auth_token else []
        # A hard cap on concurrent streams per connection, so one client cannot open unbounded calls.
        options = [("grpc.max_concurrent_streams", max_concurrent_streams)] if max_concurrent_streams else []
        self._server = grpc.aio.server(interceptors=interceptors, options=options)
        generation_pb2_grpc.add_GenerationServicer_to_server(
            GenerationServicer(
                engine, self.engine_loop, self.hub, config, self._validation_executor, server_version()
            ),
            self._server,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        health_service = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        reflection.enable_server_reflection(
            (GENERATION_SERVICE, health_service, reflection.SERVICE_NAME), self._server
        )
        self.port = 0
        self._stopped = asyncio.Event()

    async def start(self) -> int:
        """Bind and start serving; returns the bound port (useful with port 0). SERVING after warm-up."""
        for service in HEALTH_SERVICES:
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{self.config.host}:{self.config.port}"
        if self.config.tls_cert is not None and self.config.tls_key is not None:
            credentials = server_credentials(self.config.tls_cert, self.config.tls_key)
            self.port = self._server.add_secure_port(address, credentials)
        else:
            self.port = self._server.add_insecure_port(address)
        await self._server.start()
        if self.remote_prefill is not None:
            await self.remote_prefill.start()
        self.engine_loop.start(warm_up=self.config.warm_up)
        await asyncio.to_thread(self.engine_loop.wait_ready)
        for service in HEALTH_SERVICES:
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        mode = "aggregated"
        if self.remote_prefill is not None:
            # Not "on host:port": scripts read the serving port from the first "on host:port" of this line.
            mode = f"disaggregated, prefill tier at {self.config.prefill}"
        logger.info(
            "decode server serving %s on %s:%d (%s; %s batching, %s policy%s%s)",
            self.engine.model_name,
            self.config.host,
            self.port,
            mode,
            self.config.batching,
            self.config.policy,
            ", TLS" if self.config.tls_cert else "",
            ", bearer-token auth" if self.config.auth_token else "",
        )
        return self.port

    async def drain(self, grace_seconds: float | None = None) -> bool:
        """Stop taking requests, let live ones finish (up to the grace period), then stop.

        Returns True when every live request finished on its own within the grace period.
        """
        grace = self.config.drain_grace_seconds if grace_seconds is None else grace_seconds
        logger.info("draining: %d live requests, grace %.1f s", len(self.hub), grace)
        await self.health.enter_graceful_shutdown()
        self.hub.begin_drain()
        finished = await self.hub.wait_empty(grace)
        if not finished:
            logger.warning("drain grace period over; aborting %d requests", len(self.hub))
        await self.stop()
        return finished

    async def stop(self) -> None:
        """Stop at once: live streams end with ABORT, then the port closes and the engine thread exits."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.hub.begin_drain()
        await asyncio.to_thread(self.engine_loop.stop)
        if self.remote_prefill is not None:
            await self.remote_prefill.close()
        # Let the ABORT messages of still-live streams reach their clients before the port closes.
        await self.hub.wait_empty(1.0)
        await self._server.stop(grace=1.0)
        self._validation_executor.shutdown(wait=False, cancel_futures=True)
        logger.info("decode server stopped")

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


async def serve(
    engine: Engine,
    config: DecodeServiceConfig,
    *,
    metrics_registry: CollectorRegistry | None = None,
    max_concurrent_streams: int | None = None,
    model_fingerprint: str | None = None,
) -> int:
    """Run a decode server until SIGTERM or SIGINT, then drain; returns the process exit status."""
    server = DecodeServer(
        engine,
        config,
        metrics_registry=metrics_registry,
        max_concurrent_streams=max_concurrent_streams,
        model_fingerprint=model_fingerprint,
    )
    return await serve_until_signalled(server)
