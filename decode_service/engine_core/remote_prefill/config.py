"""Where a decode replica's remote prefill goes and how it calls there: the part of the decode
configuration that `RemotePrefill` reads (`decode_service.config.DecodeServiceConfig` holds the flags).

`prefill` lists the prefill tier's targets (`host:port` or `dns:///name:port`, see `targets`); empty
means aggregated. Prompts shorter than `local_prefill_threshold` tokens are prefilled here; with
`fallback_local`, so is any prompt when no prefill replica can take it. `prefill_timeout_s` is the
deadline of one `Prefill` call, which is tried on up to `prefill_max_attempts` replicas; DNS targets
are resolved again every `prefill_resolve_interval_s`. `prefill_tls_ca` (and for mTLS
`prefill_tls_cert` and `prefill_tls_key`) switch the calls to prefill to TLS.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from base.errors import ConfigError
from decode_service.engine_core.remote_prefill.targets import (
    PrefillTarget,
    PrefillTargetError,
    parse_prefill_targets,
)


@dataclass(frozen=True)
class RemotePrefillConfig:
    prefill: str = ""
    local_prefill_threshold: int = 0
    fallback_local: bool = False
    prefill_timeout_s: float = 60.0
    prefill_max_attempts: int = 3
    prefill_resolve_interval_s: float = 30.0
    prefill_tls_ca: Path | None = None
    prefill_tls_cert: Path | None = None
    prefill_tls_key: Path | None = None

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
