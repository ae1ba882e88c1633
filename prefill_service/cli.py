"""`tandem serve prefill`: its flags, and turning them into a running server.

`add_arguments` imports nothing heavy so that `tandem --help` stays fast; `run` loads torch, the model
and gRPC only when the server actually starts. The flags are the CLI contract the Helm chart uses.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# Per connection: decode replicas multiplex all their Prefill calls over one connection each, so the
# cap must sit above a decode replica's batch; it stops a runaway caller, not normal load.
DEFAULT_MAX_CONCURRENT_STREAMS = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the flags of `tandem serve prefill`."""
    parser.add_argument(
        "--model",
        required=True,
        help="local model directory (safetensors, config, tokenizer) or the default model's name",
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: 0.0.0.0)")
    parser.add_argument(
        "--port", type=int, default=50052, help="gRPC port; 0 picks a free one (default: 50052)"
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus metrics over HTTP on this port (default: 0, off)",
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    parser.add_argument(
        "--kv-cache-memory",
        default="2GiB",
        help="memory for the pool of prompts in progress, all layers' K and V (e.g. 2GiB, 512MiB, 2G; "
        "default: 2GiB)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="prompt tokens per forward, across all prompts in it (default: 2048)",
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=64, help="prompts in progress at once, at most (default: 64)"
    )
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="context length (default: the model's)"
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="requests waiting for admission before RESOURCE_EXHAUSTED (default: 256)",
    )
    parser.add_argument(
        "--drain-grace-seconds",
        type=float,
        default=30.0,
        help="on SIGTERM, how long in-flight prefills may take to finish (default: 30)",
    )
    parser.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="text for people, json for log pipelines: one object per line (default: text)",
    )
    parser.add_argument(
        "--log-prompts",
        action="store_true",
        help="also log prompt token ids (default: only request ids, counts and timings)",
    )
    parser.add_argument(
        "--max-concurrent-streams",
        type=int,
        default=DEFAULT_MAX_CONCURRENT_STREAMS,
        help="concurrent calls one connection may have open, at most "
        f"(default: {DEFAULT_MAX_CONCURRENT_STREAMS})",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--tls-cert", type=Path, default=None, help="server certificate (PEM); enables TLS")
    parser.add_argument("--tls-key", type=Path, default=None, help="server private key (PEM)")
    parser.add_argument(
        "--tls-client-ca",
        type=Path,
        default=None,
        help="CA (PEM) that signs callers' certificates; requires mutual TLS when given",
    )


def run(args: argparse.Namespace) -> int:
    """Load the model, start the server, serve until SIGTERM/SIGINT, drain; returns the exit status."""
    import asyncio

    import torch
    from prometheus_client import CollectorRegistry, start_http_server

    from engine.config import CacheConfig, EngineConfig, parse_dtype, parse_memory_size
    from engine.engine import Engine
    from engine.errors import ConfigError
    from engine.model_store import model_fingerprint, resolve_model
    from prefill_service.config import PrefillServiceConfig, TLSConfig
    from prefill_service.server import serve
    from tandem.logs import set_log_prompts, use_log_format

    use_log_format(args.log_format)
    set_log_prompts(args.log_prompts)
    if args.max_concurrent_streams < 1:
        raise ConfigError(f"--max-concurrent-streams must be >= 1, got {args.max_concurrent_streams}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    tls = None
    if args.tls_cert is not None or args.tls_key is not None:
        if args.tls_cert is None or args.tls_key is None:
            raise ConfigError("--tls-cert and --tls-key go together")
        tls = TLSConfig(cert=args.tls_cert, key=args.tls_key, client_ca=args.tls_client_ca)
    elif args.tls_client_ca is not None:
        raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key")
    for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    engine_config = EngineConfig(
        dtype=parse_dtype(args.dtype),
        device=args.device,
        cache=CacheConfig(block_size=args.block_size, memory_bytes=parse_memory_size(args.kv_cache_memory)),
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    config = PrefillServiceConfig(
        host=args.host,
        port=args.port,
        max_queue=args.max_queue,
        drain_grace_seconds=args.drain_grace_seconds,
        tls=tls,
    )
    config.validate()
    model_dir = resolve_model(args.model)
    metrics_registry = CollectorRegistry()
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.host, registry=metrics_registry)
    engine = Engine.from_pretrained(model_dir, engine_config)
    return asyncio.run(
        serve(
            engine,
            model_fingerprint(model_dir),
            config,
            metrics_registry=metrics_registry,
            max_concurrent_streams=args.max_concurrent_streams,
        )
    )
