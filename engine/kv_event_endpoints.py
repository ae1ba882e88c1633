"""Where the KV event sockets listen: vLLM's endpoint strings, checked and resolved against `--host`.

vLLM's default endpoint is `tcp://*:5557`, and ZMQ reads `*` as every interface. A server told to listen
on 127.0.0.1 would then publish its prompts' token ids to the whole network, so a `*` host here means
the server's own `--host` (`on_host`); an operator who wants every interface says so with
`tcp://0.0.0.0:PORT` (IPv4) or `tcp://[::]:PORT` (IPv4 and IPv6). A `*` port stays ZMQ's "any free
port". Which endpoints are bound and which connected is the publisher's rule
(`engine.kv_event_publisher`).
"""

from __future__ import annotations

from base.errors import ConfigError

TRANSPORTS = ("tcp", "ipc", "inproc")
WILDCARD = "*"


def split_tcp(endpoint: str) -> tuple[str, str] | None:
    """(host, port) of a `tcp://HOST:PORT` endpoint, the host as written (IPv6 in brackets); None for
    another transport or a TCP endpoint without a port."""
    if not endpoint.startswith("tcp://"):
        return None
    host, colon, port = endpoint.removeprefix("tcp://").rpartition(":")
    return (host, port) if colon else None


def check(endpoint: str, flag: str, name: str) -> None:
    """Raise ConfigError naming `flag` and field `name` unless `endpoint` is one the publisher can open:
    `tcp://HOST:PORT` (PORT 0-65535 or `*`, an IPv6 HOST in brackets), `ipc://PATH` or `inproc://NAME`."""
    transport, separator, rest = endpoint.partition("://")
    if not separator or transport not in TRANSPORTS or not rest:
        raise ConfigError(
            f"{flag}: {name} must be a ZMQ endpoint (tcp://HOST:PORT, ipc://PATH or inproc://NAME) "
            f"such as tcp://*:5557, not {endpoint!r}"
        )
    if transport != "tcp":
        return
    parts = split_tcp(endpoint)
    host, port = parts if parts is not None else ("", "")
    if not host or not (port == WILDCARD or (port.isdigit() and int(port) <= 65535)):
        raise ConfigError(
            f"{flag}: {name} must be tcp://HOST:PORT with a port of 0-65535 or *, not {endpoint!r}"
        )
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ConfigError(
            f"{flag}: {name} must put an IPv6 host in brackets (tcp://[::1]:5557), not {endpoint!r}"
        )


def on_host(endpoint: str, host: str) -> str:
    """`endpoint` with a `*` TCP host replaced by the server's `host` (an IPv6 one in brackets); any other
    endpoint as it is."""
    parts = split_tcp(endpoint)
    if parts is None or parts[0] != WILDCARD:
        return endpoint
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{parts[1]}"


def is_ipv6(endpoint: str) -> bool:
    """True for a TCP endpoint whose host is an IPv6 address: its socket needs ZMQ's IPV6 option."""
    parts = split_tcp(endpoint)
    return parts is not None and parts[0].startswith("[")


def is_wildcard(endpoint: str) -> bool:
    """True for a TCP endpoint whose host is ZMQ's `*` (every interface)."""
    parts = split_tcp(endpoint)
    return parts is not None and parts[0] == WILDCARD
