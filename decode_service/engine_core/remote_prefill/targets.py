"""Where the prefill tier lives: parsing `--prefill` and resolving it to replica addresses.

`--prefill` is a comma-separated list of targets. A `host:port` target is one replica (gRPC resolves the
host name itself). A `dns:///name:port` target is every address the name resolves to: in Kubernetes a
headless Service, whose DNS answer lists one address per ready prefill pod. Decode resolves those names
itself, and again periodically, because it balances load across replicas by itself: a single
channel to a Service's virtual IP would pin every call to whichever pod the connection landed on.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from dataclasses import dataclass

from base.errors import TandemError

DNS_SCHEME = "dns:///"

# host:port, where host is a name, an IPv4 address, or an IPv6 address in brackets.
_HOST_PORT = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(?P<port>[0-9]{1,5})$")


class PrefillTargetError(TandemError, ValueError):
    """A `--prefill` target is malformed (the server refuses to start)."""


@dataclass(frozen=True)
class PrefillTarget:
    """One item of `--prefill`: a host and port, and whether the host names a set of replicas."""

    host: str
    port: int
    resolve: bool

    @property
    def address(self) -> str:
        """The gRPC address of the target itself (`host:port`, IPv6 hosts in brackets)."""
        return format_address(self.host, self.port)

    def __str__(self) -> str:
        return f"{DNS_SCHEME}{self.address}" if self.resolve else self.address


def format_address(host: str, port: int) -> str:
    """`host:port` as gRPC wants it; a bare IPv6 address gets its brackets."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def _parse_one(item: str) -> PrefillTarget:
    resolve = item.startswith(DNS_SCHEME)
    rest = item[len(DNS_SCHEME) :] if resolve else item
    match = _HOST_PORT.match(rest)
    if match is None:
        raise PrefillTargetError(
            f"cannot parse prefill target {item!r}; use host:port or dns:///name:port (the port is required)"
        )
    host, port = match.group("host"), int(match.group("port"))
    if not 1 <= port <= 65535:
        raise PrefillTargetError(f"prefill target {item!r} has port {port}, outside [1, 65535]")
    if host.startswith("["):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise PrefillTargetError(f"prefill target {item!r} has a malformed IPv6 address") from None
    return PrefillTarget(host, port, resolve)


def parse_prefill_targets(text: str) -> tuple[PrefillTarget, ...]:
    """Parse `host:port[,host:port]` and/or `dns:///name:port` items; an empty string means none."""
    items = [item.strip() for item in text.split(",")]
    targets = tuple(_parse_one(item) for item in items if item)
    if len(set(targets)) != len(targets):
        raise PrefillTargetError(f"prefill targets {text!r} name the same target twice")
    return targets


async def resolve_target(target: PrefillTarget) -> list[str]:
    """The replica addresses of one target, sorted; a `dns:///` name may resolve to several.

    Raises OSError (socket.gaierror) when the name does not resolve; the caller decides whether to
    keep the addresses it knew.
    """
    if not target.resolve:
        return [target.address]
    host = target.host[1:-1] if target.host.startswith("[") else target.host
    infos = await asyncio.get_running_loop().getaddrinfo(host, target.port, type=socket.SOCK_STREAM)
    return sorted({format_address(str(info[4][0]), target.port) for info in infos})
