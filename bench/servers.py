"""Server processes a comparison starts and stops: tandem decode/prefill tiers and llama.cpp's server.

Each system runs in its own process (as in production, and so that the load generator never shares a
GIL or torch thread pool with the server), with its torch/BLAS threads set explicitly, on a free
loopback port. `start()` returns once the server answers its health check; `stop()` sends SIGTERM and
waits. Server logs go to a file next to the results' scratch directory, for post-mortems.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from base.errors import TandemError

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0


class ServerStartError(TandemError):
    """A server process exited or never became healthy."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tandem_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "tandem.cli", *args]


def grpc_healthy(target: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _http_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class ServerProcess:
    """One server process: its command, how to tell it is up, its environment."""

    name: str
    command: list[str]
    healthy: Callable[[], bool]
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path = field(default_factory=lambda: Path(tempfile.gettempdir()) / "tandem-bench-logs")
    _process: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        """The running server's process id (for reading its CPU time or profiling it)."""
        if self._process is None:
            raise ServerStartError(f"{self.name} is not started")
        return self._process.pid

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def start(
        self, timeout_s: float = START_TIMEOUT_S, on_spawn: Callable[[int], None] | None = None
    ) -> None:
        """Spawn the server, wait until it is healthy; `on_spawn` gets its pid at once (to watch it load)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        logger.info("starting %s: %s", self.name, " ".join(self.command))
        with self.log_path.open("w") as log:
            self._process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        if on_spawn is not None:
            on_spawn(self._process.pid)
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if self._process.poll() is not None:
                code = self._process.returncode
                raise ServerStartError(f"{self.name} exited with {code}; see {self.log_path}")
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"{self.name} not healthy in {timeout_s:.0f} s; see {self.log_path}")
            time.sleep(0.5)
        logger.info("%s is up (pid %d)", self.name, self._process.pid)

    def stop(self) -> None:
        if self._process is None or self._process.poll() is not None:
            return
        self._process.send_signal(signal.SIGTERM)
        try:
            self._process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("%s ignored SIGTERM for %.0f s; killing it", self.name, STOP_TIMEOUT_S)
            self._process.kill()
            self._process.wait()

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def thread_env(threads: int) -> dict[str, str]:
    """Pin BLAS/OpenMP pools too: torch.set_num_threads does not reach every library's own pool."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def tandem_decode_server(
    name: str, model: str, threads: int, server_args: list[str], prefill_target: str | None = None
) -> tuple[ServerProcess, str]:
    """A `tandem serve decode` process; returns it and its gRPC target."""
    port = free_port()
    target = f"127.0.0.1:{port}"
    command = tandem_command(
        "serve",
        "decode",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--threads",
        str(threads),
        *server_args,
    )
    if prefill_target is not None:
        command += ["--prefill", prefill_target]
    return ServerProcess(name, command, lambda: grpc_healthy(target), thread_env(threads)), target


def tandem_prefill_server(
    name: str, model: str, threads: int, server_args: list[str]
) -> tuple[ServerProcess, str]:
    """A `tandem serve prefill` process; returns it and its gRPC target."""
    port = free_port()
    target = f"127.0.0.1:{port}"
    command = tandem_command(
        "serve",
        "prefill",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--threads",
        str(threads),
        *server_args,
    )
    return ServerProcess(name, command, lambda: grpc_healthy(target), thread_env(threads)), target


def llama_server(
    name: str, binary: Path, gguf: Path, threads: int, parallel: int, context: int
) -> tuple[ServerProcess, str]:
    """`llama-server` with `parallel` slots and continuous batching; returns it and its base URL. A Q8_0
    GGUF runs with `--no-repack`: repacking its weights hangs at start on this machine kind."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        str(binary),
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(parallel),
        "-cb",
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-c",
        str(context),
    ]
    if "q8_0" in gguf.name.lower():
        command.append("--no-repack")
    return ServerProcess(name, command, lambda: _http_healthy(f"{url}/health"), thread_env(threads)), url


@contextlib.contextmanager
def running(*servers: ServerProcess):
    """Start servers in order, stop them in reverse order."""
    with contextlib.ExitStack() as stack:
        for server in servers:
            stack.enter_context(server)
        yield
