"""How a client reaches a server: target, TLS, bearer token, default deadline, per-call metadata.

Shared by the sync and asyncio clients so both resolve credentials and metadata identically; only
channel creation differs (`grpc` vs `grpc.aio`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from base.auth import PathLike, bearer_metadata, channel_credentials

logger = logging.getLogger(__name__)

Metadata = Mapping[str, str] | Iterable[tuple[str, str]]

# Spread calls over every address the target resolves to (the pods behind a headless Service, or an
# `ipv4:` list), and retry a call that fails with UNAVAILABLE before any response arrives (a draining or
# vanished replica) on another address. The README shows this JSON for clients in other languages.
ROUND_ROBIN_SERVICE_CONFIG = {
    "loadBalancingConfig": [{"round_robin": {}}],
    "methodConfig": [
        {
            "name": [{"service": "tandem.v1.Generation"}],
            "retryPolicy": {
                "maxAttempts": 3,
                "initialBackoff": "0.1s",
                "maxBackoff": "1s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ],
}
# Targets whose resolver may return several replicas; a plain host:port keeps gRPC's pick_first.
MULTI_ADDRESS_SCHEMES = ("dns:", "ipv4:", "ipv6:")


def balances_load(target: str) -> bool:
    """True for targets that name a resolver explicitly (`dns:///decode-headless:50051`, `ipv4:a,b`)."""
    return target.startswith(MULTI_ADDRESS_SCHEMES)


@dataclass(frozen=True)
class ConnectionSettings:
    target: str
    credentials: grpc.ChannelCredentials | None
    options: tuple[tuple[str, Any], ...]
    auth_token: str | None
    timeout: float | None

    @classmethod
    def create(
        cls,
        target: str,
        *,
        tls: bool = False,
        ca_cert: PathLike | None = None,
        client_cert: PathLike | None = None,
        client_key: PathLike | None = None,
        tls_server_name: str | None = None,
        auth_token: str | None = None,
        timeout: float | None = None,
        options: Iterable[tuple[str, Any]] = (),
    ) -> ConnectionSettings:
        """Any certificate path (or `tls=True`, which trusts the system's CAs) makes the channel TLS.

        A `dns:///`, `ipv4:` or `ipv6:` target gets round-robin load balancing over its addresses.
        """
        secure = tls or any(p is not None for p in (ca_cert, client_cert, client_key))
        credentials = channel_credentials(ca_cert, client_cert, client_key) if secure else None
        channel_options = list(options)
        if balances_load(target) and not any(name == "grpc.service_config" for name, _ in channel_options):
            channel_options.append(("grpc.service_config", json.dumps(ROUND_ROBIN_SERVICE_CONFIG)))
        if tls_server_name:
            # Verify the server's certificate against this name instead of the host in `target`.
            channel_options.append(("grpc.ssl_target_name_override", tls_server_name))
        if auth_token and not secure:
            logger.warning("sending a bearer token to %s over a plaintext channel", target)
        return cls(target, credentials, tuple(channel_options), auth_token or None, timeout)

    def deadline(self, timeout: float | None) -> float | None:
        """Seconds allowed for one call: the call's own timeout, else the client's default."""
        return self.timeout if timeout is None else timeout

    def metadata(self, extra: Metadata | None = None) -> tuple[tuple[str, str], ...]:
        """The bearer token (if any) followed by the caller's own metadata for this call."""
        entries = [bearer_metadata(self.auth_token)] if self.auth_token else []
        if extra:
            entries.extend(extra.items() if isinstance(extra, Mapping) else extra)
        return tuple(entries)

    def sync_channel(self, address: str | None = None) -> grpc.Channel:
        """A channel to the target, or to one `address` of it (see `address_options`)."""
        target, options = (self.target, self.options) if address is None else self.address_options(address)
        if self.credentials is None:
            return grpc.insecure_channel(target, options=options)
        return grpc.secure_channel(target, self.credentials, options=options)

    def aio_channel(self, address: str | None = None) -> grpc.aio.Channel:
        target, options = (self.target, self.options) if address is None else self.address_options(address)
        if self.credentials is None:
            return grpc.aio.insecure_channel(target, options=options)
        return grpc.aio.secure_channel(target, self.credentials, options=options)

    def address_options(self, address: str) -> tuple[str, tuple[tuple[str, Any], ...]]:
        """Target and options of a channel to one replica address of a multi-address target: under TLS
        the certificate is checked against the target's host name, not the address, unless
        `tls_server_name` already says which name."""
        options = self.options
        if self.credentials is not None and self.target.startswith("dns:"):
            if not any(name == "grpc.ssl_target_name_override" for name, _ in options):
                host = self.target[len("dns:") :].lstrip("/").split("/")[-1].rpartition(":")[0].strip("[]")
                options = (*options, ("grpc.ssl_target_name_override", host))
        return address, options
