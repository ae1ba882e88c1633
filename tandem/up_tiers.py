"""The child processes of `tandem up`: start one tier, forward its logs, wait for its health, stop it.

Each tier runs in its own session, so a terminal's Ctrl-C reaches only `up`, which stops the tiers in
order; each gets SIGTERM if `up` itself dies (Linux parent-death signal, armed by the child: see
`serving.parent_watch`), so none is ever orphaned.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from base.logs import log_event
from base.settings import PARENT_PID_ENV

logger = logging.getLogger(__name__)


def connect_host(host: str) -> str:
    """Where a client on this machine reaches a server listening on `host`."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


@dataclass(frozen=True)
class TierSpec:
    """One child: its name, its `tandem serve` command line, the gRPC port it will serve on, and its role
    ("prefill" or "decode"; a decode replica's name numbers it)."""

    name: str
    argv: list[str]
    port: int
    threads: int
    role: str = ""

    def __post_init__(self) -> None:
        if not self.role:
            object.__setattr__(self, "role", self.name)


@dataclass
class Tier:
    """A running child process and the thread that forwards its log lines."""

    spec: TierSpec
    process: subprocess.Popen[str]
    pump: threading.Thread | None = field(default=None)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def role(self) -> str:
        return self.spec.role

    def exited(self) -> bool:
        return self.process.poll() is not None


class LogForwarder:
    """Copies the children's log lines to our stderr, one line at a time, prefixed by tier in text mode.

    JSON lines pass through untouched so that a log pipeline reading `up`'s stderr still parses them.
    While the status line is shown, `write_line` is the status line's, which prints above it.
    """

    def __init__(self, json_lines: bool) -> None:
        self._json = json_lines
        self._lock = threading.Lock()
        self.write_line: Callable[[str], None] = self.write_stderr

    @staticmethod
    def write_stderr(line: str) -> None:
        sys.stderr.write(line)
        sys.stderr.flush()

    def start(self, tier: Tier) -> None:
        tier.pump = threading.Thread(target=self._pump, args=(tier,), name=f"logs-{tier.name}", daemon=True)
        tier.pump.start()

    def _pump(self, tier: Tier) -> None:
        if tier.process.stdout is None:
            return
        prefix = "" if self._json else f"[{tier.name}] "
        for line in tier.process.stdout:
            with self._lock:
                self.write_line(prefix + line)


def start_tier(spec: TierSpec, threads: int) -> Tier:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",
        PARENT_PID_ENV: str(os.getpid()),
    }
    process = subprocess.Popen(
        spec.argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        env=env,
        start_new_session=True,
    )
    log_event(
        logger, logging.INFO, "tier started", tier=spec.name, pid=process.pid, port=spec.port, threads=threads
    )
    return Tier(spec, process)


def is_serving(address: str, timeout: float = 1.0) -> bool:
    """One grpc.health.v1 check of the whole server; False on any error (not up yet, refused...)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            response = stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
    return response.status == health_pb2.HealthCheckResponse.SERVING


def wait_until_serving(
    tier: Tier, started: Sequence[Tier], host: str, deadline: float, stop: threading.Event
) -> Tier | None:
    """Poll `tier`'s health until it serves; returns whichever of `started` exited first (None: serving).

    Raises TimeoutError past `deadline`; returns early (None) when a stop was requested.
    """
    while not stop.is_set():
        for other in started:
            if other.exited():
                return other
        if is_serving(f"{connect_host(host)}:{tier.spec.port}"):
            log_event(logger, logging.INFO, "tier serving", tier=tier.name, port=tier.spec.port)
            return None
        if time.monotonic() > deadline:
            raise TimeoutError(f"the {tier.name} tier did not report SERVING in time")
        stop.wait(0.25)
    return None


def start_in_order(
    specs: Sequence[TierSpec],
    tiers: list[Tier],
    forwarder: LogForwarder,
    host: str,
    deadline: float,
    stop: threading.Event,
) -> Tier | None:
    """Start the tiers one after the other, each once the previous serves; returns one that died first.

    Started tiers are appended to `tiers` as they start, so the caller can stop them whatever happens.
    Prefill goes first: a decode tier that comes up before its prefill tier marks it failed and backs
    off, so its first requests would be refused although both tiers report SERVING.
    """
    for spec in specs:
        tier = start_tier(spec, spec.threads)
        tiers.append(tier)
        forwarder.start(tier)
        died = wait_until_serving(tier, tiers, host, deadline, stop)
        if died is not None or stop.is_set():
            return died
    return None


def stop_tier(tier: Tier, timeout: float) -> bool:
    """SIGTERM (the tier drains), then SIGKILL past `timeout`; True when it exited cleanly by itself."""
    if tier.exited():
        return tier.process.returncode in (0, -signal.SIGTERM)
    log_event(logger, logging.INFO, "stopping tier", tier=tier.name, pid=tier.process.pid)
    tier.process.send_signal(signal.SIGTERM)
    try:
        returncode = tier.process.wait(timeout)
    except subprocess.TimeoutExpired:
        logger.warning("%s did not stop within %.0f s; killing it", tier.name, timeout)
        tier.process.kill()
        tier.process.wait()
        return False
    # A tier stopped before it installed its handlers (still loading) dies of the SIGTERM itself.
    return returncode in (0, -signal.SIGTERM)
