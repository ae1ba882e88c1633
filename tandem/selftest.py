"""`tandem selftest`: prove that this installation serves, with no model download and no network.

It builds a tiny random-weight model in a temporary directory, starts a prefill and a decode tier on
it (disaggregated, as the Helm chart runs them) or a decode tier alone (`--aggregated`), streams one
completion through the public gRPC API and one chat completion through the HTTP API, and stops the
tiers with SIGTERM, which must end each cleanly. The container image runs it at build time: a runtime
dependency missing from `pip install .` fails the build instead of crash-looping every release.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from base.logs import log_event
from tandem.up_tiers import LogForwarder, Tier, TierSpec, start_in_order, stop_tier

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 120.0
PROMPT = "The quick brown fox"
MAX_TOKENS = 8


class SelftestError(Exception):
    """A step of the self-test did not give what a working installation gives."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--aggregated", action="store_true", help="start the decode tier alone (no prefill tier)"
    )
    parser.add_argument("--port", type=int, default=50151, help="decode gRPC port (default: 50151)")
    parser.add_argument("--http-port", type=int, default=50180, help="decode HTTP port (default: 50180)")
    parser.add_argument("--prefill-port", type=int, default=50152, help="prefill gRPC port (default: 50152)")


def tier_specs(args: argparse.Namespace, model_dir: Path) -> list[TierSpec]:
    """The tiers to start, in start order: one thread each, no metrics port, on loopback."""
    base = [sys.executable, "-m", "tandem.cli", "serve"]
    common = ["--model", str(model_dir), "--host", "127.0.0.1", "--threads", "1", "--metrics-port", "0"]
    decode = [*base, "decode", *common, "--port", str(args.port), "--http-port", str(args.http_port)]
    specs = []
    if not args.aggregated:
        prefill = [*base, "prefill", *common, "--port", str(args.prefill_port)]
        specs.append(TierSpec("prefill", prefill, args.prefill_port, 1))
        decode += ["--prefill", f"127.0.0.1:{args.prefill_port}"]
    specs.append(TierSpec("decode", decode, args.port, 1))
    return specs


def check_grpc(port: int) -> str:
    """Stream one completion over gRPC; returns its text."""
    from tandem.client import TandemClient
    from tandem.client import TandemError as ClientError

    try:
        with TandemClient(f"127.0.0.1:{port}", timeout=CALL_TIMEOUT_S) as client:
            completion = client.complete(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    except ClientError as exc:
        raise SelftestError(f"gRPC: {exc}") from None
    if completion.usage.completion_tokens != MAX_TOKENS:
        raise SelftestError(f"gRPC: asked for {MAX_TOKENS} tokens, got {completion.usage.completion_tokens}")
    return completion.text


def check_http(port: int) -> str:
    """One chat completion over the OpenAI-compatible HTTP API; returns its text."""
    body = {
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=CALL_TIMEOUT_S) as response:
        reply = json.load(response)
    choice = reply["choices"][0]
    if choice["finish_reason"] not in ("stop", "length"):
        raise SelftestError(f"HTTP: unexpected finish reason {choice['finish_reason']!r}")
    return choice["message"]["content"]


def run(args: argparse.Namespace) -> int:
    """Build, start, call, stop; 0 when every step worked."""
    from tandem.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="tandem-selftest-") as directory:
        model_dir = build_tiny_model(Path(directory) / "tiny-llama")
        tiers: list[Tier] = []
        try:
            died = start_in_order(
                tier_specs(args, model_dir),
                tiers,
                LogForwarder(json_lines=False),
                "127.0.0.1",
                time.monotonic() + STARTUP_TIMEOUT_S,
                threading.Event(),
            )
            if died is not None:
                raise SelftestError(f"the {died.name} tier exited with {died.process.returncode} at start")
            log_event(logger, logging.INFO, "selftest grpc", text=check_grpc(args.port))
            log_event(logger, logging.INFO, "selftest http", text=check_http(args.http_port))
            if not all([stop_tier(tier, STOP_TIMEOUT_S) for tier in reversed(tiers)]):
                raise SelftestError("a tier did not stop cleanly on SIGTERM")
        except (SelftestError, TimeoutError, OSError, KeyError) as exc:
            logger.error("selftest failed: %s", exc)
            return 1
        finally:
            for tier in tiers:
                if not tier.exited():
                    tier.process.kill()
                    tier.process.wait()
    logger.info("selftest passed: %s served and stopped cleanly", " and ".join(t.name for t in tiers))
    return 0
