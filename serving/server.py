"""The gRPC server lifecycle both tiers share: health, reflection, TLS/mTLS, bearer auth, message
sizes, start after warm-up, drain on SIGTERM, stop.

Lifecycle: `start()` binds the port with health NOT_SERVING, starts the engine thread (which runs a
warm-up forward; a failure is re-raised here, so the process exits naming it) and flips health to
SERVING once that forward is done. `drain()` is what SIGTERM triggers: health NOT_SERVING, new calls
refused with UNAVAILABLE, live calls finish within the grace period, then the server and the engine
thread stop.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from base.auth import BearerTokenInterceptor, server_credentials
from base.heap import freeze_startup_objects
from serving.config import ServerConfig
from serving.live_calls import LiveCallRegistry, StallWatchdog
from serving.malformed import MalformedRequestInterceptor

logger = logging.getLogger(__name__)

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


def server_version() -> str:
    """The installed tandem version, as both tiers report it."""
    try:
        return version("tandem-serve")
    except PackageNotFoundError:
        return "unknown"


class EngineRunner(Protocol):
    """The lifecycle of what runs a tier's engine: an `EngineThread`, or the decode tier's engine-core
    process (`decode_service.engine_core.core_client`)."""

    def start(self, warm_up: bool = True) -> None: ...

    def wait_ready(self, timeout: float | None = None) -> bool: ...

    def stop(self, timeout: float | None = 10.0) -> None: ...


class TierServer:
    """One replica's gRPC server around one engine thread and one live-call registry.

    A tier's `__init__` calls `super().__init__`, builds its engine thread and registry, and hands
    its servicer to `_serve`. Hooks: `_start_dependencies` (before the engine thread starts),
    `_close_dependencies` (after it stopped), `_serving_details` (the start log line). Create and use it
    inside a running asyncio loop.
    """

    tier = "tandem"

    engine_loop: EngineRunner
    registry: LiveCallRegistry

    def __init__(
        self,
        model_name: str,
        config: ServerConfig,
        *,
        max_concurrent_streams: int | None = None,
        max_message_bytes: int | None = None,
    ) -> None:
        config.validate()
        self.model_name = model_name
        self.config = config
        self.health = HealthServicer()
        interceptors: list[grpc.aio.ServerInterceptor] = [MalformedRequestInterceptor()]
        if config.auth_token:
            interceptors.insert(0, BearerTokenInterceptor(config.auth_token))
        options: list[tuple[str, int]] = []
        if max_message_bytes is not None:
            options += [
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_receive_message_length", max_message_bytes),
            ]
        if max_concurrent_streams:
            # A hard cap on concurrent streams per connection, so one caller cannot open unbounded calls.
            options.append(("grpc.max_concurrent_streams", max_concurrent_streams))
        self._server = grpc.aio.server(interceptors=interceptors, options=options)
        # Every streaming handler writes through it: a caller that stops reading cannot hold what it holds.
        self.watchdog = StallWatchdog(config.stream_stall_timeout_s, "--stream-stall-timeout")
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self._health_services: tuple[str, ...] = ("",)
        self.port = 0
        self._stopped = False
        # Set by `fail`: a part the server cannot serve without is gone, and why.
        self.failed = asyncio.Event()
        self.failure: str | None = None

    def _serve(self, service_name: str, add_servicer: Callable[[grpc.aio.Server], None]) -> None:
        """Add the tier's servicer; health reports on it, and reflection lists it."""
        add_servicer(self._server)
        self._health_services = ("", service_name)
        reflection.enable_server_reflection(
            (service_name, HEALTH_SERVICE, reflection.SERVICE_NAME), self._server
        )

    async def start(self) -> int:
        """Bind and start serving; returns the bound port (useful with port 0). SERVING after warm-up."""
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{self.config.host}:{self.config.port}"
        tls = self.config.tls
        if tls is None:
            self.port = self._server.add_insecure_port(address)
        else:
            self.port = self._server.add_secure_port(
                address, server_credentials(tls.cert, tls.key, tls.client_ca)
            )
        await self._server.start()
        self.watchdog.start()
        if self.config.auth_token and tls is None:
            logger.warning(
                "a bearer token is configured without TLS: it crosses the network in clear text, where "
                "anyone on the path can read and replay it; add --tls-cert/--tls-key or terminate TLS first"
            )
        await self._start_dependencies()
        self.engine_loop.start(warm_up=self.config.warm_up)
        await asyncio.to_thread(self.engine_loop.wait_ready)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        security = ""
        if tls is not None:
            security += ", mutual TLS" if tls.client_ca is not None else ", TLS"
        if self.config.auth_token:
            security += ", bearer-token auth"
        logger.info(
            "%s server serving %s on %s:%d (%s%s)",
            self.tier,
            self.model_name,
            self.config.host,
            self.port,
            self._serving_details(),
            security,
        )
        return self.port

    async def drain(self, grace_seconds: float | None = None) -> bool:
        """Stop taking calls, let live ones finish (up to the grace period), then stop.

        Returns True when every live call finished on its own within the grace period.
        """
        grace = self.config.drain_grace_seconds if grace_seconds is None else grace_seconds
        logger.info("draining: %d live calls, grace %.1f s", len(self.registry), grace)
        await self.health.enter_graceful_shutdown()
        self.registry.begin_drain()
        finished = await self.registry.wait_empty(grace)
        if not finished:
            logger.warning("drain grace period over; ending %d calls", len(self.registry))
        await self.stop()
        return finished

    async def stop(self) -> None:
        """Stop at once: the engine thread ends every live call, then the port closes."""
        if self._stopped:
            return
        self._stopped = True
        self.registry.begin_drain()
        await asyncio.to_thread(self.engine_loop.stop)
        await self._close_dependencies()
        # Let the final messages of still-live calls reach their callers before the port closes.
        await self.registry.wait_empty(1.0)
        await self._server.stop(grace=1.0)
        await self.watchdog.stop()
        self._closed()
        logger.info("%s server stopped", self.tier)

    def fail(self, reason: str) -> None:
        """A part the server cannot serve without died (the decode engine core's process): NOT_SERVING
        at once; `serve_until_signalled` then stops the server and exits non-zero, so the pod restarts."""
        if self.failed.is_set():
            return
        self.failure = reason
        self.failed.set()
        self.registry.begin_drain()
        asyncio.ensure_future(self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING))

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        for service in self._health_services:
            await self.health.set(service, status)

    # -- what a tier adds ----------------------------------------------------------------------------

    async def _start_dependencies(self) -> None:
        """Before the engine thread starts (e.g. discover the replicas it will call)."""

    async def _close_dependencies(self) -> None:
        """After the engine thread stopped, before the port closes."""

    def _closed(self) -> None:
        """After the port closed: release threads and pools the tier owns."""

    def _serving_details(self) -> str:
        """The tier's part of the 'serving' log line."""
        return ""


async def serve_until_signalled(server: TierServer) -> int:
    """Run `server` until the first SIGTERM or SIGINT, drain it, and return the exit status (0); or
    until it fails (`TierServer.fail`): then stop it and return 1.

    Draining rather than stopping is what lets Kubernetes roll a tier without failing requests:
    health turns NOT_SERVING, new calls get UNAVAILABLE, running ones finish within the grace.
    """
    await server.start()
    freeze_startup_objects()
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if not stop_requested.is_set():
            logger.info("received %s", signal.Signals(signum).name)
            stop_requested.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    stopping = asyncio.ensure_future(stop_requested.wait())
    failing = asyncio.ensure_future(server.failed.wait())
    await asyncio.wait((stopping, failing), return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    failing.cancel()
    if server.failed.is_set():
        logger.error("%s server failed: %s; stopping", server.tier, server.failure)
        await server.stop()
        return 1
    await server.drain()
    return 0
