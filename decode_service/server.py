"""The decode server: the Generation service and its engine loop, on the shared `serving.server` shell.

It adds to the shell the continuous batcher (scheduler, policy, stream interval, metrics), the
OpenAI-compatible HTTP API when `config.http_port` is set (on this loop, over the same `Generations`
as the gRPC service) and, when `config.prefill` names a prefill tier, remote prefill (both started
before the engine thread, closed after it).
"""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CollectorRegistry

from base.errors import ConfigError
from decode_service.config import DecodeServiceConfig
from decode_service.engine_core.engine_loop import EngineLoop
from decode_service.engine_core.policies import make_policy
from decode_service.engine_core.remote_prefill.stage import RemotePrefill
from decode_service.engine_core.scheduler import ContinuousScheduler, StaticScheduler
from decode_service.engine_core.stream_interval import StreamIntervalBuffer
from decode_service.front_door.constraints import Constraints
from decode_service.front_door.generation import Generations
from decode_service.front_door.openai_http.app import OpenAIRoutes
from decode_service.front_door.openai_http.connections import ConnectionLimits
from decode_service.front_door.openai_http.server import HttpServer
from decode_service.front_door.servicer import GenerationServicer
from decode_service.front_door.streams import StreamHub
from decode_service.front_door.validation import use_chat_template
from decode_service.front_door.validation_pool import ValidationPool
from decode_service.metrics import DecodeMetrics
from engine.engine import Engine
from protos.tandem.v1 import generation_pb2, generation_pb2_grpc
from serving.event_log import EventLog
from serving.open_files import open_file_limit
from serving.server import TierServer, serve_until_signalled, server_version

logger = logging.getLogger(__name__)

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
# gRPC's default limit on a received message, applied to HTTP request bodies too.
MAX_HTTP_BODY_BYTES = 4 * 1024 * 1024


class DecodeServer(TierServer):
    """One decode replica: aggregated, or with a prefill tier when `config.prefill` names one (then
    `model_fingerprint` is required, for the compatibility handshake). Create and use it inside a
    running asyncio loop.

    In-process observers (tests, benchmarks) read `events` (per-step batch composition),
    `scheduler`, `registry` (live streams) and `engine_loop`; none of it is exposed over the public API.
    """

    tier = "decode"

    def __init__(
        self,
        engine: Engine,
        config: DecodeServiceConfig,
        *,
        metrics_registry: CollectorRegistry | None = None,
        max_concurrent_streams: int | None = None,
        model_fingerprint: str | None = None,
    ) -> None:
        super().__init__(engine, config, max_concurrent_streams=max_concurrent_streams)
        self.config: DecodeServiceConfig = config
        policy = make_policy(
            config.policy, config.tenant_weights, config.sjf_aging_tokens_per_second, config.max_idle_tenants
        )
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
        # The front door knows the model by its facts alone (it will run where the weights are not).
        facts = engine.facts
        capacity = facts.max_num_seqs + config.max_queue
        self.registry = StreamHub(asyncio.get_running_loop(), capacity, config.max_stream_buffer)
        self.metrics = DecodeMetrics(self.scheduler, engine, metrics_registry)
        if self.remote_prefill is not None:
            self.metrics.watch_prefill_transfer(self.remote_prefill.stats)
        batched = StreamIntervalBuffer(config.stream_interval, self.registry.deliver_threadsafe)
        self.engine_loop = EngineLoop(engine, self.scheduler, self.metrics.observing(batched), self.events)
        self.registry.abort = self.engine_loop.abort
        # A batch's worth of constrained requests may wait for their first compile (then they are warm).
        self._validation = ValidationPool(
            config.max_validation_queue, max(config.max_validation_queue, facts.max_num_seqs)
        )
        if config.chat_template is not None:
            use_chat_template(facts, config.chat_template)
        self.constraints = Constraints.for_model(facts, config)
        if self.constraints.compiler is not None:
            self.metrics.watch_grammar_compiler(self.constraints.compiler)
        self.generations = Generations(
            facts, self.engine_loop, self.registry, config, self._validation, self.constraints
        )
        servicer = GenerationServicer(self.generations, self.watchdog, server_version())
        self._serve(
            GENERATION_SERVICE,
            lambda server: generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server),
        )
        self.http: HttpServer | None = None
        self.http_port: int | None = None
        self._http_serving = False
        if config.http_port is not None:
            routes = OpenAIRoutes(
                self.generations,
                config.served_model_name or facts.model_name,
                config.auth_token,
                MAX_HTTP_BODY_BYTES,
                lambda: self._http_serving,
            )
            limits = ConnectionLimits(
                # Half the descriptors at most: the gRPC port, model files and prefill calls need theirs.
                max_connections=min(config.http_max_connections, open_file_limit() // 2),
                read_timeout=config.http_read_timeout_s,
                stall_timeout=config.stream_stall_timeout_s,
            )
            self.http = HttpServer(routes.app(), config.host, config.http_port, limits, config.tls)

    async def start(self) -> int:
        port = await super().start()
        self._http_serving = True
        return port

    async def drain(self, grace_seconds: float | None = None) -> bool:
        self._http_serving = False
        return await super().drain(grace_seconds)

    async def _start_dependencies(self) -> None:
        if self.http is not None:
            # Bound before warm-up like the gRPC port; /health says 503 until the engine is ready.
            self.http_port = await self.http.start()
            logger.info("OpenAI-compatible HTTP API on %s:%d", self.config.host, self.http_port)
        if self.remote_prefill is not None:
            await self.remote_prefill.start()

    async def _close_dependencies(self) -> None:
        if self.remote_prefill is not None:
            await self.remote_prefill.close()
        if self.http is not None:
            await self.http.stop()

    def _closed(self) -> None:
        self._validation.shutdown()
        self.constraints.close()

    def _serving_details(self) -> str:
        mode = "aggregated"
        if self.remote_prefill is not None:
            # Not "on host:port": scripts read the serving port from the first "on host:port" of this line.
            mode = f"disaggregated, prefill tier at {self.config.prefill}"
        return f"{mode}; {self.config.batching} batching, {self.config.policy} policy"


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
