"""How one prefill server runs: its address, queue bound, drain limit and optional TLS.

Engine sizing (token budget per step, sequences per step, KV pool, max_model_len) lives in
`engine.config.EngineConfig`, because the engine enforces it; this is everything the prefill tier adds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.errors import ConfigError


@dataclass(frozen=True)
class TLSConfig:
    """Server certificate and key (PEM files); with `client_ca`, callers must present a certificate
    signed by it (mutual TLS: only the decode tier may call prefill)."""

    cert: Path
    key: Path
    client_ca: Path | None = None


@dataclass(frozen=True)
class PrefillServiceConfig:
    """Settings of the prefill tier; defaults suit a single CPU replica.

    `max_queue` bounds the requests accepted but not yet admitted to the running batch (admission
    needs free blocks for the whole prompt); past it new calls get RESOURCE_EXHAUSTED, so the decode
    tier can try another replica instead of waiting behind a long queue.
    """

    host: str = "0.0.0.0"
    port: int = 50052
    max_queue: int = 256
    drain_grace_seconds: float = 30.0
    event_log_size: int = 4096
    warm_up: bool = True
    tls: TLSConfig | None = None

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if self.max_queue < 1:
            raise ConfigError(f"max_queue must be >= 1, got {self.max_queue}")
        if self.drain_grace_seconds < 0:
            raise ConfigError(f"drain_grace_seconds must be >= 0, got {self.drain_grace_seconds}")
        if self.event_log_size < 1:
            raise ConfigError(f"event_log_size must be >= 1, got {self.event_log_size}")
