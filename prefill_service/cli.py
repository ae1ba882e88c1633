"""`tandem serve prefill`: the shared engine and server flags (`serving.flags`), the prefill tier's own,
and turning them into a running server.

`add_arguments` imports nothing heavy so that `tandem --help` stays fast.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from engine import kv_events
from serving.flags import add_engine_arguments, add_server_arguments, add_token_budget_argument

if TYPE_CHECKING:
    from collections.abc import Coroutine

    from prometheus_client import CollectorRegistry

    from engine.config import EngineConfig
    from prefill_service.config import PrefillServiceConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the flags of `tandem serve prefill`."""
    add_engine_arguments(parser)
    add_server_arguments(parser, default_port=50052)
    # Larger than decode's 512: prefill is compute-bound, and bigger chunks use the matmuls better.
    add_token_budget_argument(parser, 2048, "prompt tokens per forward, across all prompts in it", "2 s")
    parser.add_argument(
        "--max-num-seqs", type=int, default=64, help="prompts in progress at once, at most (default: 64)"
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="requests waiting for admission before RESOURCE_EXHAUSTED (default: 256)",
    )
    parser.add_argument("--kv-events-config", default=None, metavar="JSON", help=kv_events.FLAG_HELP)


def service_config_from_args(args: argparse.Namespace) -> PrefillServiceConfig:
    """The validated PrefillServiceConfig the flags describe (reads the auth token file, if any)."""
    from prefill_service.config import PrefillServiceConfig
    from serving.flags import server_settings_from_args

    events = kv_events.KVEventsConfig.from_flag(args.kv_events_config, args.host)
    config = PrefillServiceConfig(**server_settings_from_args(args), kv_events=events)
    config.validate()
    return config


def run(args: argparse.Namespace) -> int:
    """Load the model, start the server, serve until SIGTERM/SIGINT, drain; returns the exit status."""
    from engine.engine import Engine
    from engine.model_store import model_fingerprint
    from prefill_service.server import serve
    from serving.flags import run_tier

    config = service_config_from_args(args)

    def serve_prefill(
        model_dir: Path, engine_config: EngineConfig, metrics_registry: CollectorRegistry
    ) -> Coroutine:
        return serve(
            Engine.from_pretrained(model_dir, engine_config),
            model_fingerprint(model_dir),
            config,
            metrics_registry=metrics_registry,
            max_concurrent_streams=args.max_concurrent_streams,
        )

    return run_tier(args, serve_prefill)
