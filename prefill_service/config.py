"""How one prefill server runs: the shared server settings, with the prefill tier's port and queue bound.

The settings both tiers share (address, queue bound, drain, TLS, auth) are `serving.config.ServerConfig`;
engine sizing (token budget per step, sequences per step, KV pool, max_model_len) lives in
`engine.config.EngineConfig`, because the engine enforces it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from base.errors import ConfigError
from engine.kv_events import KVEventsConfig
from serving.config import ServerConfig


@dataclass(frozen=True)
class PrefillServiceConfig(ServerConfig):
    """Settings of the prefill tier; defaults suit a single CPU replica.

    `max_queue` bounds the requests accepted but not yet admitted to the running batch (admission
    needs free blocks for the whole prompt); past it new calls get RESOURCE_EXHAUSTED, so the decode
    tier can try another replica instead of waiting behind a long queue.

    `kv_events` (vLLM's KVEventsConfig) publishes the prefix cache's block events for cache-aware
    routers (`engine.kv_events`).
    """

    port: int = 50052
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)

    def validate(self) -> None:
        super().validate()
        if self.max_queue < 1:
            raise ConfigError(f"max_queue must be >= 1, got {self.max_queue}")
        self.kv_events.validate()
