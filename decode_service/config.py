"""How one decode server runs: one field per flag, and the part of them each half of the server reads.

The server settings both tiers share (address, queue bound, drain, TLS, auth) are
`serving.config.ServerConfig`; engine sizing lives in `engine.config.EngineConfig`, because the engine
enforces it; this is everything the decode tier adds. Each part is defined, documented and validated
beside the code that reads it: the engine core's (`engine_core.config.CoreConfig`: scheduler, remote
prefill, grammar bounds, KV events, heartbeat) and the front door's (`front_door.config`: request
handling and HTTP). This module, above both halves, is the only one that sees them all; the core
process receives its part alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TypeVar

from base.errors import ConfigError
from decode_service.engine_core.config import CoreConfig, SchedulerConfig
from decode_service.engine_core.grammar_compiler import GrammarConfig
from decode_service.engine_core.remote_prefill.config import RemotePrefillConfig
from decode_service.front_door.admission import RequestLimits
from decode_service.front_door.config import FrontDoorConfig, HttpConfig
from engine.kv_events import KVEventsConfig
from serving.config import ServerConfig

PartT = TypeVar("PartT")


@dataclass(frozen=True)
class DecodeServiceConfig(ServerConfig):
    """Settings of the decode tier; defaults suit a single CPU replica.

    `max_queue` bounds the requests waiting beyond a full batch: the server holds at most
    `max_num_seqs + max_queue` live requests and refuses more with RESOURCE_EXHAUSTED. What the other
    fields mean is said where they are read: `SchedulerConfig`, `RemotePrefillConfig`, `GrammarConfig`
    and `CoreConfig` for the engine core, `FrontDoorConfig` and `HttpConfig` for the front door.
    """

    port: int = 50051
    http_port: int | None = None
    http_max_connections: int = 4096
    http_read_timeout_s: float = 30.0
    enable_responses_store: bool = False
    responses_store_bytes: int = 64 * 2**20
    responses_store_ttl_s: float = 3600.0
    served_model_name: str | None = None
    policy: str = "fifo"
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    sjf_aging_tokens_per_second: float = 100.0
    batching: str = "continuous"
    static_batch_timeout_s: float = 0.1
    max_tokens_cap: int = 4096
    stream_interval: int = 1
    max_preemptions: int = 3
    admission_watermark: float = 0.01
    max_prefills_per_step: int | None = None
    prefill: str = ""
    local_prefill_threshold: int = 0
    fallback_local: bool = False
    cache_salt_by_tenant: bool = False
    prefill_timeout_s: float = 60.0
    prefill_max_attempts: int = 3
    prefill_resolve_interval_s: float = 30.0
    prefill_tls_ca: Path | None = None
    prefill_tls_cert: Path | None = None
    prefill_tls_key: Path | None = None
    limits: RequestLimits = field(default_factory=RequestLimits)
    max_validation_queue: int = 16
    max_stream_buffer: int = 1024
    max_idle_tenants: int = 1024
    tenant_header: str = ""
    priority_header: str = ""
    structured_output_compile_timeout_s: float = 10.0
    grammar_cache_size: int = 256
    grammar_cache_memory: int = 512 * 2**20
    max_grammar_memory: int = 64 * 2**20
    max_compiles_per_tenant: int = 4
    structured_output_fill_timeout_ms: float = 1000.0
    chat_template: str | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    engine_heartbeat_timeout_s: float = 30.0
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)

    def _part(self, part: type[PartT]) -> PartT:
        """The part of type `part`, from the fields of the same names."""
        return part(**{f.name: getattr(self, f.name) for f in fields(part)})

    @property
    def scheduler(self) -> SchedulerConfig:
        return self._part(SchedulerConfig)

    @property
    def remote_prefill(self) -> RemotePrefillConfig:
        return self._part(RemotePrefillConfig)

    @property
    def grammar(self) -> GrammarConfig:
        return self._part(GrammarConfig)

    @property
    def core(self) -> CoreConfig:
        """All the engine core reads: what a core process receives."""
        return CoreConfig(
            self.scheduler,
            self.remote_prefill,
            self.grammar,
            self.kv_events,
            self.event_log_size,
            self.engine_heartbeat_timeout_s,
        )

    @property
    def front_door(self) -> FrontDoorConfig:
        return self._part(FrontDoorConfig)

    @property
    def http(self) -> HttpConfig:
        return self._part(HttpConfig)

    @property
    def disaggregated(self) -> bool:
        return self.remote_prefill.disaggregated

    def validate(self) -> None:
        self.scheduler.validate()
        super().validate()
        self.http.validate()
        self.front_door.validate()
        self.core.validate()


def parse_tenant_weights(text: str) -> dict[str, float]:
    """Parse `a=2,b=1` into {'a': 2.0, 'b': 1.0}; an empty string means no weights."""
    weights: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        tenant, sep, value = item.partition("=")
        if not sep or not tenant.strip():
            raise ConfigError(f"tenant weights look like a=2,b=1; cannot parse {item!r}")
        try:
            weight = float(value)
        except ValueError:
            raise ConfigError(f"weight of tenant {tenant.strip()!r} is not a number: {value!r}") from None
        if not weight > 0:
            raise ConfigError(f"weight of tenant {tenant.strip()!r} must be > 0, got {value!r}")
        weights[tenant.strip()] = weight
    return weights
