"""The engine core's parts of the decode configuration: all that a core in a process of its own
receives (`CoreConfig`), each part read by the code that owns it, and the `CoreSpec` it is spawned with.

`decode_service.config.DecodeServiceConfig` holds the flags and hands the core its parts; the core reads
nothing else, so it never sees the front door's settings (HTTP limits, the auth token) or its code.
`CoreSpec` lives here, not with either end of the pipe, because both ends need it: the server's
`core_client` ships it at spawn and the core's `core.run_core` receives it, and the core never imports
`core_client` (which imports `core` only to name the spawn target).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from base.errors import ConfigError
from decode_service.engine_core.grammar_compiler import GrammarConfig
from decode_service.engine_core.remote_prefill.config import RemotePrefillConfig
from engine.kv_events import KVEventsConfig

if TYPE_CHECKING:
    from engine.config import EngineConfig

BATCHING_MODES = ("continuous", "static")


@dataclass(frozen=True)
class SchedulerConfig:
    """How the core schedules: its policy (`policies.make_policy`) and batching mode, read by
    `core.EngineCore` and the scheduler.

    A request preempted `max_preemptions` times ranks ahead of every request that was not, so it is
    never the victim again while others are (bounded thrash). wfq remembers at most `max_idle_tenants`
    idle tenants' leads. `admission_watermark` is the share of the KV pool admission leaves free.

    `max_prefills_per_step` caps the prompts that take prefill tokens in one step: None (the default,
    `auto`) lets the scheduler choose per step on a CPU (`scheduler.prefills_for_least_ttft`) and sets no
    cap on a GPU, 0 sets none, N at most N. Prompts that arrive together otherwise share one step and
    all get their first token when it ends; on a CPU, where a prefill token costs about the same in any
    batch, prefilling them one after another gives the first its token sooner and the last no later,
    while each extra step costs every running decode row again.
    """

    policy: str = "fifo"
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    sjf_aging_tokens_per_second: float = 100.0
    max_idle_tenants: int = 1024
    batching: str = "continuous"
    static_batch_timeout_s: float = 0.1
    max_preemptions: int = 3
    admission_watermark: float = 0.01
    max_prefills_per_step: int | None = None

    def validate(self) -> None:
        if self.batching not in BATCHING_MODES:
            raise ConfigError(f"batching must be one of {', '.join(BATCHING_MODES)}, not {self.batching!r}")
        if self.max_preemptions < 0:
            raise ConfigError(f"max_preemptions must be >= 0, got {self.max_preemptions}")
        if not 0 <= self.admission_watermark < 1:
            raise ConfigError(f"admission_watermark must be in [0, 1), got {self.admission_watermark}")
        if self.static_batch_timeout_s < 0:
            raise ConfigError(f"static_batch_timeout_s must be >= 0, got {self.static_batch_timeout_s}")
        if self.max_idle_tenants < 1:
            raise ConfigError(f"max_idle_tenants must be >= 1, got {self.max_idle_tenants}")
        if self.max_prefills_per_step is not None and self.max_prefills_per_step < 0:
            raise ConfigError(f"--max-prefills-per-step must be >= 0, got {self.max_prefills_per_step}")


@dataclass(frozen=True)
class CoreConfig:
    """Everything the engine core reads.

    `event_log_size` bounds the in-process flight recorder of steps. `kv_events` (vLLM's KVEventsConfig)
    publishes the prefix cache's block events for cache-aware routers (`engine.kv_events`). A core in a
    process of its own that leaves a heartbeat unanswered for `engine_heartbeat_timeout_s` (stopped,
    wedged) is killed and the server exits non-zero, as when the core dies; the timeout must outlast the
    longest step, which a budget fitted to the measured step cost keeps within a quarter of it
    (`engine.step_cost`).
    """

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    remote_prefill: RemotePrefillConfig = field(default_factory=RemotePrefillConfig)
    grammar: GrammarConfig = field(default_factory=GrammarConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    event_log_size: int = 4096
    engine_heartbeat_timeout_s: float = 30.0

    def validate(self) -> None:
        self.scheduler.validate()
        self.remote_prefill.validate()
        self.grammar.validate()
        if not self.engine_heartbeat_timeout_s > 0:
            timeout = self.engine_heartbeat_timeout_s
            raise ConfigError(f"engine_heartbeat_timeout_s must be > 0, got {timeout}")
        self.kv_events.validate()


@dataclass(frozen=True)
class CoreSpec:
    """What the core process needs to build its engine and core; handed over once, at spawn."""

    model_dir: Path
    engine_config: EngineConfig
    # The core's part of the decode config alone (not the front door's: HTTP limits, the auth token).
    config: CoreConfig
    model_fingerprint: str | None = None
    threads: int | None = None
    log_level: int = logging.INFO
    log_format: str = "text"
    # The OTLP collector the core exports its spans to, as the front door does (`serving.tracing`).
    otlp_traces_endpoint: str | None = None
