"""What every tier's server needs beyond its engine: address, queue bound, drain, TLS and auth.

Each tier's config (`DecodeServiceConfig`, `PrefillServiceConfig`) extends `ServerConfig` with its
own domain settings; engine sizing lives in `engine.config.EngineConfig`, because the engine enforces it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from base.errors import ConfigError


@dataclass(frozen=True)
class TLSConfig:
    """Server certificate and key (PEM files); with `client_ca`, callers must present a certificate
    signed by it (mutual TLS: e.g. only the decode tier may call prefill)."""

    cert: Path
    key: Path
    client_ca: Path | None = None


@dataclass(frozen=True)
class ServerConfig:
    """Settings every tier's server has; defaults suit a single CPU replica.

    `max_queue` bounds the calls a server holds beyond what it runs (each tier says what it counts);
    past it new calls get RESOURCE_EXHAUSTED. `tls` switches the port to TLS (mutual with a client CA);
    `auth_token` requires `authorization: Bearer` on every call but health checks and reflection.
    """

    host: str = "0.0.0.0"
    port: int = 0
    max_queue: int = 256
    drain_grace_seconds: float = 30.0
    event_log_size: int = 4096
    warm_up: bool = True
    tls: TLSConfig | None = None
    auth_token: str | None = field(default=None, repr=False)
    # A streaming call whose caller reads nothing for this long is ended and what it holds freed.
    stream_stall_timeout_s: float = 30.0

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if self.max_queue < 0:
            raise ConfigError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.drain_grace_seconds < 0:
            raise ConfigError(f"drain_grace_seconds must be >= 0, got {self.drain_grace_seconds}")
        if not self.stream_stall_timeout_s > 0:
            raise ConfigError(f"stream_stall_timeout_s must be > 0, got {self.stream_stall_timeout_s}")
        if self.event_log_size < 1:
            raise ConfigError(f"event_log_size must be >= 1, got {self.event_log_size}")
