"""Transport security shared by the servers and the client: TLS credentials and bearer-token auth.

Both tiers and the client load PEM files through the same functions so that a bad path or a file that
is not PEM fails at start-up with one clear message instead of an opaque TLS handshake error later.
The bearer token is a shared secret checked by a server interceptor; health checks and reflection stay
open because Kubernetes probes and `grpcurl describe` carry no token.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import grpc

from base.errors import TandemError
from base.settings import get_settings

logger = logging.getLogger(__name__)

AUTHORIZATION_HEADER = "authorization"
BEARER_SCHEME = "bearer"

# Services reachable without a token: health (probes, load balancers) and reflection (tooling).
OPEN_SERVICES = (
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
)

PathLike = str | os.PathLike[str]


class CredentialsError(TandemError, ValueError):
    """A certificate, key or token cannot be read or is malformed (the process refuses to start)."""


def _read_pem(path: PathLike, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise CredentialsError(f"cannot read the {what} {str(path)!r}: {exc.strerror or exc}") from exc
    if b"-----BEGIN " not in data:
        raise CredentialsError(f"the {what} {str(path)!r} is not PEM-encoded")
    return data


def server_credentials(
    cert: PathLike, key: PathLike, client_ca: PathLike | None = None
) -> grpc.ServerCredentials:
    """TLS credentials for a server; with `client_ca`, clients must present a certificate it signed (mTLS)."""
    key_pair = (_read_pem(key, "server private key"), _read_pem(cert, "server certificate"))
    if client_ca is None:
        return grpc.ssl_server_credentials([key_pair])
    return grpc.ssl_server_credentials(
        [key_pair], root_certificates=_read_pem(client_ca, "client CA certificate"), require_client_auth=True
    )


def channel_credentials(
    ca: PathLike | None, cert: PathLike | None = None, key: PathLike | None = None
) -> grpc.ChannelCredentials:
    """TLS credentials for a client channel.

    `ca` is the CA that signed the server's certificate (None: the system's trust store); `cert` and
    `key` are this client's own certificate and key, needed only when the server requires mTLS.
    """
    if (cert is None) != (key is None):
        raise CredentialsError("a client certificate and its private key must be given together")
    return grpc.ssl_channel_credentials(
        root_certificates=None if ca is None else _read_pem(ca, "CA certificate"),
        private_key=None if key is None else _read_pem(key, "client private key"),
        certificate_chain=None if cert is None else _read_pem(cert, "client certificate"),
    )


def load_auth_token(token_file: PathLike | None = None) -> str | None:
    """The bearer token: from `token_file` if given, else $TANDEM_AUTH_TOKEN, else None (auth off).

    Surrounding whitespace is dropped because mounted secrets usually end with a newline.
    """
    if token_file is not None:
        try:
            token = Path(token_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise CredentialsError(f"cannot read the auth token file {str(token_file)!r}: {exc}") from exc
        if not token:
            raise CredentialsError(f"the auth token file {str(token_file)!r} is empty")
        return token
    return get_settings().auth_token


def bearer_metadata(token: str) -> tuple[str, str]:
    """The metadata entry that carries `token` (`authorization: Bearer <token>`)."""
    return (AUTHORIZATION_HEADER, f"Bearer {token}")


def _is_open(method: str, open_methods: Iterable[str]) -> bool:
    """`method` is '/package.Service/Method'; an entry names either a whole service or one method."""
    return any(method == entry or method.startswith(f"/{entry}/") for entry in open_methods)


def _presented_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> bytes | None:
    for key, value in metadata or ():
        if key.lower() != AUTHORIZATION_HEADER:
            continue
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        scheme, _, credential = text.strip().partition(" ")
        if scheme.lower() == BEARER_SCHEME:
            return credential.strip().encode("utf-8")
    return None


def _rejecting_handler(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that ends the call with UNAUTHENTICATED.

    Requests are left as raw bytes: nothing from an unauthenticated caller gets parsed.
    """

    async def reject(request_or_iterator: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    request_streaming = handler is not None and handler.request_streaming
    response_streaming = handler is not None and handler.response_streaming
    if request_streaming and response_streaming:
        return grpc.stream_stream_rpc_method_handler(reject)
    if request_streaming:
        return grpc.stream_unary_rpc_method_handler(reject)
    if response_streaming:
        return grpc.unary_stream_rpc_method_handler(reject)
    return grpc.unary_unary_rpc_method_handler(reject)


class BearerTokens:
    """The bearer-token check both front doors (gRPC metadata, HTTP headers) share.

    `token` may be several tokens (any of them is accepted), so a secret can be rotated without
    downtime: roll out old+new, move the clients, then roll out new alone. Comparison is constant-time
    so response timing does not leak how much of a guess was right.
    """

    def __init__(self, token: str | Iterable[str]) -> None:
        tokens = [token] if isinstance(token, str) else list(token)
        if not tokens or any(not t for t in tokens):
            raise CredentialsError("a bearer token must be a non-empty string")
        self._tokens = [t.encode("utf-8") for t in tokens]

    def rejection(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """Why the `authorization` entry of `metadata` (or HTTP headers) is refused; None when accepted."""
        presented = _presented_token(metadata)
        if presented is None:
            return "missing bearer token"
        # Compare against every token, without stopping early, to keep timing independent of which matched.
        matches = [hmac.compare_digest(presented, expected) for expected in self._tokens]
        return None if any(matches) else "invalid bearer token"


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls whose `authorization: Bearer <token>` metadata is missing or wrong (see
    `BearerTokens`). Methods of `open_methods` (whole services or single '/pkg.Service/Method' names)
    need no token.
    """

    def __init__(self, token: str | Iterable[str], open_methods: Iterable[str] = OPEN_SERVICES) -> None:
        self._tokens = BearerTokens(token)
        self._open_methods = tuple(open_methods)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if _is_open(method, self._open_methods):
            return await continuation(handler_call_details)
        reason = self._tokens.rejection(handler_call_details.invocation_metadata)
        if reason is None:
            return await continuation(handler_call_details)
        logger.info("rejected %s: %s", method, reason)
        return _rejecting_handler(await continuation(handler_call_details), reason)
