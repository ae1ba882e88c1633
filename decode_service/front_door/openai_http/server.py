"""uvicorn as a task on the decode server's own event loop: the HTTP front door shares the process, the
loop and the engine thread with the gRPC one, so no request takes an extra hop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from base.errors import ConfigError
from decode_service.front_door.openai_http.connections import ConnectionLimits, GuardedHttpProtocol
from serving.config import TLSConfig

logger = logging.getLogger(__name__)


class _InLoopServer(uvicorn.Server):
    """A uvicorn server that leaves SIGTERM and SIGINT alone: they belong to the decode server's drain."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """Serves `app` on host:port (with the gRPC port's TLS settings when given) until `stop()`; each
    connection is held to `limits`."""

    def __init__(
        self, app: FastAPI, host: str, port: int, limits: ConnectionLimits, tls: TLSConfig | None = None
    ) -> None:
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            http=functools.partial(GuardedHttpProtocol, limits=limits),  # type: ignore[arg-type]
            ssl_certfile=tls.cert if tls else None,
            ssl_keyfile=tls.key if tls else None,
            # Mutual TLS like the gRPC port: a client CA makes a client certificate mandatory.
            ssl_ca_certs=str(tls.client_ca) if tls and tls.client_ca else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls and tls.client_ca else ssl.CERT_NONE,
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=1,
        )
        self._server = _InLoopServer(config)
        self._task: asyncio.Task[None] | None = None
        self.host = host
        self.port = port

    async def start(self) -> int:
        """Bind and serve; returns the bound port (useful with port 0)."""
        self._task = asyncio.create_task(self._serve(), name="http-server")
        while not self._server.started:
            if self._task.done():
                # uvicorn logs why (address in use, bad certificate) and exits the task.
                raise ConfigError(f"the HTTP API could not listen on {self.host}:{self.port}")
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self.port

    async def _serve(self) -> None:
        try:
            await self._server.serve()
        except SystemExit:
            # uvicorn exits the process when it cannot bind; here that must not take the gRPC port down.
            logger.error("the HTTP API stopped: uvicorn could not start")

    @property
    def open_connections(self) -> int:
        """HTTP connections the server holds now (refused ones are never counted)."""
        return len(self._server.server_state.connections)

    async def stop(self) -> None:
        """Close the port; open connections get a second to finish their responses."""
        if self._task is None:
            return
        self._server.should_exit = True
        await self._task
        self._task = None
