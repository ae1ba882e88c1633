"""How one decode server runs: its scheduling policy, batching mode, limits and prefill tier.

The server settings both tiers share (address, queue bound, drain, TLS, auth) are
`serving.config.ServerConfig`; engine sizing lives in `engine.config.EngineConfig`, because the engine
enforces it; this is everything the decode tier adds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from base.errors import ConfigError
from decode_service.chat_template import read_chat_template
from decode_service.engine_core.remote_prefill.targets import (
    PrefillTarget,
    PrefillTargetError,
    parse_prefill_targets,
)
from decode_service.front_door.admission import RequestLimits
from engine.kv_events import KVEventsConfig
from serving.config import ServerConfig

BATCHING_MODES = ("continuous", "static")
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
REASONING_PARSERS = ("deepseek_r1", "qwen3")


@dataclass(frozen=True)
class DecodeServiceConfig(ServerConfig):
    """Settings of the decode tier; defaults suit a single CPU replica.

    `max_queue` bounds the requests waiting beyond a full batch: the server holds at most
    `max_num_seqs + max_queue` live requests and refuses more with RESOURCE_EXHAUSTED.
    `max_tokens_cap` is the default `max_tokens` when a request leaves it unset (further capped by
    what the context has left). `stream_interval` tokens go in one stream message (see
    `decode_service.front_door.streams`). A request preempted `max_preemptions` times ranks
    ahead of every request that was not, so it is never the victim again while others are (bounded thrash).

    `cache_salt_by_tenant` folds each request's tenant (from `tenant_header` when set) into its
    prefix-cache salt, so tenants never share cached blocks (see the README's security section on the
    cache's timing side channel).

    Disaggregated prefill: `prefill` lists the prefill tier's targets (`host:port` or
    `dns:///name:port`, see `remote_prefill.targets`); empty means aggregated. Prompts shorter than
    `local_prefill_threshold` tokens are prefilled here; with `fallback_local`, so is any prompt when
    no prefill replica can take it. `prefill_timeout_s` is the deadline of one `Prefill` call, which
    is tried on up to `prefill_max_attempts` replicas. `prefill_tls_ca` (and for mTLS `prefill_tls_cert`
    and `prefill_tls_key`) switch the calls to prefill to TLS.

    Hardening: `limits` bound each request (see `RequestLimits`); at most `max_validation_queue` large
    prompts wait for the tokenizer; a stream may fall `max_stream_buffer` messages behind before it is
    cancelled; wfq remembers at most
    `max_idle_tenants` idle tenants' leads. `tenant_header`/`priority_header` name request headers, set
    by a trusted gateway, that replace the client's own `tenant`/`priority` fields.

    Structured outputs and tools: a constraint that does not compile within
    `structured_output_compile_timeout_s` (one budget for all of a request's compiles), or whose compiled
    grammar is larger than `max_grammar_memory` bytes, is refused; a tenant may have at most
    `max_compiles_per_tenant` compiles waiting or running, and tenants take turns at the compiler. At most
    `grammar_cache_size` compiled grammars, and `grammar_cache_memory` bytes of them, are kept.
    `chat_template` (a Jinja file, or the template inline) replaces the model's template, or gives a
    model without one (a base model) chat endpoints. `tool_call_parser` reads the calls a
    model writes under tool_choice auto; `reasoning_parser` splits off its `<think>` reasoning, and
    grammars then apply only after `</think>`.

    An engine core in a process of its own that leaves a heartbeat unanswered for
    `engine_heartbeat_timeout_s` (stopped, wedged) is killed and the server exits non-zero, as when the
    core dies; the timeout must outlast the longest step (a long prefill on a slow CPU).

    `kv_events` (vLLM's KVEventsConfig) publishes the prefix cache's block events for cache-aware
    routers, from the engine core (`engine.kv_events`).
    """

    port: int = 50051
    # The OpenAI-compatible HTTP API on the same host, process and engine; None: off.
    http_port: int | None = None
    # Against slow or piled-up clients: open connections, at most, and seconds to send a whole request.
    http_max_connections: int = 4096
    http_read_timeout_s: float = 30.0
    # The model name the HTTP API answers to; None: the engine's model name.
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
    chat_template: str | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    engine_heartbeat_timeout_s: float = 30.0
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill_targets)

    @property
    def prefill_targets(self) -> tuple[PrefillTarget, ...]:
        return parse_prefill_targets(self.prefill)

    @property
    def prefill_tls(self) -> bool:
        return any(p is not None for p in (self.prefill_tls_ca, self.prefill_tls_cert, self.prefill_tls_key))

    def validate(self) -> None:
        if self.batching not in BATCHING_MODES:
            raise ConfigError(f"batching must be one of {', '.join(BATCHING_MODES)}, not {self.batching!r}")
        super().validate()
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ConfigError(f"http_port must be in [0, 65535], got {self.http_port}")
        if self.http_max_connections < 1:
            raise ConfigError(f"http_max_connections must be >= 1, got {self.http_max_connections}")
        if not self.http_read_timeout_s > 0:
            raise ConfigError(f"http_read_timeout_s must be > 0, got {self.http_read_timeout_s}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ConfigError("served_model_name must not be empty")
        if self.max_preemptions < 0:
            raise ConfigError(f"max_preemptions must be >= 0, got {self.max_preemptions}")
        for name in ("max_tokens_cap", "stream_interval"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.admission_watermark < 1:
            raise ConfigError(f"admission_watermark must be in [0, 1), got {self.admission_watermark}")
        if self.static_batch_timeout_s < 0:
            raise ConfigError(f"static_batch_timeout_s must be >= 0, got {self.static_batch_timeout_s}")
        self._validate_prefill()
        self.limits.validate()
        for name in ("max_validation_queue", "max_stream_buffer", "max_idle_tenants"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        self._validate_structured_outputs()
        if not self.engine_heartbeat_timeout_s > 0:
            timeout = self.engine_heartbeat_timeout_s
            raise ConfigError(f"engine_heartbeat_timeout_s must be > 0, got {timeout}")
        self.kv_events.validate()

    def _validate_structured_outputs(self) -> None:
        if not self.structured_output_compile_timeout_s > 0:
            raise ConfigError(
                "structured_output_compile_timeout_s must be > 0, got "
                f"{self.structured_output_compile_timeout_s}"
            )
        for name in ("grammar_cache_size", "grammar_cache_memory"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_grammar_memory", "max_compiles_per_tenant"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.chat_template is not None:
            read_chat_template(self.chat_template)
        for name, known in (("tool_call_parser", TOOL_CALL_PARSERS), ("reasoning_parser", REASONING_PARSERS)):
            value = getattr(self, name)
            if value is not None and value not in known:
                raise ConfigError(f"{name} must be one of {', '.join(known)}, not {value!r}")

    def _validate_prefill(self) -> None:
        try:
            parse_prefill_targets(self.prefill)
        except PrefillTargetError as exc:
            raise ConfigError(str(exc)) from None
        if self.local_prefill_threshold < 0:
            raise ConfigError(f"local_prefill_threshold must be >= 0, got {self.local_prefill_threshold}")
        for name in ("prefill_timeout_s", "prefill_resolve_interval_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.prefill_max_attempts < 1:
            raise ConfigError(f"prefill_max_attempts must be >= 1, got {self.prefill_max_attempts}")
        if (self.prefill_tls_cert is None) != (self.prefill_tls_key is None):
            raise ConfigError("the prefill client certificate and private key go together")


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
