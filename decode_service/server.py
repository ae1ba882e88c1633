"""The decode server: the front door (gRPC and HTTP APIs, streams) over an engine core, on the shared
`serving.server` shell.

The engine core (scheduler, engine loop, remote prefill; `decode_service.engine_core`) runs in a
process of its own when the server is given a `CoreSpec` (what `tandem serve decode` does), or on a
thread of this process when given an `Engine` (tests, in-process benchmarks, `--engine-in-process`).
Either way the front door sees the same interface and the same deltas; the OpenAI-compatible HTTP API
runs when `config.http_port` is set (on this loop, over the same `Generations` as the gRPC service).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from prometheus_client import CollectorRegistry

from base.errors import ConfigError
from decode_service.config import DecodeServiceConfig
from decode_service.engine_core.config import CoreSpec
from decode_service.engine_core.core import EngineCore
from decode_service.engine_core.core_client import CoreProcess, lost_failure
from decode_service.engine_core.in_process import InProcessCore
from decode_service.engine_core.messages import StepOut
from decode_service.engine_core.remote_prefill.stage import RemotePrefill
from decode_service.engine_core.scheduler import ContinuousScheduler
from decode_service.engine_core.step_record import StepRecord
from decode_service.front_door.constraints import Constraints
from decode_service.front_door.generation import Generations
from decode_service.front_door.openai_http.app import OpenAIRoutes
from decode_service.front_door.openai_http.connections import ConnectionLimits
from decode_service.front_door.openai_http.response_store import ResponseStore
from decode_service.front_door.openai_http.server import HttpServer
from decode_service.front_door.servicer import GenerationServicer
from decode_service.front_door.streams import StreamHub, StreamIntervalBuffer
from decode_service.front_door.validation import ValidationPool, use_chat_template
from decode_service.metrics import DecodeMetrics, ServedCache
from engine.engine import Engine
from engine.model_facts import ModelFacts
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

    With an in-process core, observers (tests, benchmarks) read `events` (per-step batch composition),
    `scheduler` and `engine_loop`; with a core process they are None, apart from `engine_loop` (the
    process's handle). `registry` holds the live streams. None of it is exposed over the public API.
    """

    tier = "decode"

    def __init__(
        self,
        engine: Engine | CoreSpec,
        config: DecodeServiceConfig,
        *,
        metrics_registry: CollectorRegistry | None = None,
        max_concurrent_streams: int | None = None,
        model_fingerprint: str | None = None,
    ) -> None:
        if config.disaggregated and model_fingerprint is None:
            raise ConfigError("disaggregated prefill needs the model fingerprint to check replicas")
        if isinstance(engine, Engine):
            model = engine.facts
        else:
            model = ModelFacts.load(engine.model_dir, engine.engine_config)
        super().__init__(model.model_name, config, max_concurrent_streams=max_concurrent_streams)
        self.config: DecodeServiceConfig = config
        # The in-process engine (tests and benchmarks read its cache); None with a core process.
        self.engine = engine if isinstance(engine, Engine) else None
        capacity = model.max_num_seqs + config.max_queue
        self.registry = StreamHub(asyncio.get_running_loop(), capacity, config.max_stream_buffer)
        served = ServedCache(config.served_model_name or model.model_name, model.block_size, model.num_blocks)
        self.metrics = DecodeMetrics(lambda: self.engine_loop.stats, metrics_registry, cache=served)
        self._batched = StreamIntervalBuffer(config.stream_interval, self.registry.deliver)

        self.core: EngineCore | None = None
        self.scheduler: ContinuousScheduler | None = None
        self.events: EventLog[StepRecord] | None = None
        self.remote_prefill: RemotePrefill | None = None
        self.engine_loop: InProcessCore | CoreProcess
        if isinstance(engine, Engine):
            self.engine_loop = InProcessCore(engine, config.core, self._on_step, model_fingerprint)
            self.core = self.engine_loop.core
            self.scheduler, self.events = self.core.scheduler, self.core.events
            self.remote_prefill = self.core.remote_prefill
        else:
            self.engine_loop = CoreProcess(
                replace(engine, model_fingerprint=model_fingerprint), self._on_step, self._core_lost
            )
        self.registry.abort = self.engine_loop.abort
        self._validation = ValidationPool(
            config.max_validation_queue, max(config.max_validation_queue, model.max_num_seqs)
        )
        if config.chat_template is not None:
            use_chat_template(model, config.chat_template)
        self.constraints = Constraints.for_model(model, config.reasoning_parser)
        self.generations = Generations(
            model, self.engine_loop, self.registry, config.front_door, self._validation, self.constraints
        )
        servicer = GenerationServicer(self.generations, self.watchdog, server_version(), config.disaggregated)
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
                config.served_model_name or model.model_name,
                config.auth_token,
                MAX_HTTP_BODY_BYTES,
                lambda: self._http_serving,
                self.metrics.registry,
                ResponseStore(config.responses_store_bytes, config.responses_store_ttl_s)
                if config.enable_responses_store
                else None,
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

    def fail(self, reason: str) -> None:
        self._http_serving = False
        super().fail(reason)

    def _on_step(self, step: StepOut) -> None:
        """One engine step's output, on the event loop: metrics, then the streams."""
        for seconds in step.grammar_fill_seconds:
            self.metrics.structured_output_fill_seconds.observe(seconds)
        for seconds in step.grammar_compile_seconds:
            self.metrics.structured_output_compile_seconds.observe(seconds)
        self.metrics.observe(step.deltas, self.registry.request_of)
        self._batched(step.deltas)

    def _core_lost(self, reason: str) -> None:
        """The engine core process died or went silent: every live request ends, and the server exits."""
        self.registry.fail_all(lost_failure(reason))
        self.fail(reason)

    async def _start_dependencies(self) -> None:
        if self.http is not None:
            # Bound before warm-up like the gRPC port; /health says 503 until the engine is ready.
            self.http_port = await self.http.start()
            logger.info("OpenAI-compatible HTTP API on %s:%d", self.config.host, self.http_port)
        if self.core is not None:
            await self.core.start_dependencies()

    async def _close_dependencies(self) -> None:
        if self.core is not None:
            await self.core.close_dependencies()
        if self.http is not None:
            await self.http.stop()

    def _closed(self) -> None:
        self._validation.shutdown()

    def _serving_details(self) -> str:
        mode = "aggregated"
        if self.config.disaggregated:
            # Not "on host:port": scripts read the serving port from the first "on host:port" of this line.
            mode = f"disaggregated, prefill tier at {self.config.prefill}"
        where = "in this process" if self.core is not None else "in its own process"
        return f"{mode}; {self.config.batching} batching, {self.config.policy} policy; engine core {where}"


async def serve(
    engine: Engine | CoreSpec,
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
