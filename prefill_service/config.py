"""How one prefill server runs: its address, queue bound, drain limit and optional TLS.

Engine sizing (token budget per step, sequences per step, KV pool, max_model_len) lives in
`engine.config.EngineConfig`, because the engine enforces it; this is everything the prefill tier adds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from engine.errors import TandemError


class ConfigError(TandemError, ValueError):
    """A server setting is out of range or malformed (the server refuses to start)."""


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


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
    "ti": 2**40,
    "tib": 2**40,
}


def parse_memory_size(text: str) -> int:
    """Bytes in a size such as `2GiB`, `512MiB`, `2G`, `1.5Gi` or `1048576`.

    Decimal units (K, M, G, T, and with a B) are powers of 1000 and binary ones (Ki, KiB, ...) powers
    of 1024, as Kubernetes quantities are, so the Helm chart's values mean the same here.
    """
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ConfigError(f"cannot parse memory size {text!r}; use e.g. 2GiB, 512MiB, 2G or a byte count")
    size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise ConfigError(f"memory size must be > 0, got {text!r}")
    return size
