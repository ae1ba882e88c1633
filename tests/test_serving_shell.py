"""The serving shell both tiers share (`serving/`): a failed warm-up ends the process naming its error,
both tiers start with the same flags and defaults, and a CPU server stops on a signal without noise."""

from __future__ import annotations

import ast
import asyncio
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from conftest import save_tiny_model
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_service.config import DecodeServiceConfig
from decode_service.server import DecodeServer
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from prefill_service.config import PrefillServiceConfig
from prefill_service.server import PrefillServer
from tandem.cli import build_parser

WARM_UP_ERROR = "injected warm-up failure: CUDA out of memory"

# Runs `tandem` with a warm-up forward that raises, as a broken device or driver would.
FAILING_WARM_UP = f"""
import sys
from engine.engine import Engine
from tandem.cli import main

def warm_up(self):
    raise RuntimeError({WARM_UP_ERROR!r})

Engine.warm_up = warm_up
sys.exit(main(sys.argv[1:]))
"""


def test_the_shell_imports_neither_tier(repo_root):
    imported = set()
    for path in (repo_root / "serving").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
    assert imported.isdisjoint({"decode_service", "prefill_service"}), imported


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("shell-model")
    save_tiny_model(directory, seed=5)
    return directory


def tiny_engine(model_dir: Path) -> Engine:
    config = EngineConfig(
        cache=CacheConfig(block_size=8, num_blocks=32), max_num_seqs=4, max_num_batched_tokens=64
    )
    return Engine.from_pretrained(model_dir, config)


def failing_warm_up(self: Engine) -> None:
    raise RuntimeError(WARM_UP_ERROR)


@pytest.mark.parametrize("tier", ["decode", "prefill"])
def test_a_failed_warm_up_is_raised_by_start_on_both_tiers(tier, model_dir, monkeypatch):
    engine = tiny_engine(model_dir)
    monkeypatch.setattr(Engine, "warm_up", failing_warm_up)

    async def start() -> None:
        if tier == "decode":
            server = DecodeServer(engine, DecodeServiceConfig(host="127.0.0.1", port=0))
        else:
            server = PrefillServer(engine, "fingerprint", PrefillServiceConfig(host="127.0.0.1", port=0))
        try:
            await server.start()
        finally:
            await server.stop()

    with pytest.raises(RuntimeError, match=WARM_UP_ERROR):
        asyncio.run(start())


@pytest.mark.slow
def test_a_prefill_process_whose_warm_up_fails_exits_naming_the_error(model_dir):
    command = [sys.executable, "-c", FAILING_WARM_UP, "serve", "prefill", "--model", str(model_dir)]
    command += ["--host", "127.0.0.1", "--port", "0", "--kv-cache-memory", "4MiB", "--threads", "1"]
    # The timeout only catches the old failure mode: a process that never exits and never serves.
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert WARM_UP_ERROR in result.stderr
    assert "prefill server serving" not in result.stderr


def test_both_tiers_share_the_engine_and_server_flags_with_the_same_defaults():
    parser = build_parser()
    decode = vars(parser.parse_args(["serve", "decode"]))
    prefill = vars(parser.parse_args(["serve", "prefill"]))
    shared = (
        "model dtype device block_size kv_cache_memory max_model_len threads host metrics_port "
        "drain_grace_seconds log_format log_prompts max_concurrent_streams tls_cert tls_key tls_client_ca "
        "auth_token_file max_queue stream_stall_timeout"
    ).split()
    assert {name: decode[name] for name in shared} == {name: prefill[name] for name in shared}
    assert decode["model"] is None, "both tiers default to the default model"
    assert (decode["port"], prefill["port"]) == (50051, 50052)


def _tandem_command() -> list[str]:
    script = Path(sys.executable).with_name("tandem")
    return [str(script)] if script.exists() else [sys.executable, "-m", "tandem.cli"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.parametrize(("tier", "stop_signal"), [("prefill", signal.SIGINT), ("decode", signal.SIGTERM)])
def test_tandem_serve_starts_with_the_default_model_and_stops_quietly(tier, stop_signal, real_model_dir):
    """`tandem serve prefill --port N`, exactly as the README shows it; a CPU server never loads Triton,
    so a stop by Ctrl-C or SIGTERM prints no `nanobind: leaked ...` lines."""
    port = _free_port()
    process = subprocess.Popen(
        [*_tandem_command(), "serve", tier, "--port", str(port)], stderr=subprocess.PIPE, text=True
    )
    log: list[str] = []
    serving_or_gone = threading.Event()

    def read_log() -> None:
        for line in process.stderr:
            log.append(line)
            if f"{tier} server serving" in line:
                serving_or_gone.set()
        serving_or_gone.set()

    reader = threading.Thread(target=read_log, daemon=True)
    reader.start()
    try:
        serving_or_gone.wait(300)
        assert process.poll() is None, "server exited:\n" + "".join(log)
        assert any(f"{tier} server serving" in line for line in log), "server did not start:\n" + "".join(log)
        assert "SmolLM2-135M-Instruct" in "".join(log)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        process.send_signal(stop_signal)
        assert process.wait(120) == 0, "".join(log)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    reader.join(10)
    assert not [line for line in log if "nanobind" in line], "".join(log)
