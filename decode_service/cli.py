"""`tandem serve decode`: its flags, and turning them into a running server.

`add_arguments` imports nothing heavy so that `tandem --help` stays fast; `run` loads torch, the model
and gRPC only when the server actually starts. The flags are the CLI contract the Helm chart uses.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decode_service.config import DecodeServiceConfig
    from engine.config import EngineConfig

logger = logging.getLogger(__name__)

# Per connection: generous for a real client's concurrency, a wall against one client opening thousands.
DEFAULT_MAX_CONCURRENT_STREAMS = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the flags of `tandem serve decode`."""
    parser.add_argument(
        "--model",
        default=None,
        help="model directory (safetensors, config, tokenizer) or the default model's name "
        "(default: SmolLM2-135M-Instruct from the cache; run `tandem fetch-model` first)",
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: 0.0.0.0)")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (default: 50051)")
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
        help="memory for the KV pool, all layers' K and V (e.g. 2GiB, 512MiB; default: 2GiB)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=64, help="sequences per batch (default: 64)")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="tokens per step, decodes plus prefill chunks (default: 512)",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="context length (default: the model's)"
    )
    parser.add_argument("--policy", default="fifo", choices=["fifo", "priority", "sjf", "wfq"])
    parser.add_argument(
        "--tenant-weights", default="", help="wfq weights per tenant, e.g. a=2,b=1 (others weigh 1)"
    )
    parser.add_argument("--batching", default="continuous", choices=["continuous", "static"])
    parser.add_argument(
        "--static-batch-timeout",
        type=float,
        default=0.1,
        help="static batching: seconds to wait for a full batch before running a partial one (default: 0.1)",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="requests that may wait beyond a full batch before RESOURCE_EXHAUSTED (default: 256)",
    )
    parser.add_argument(
        "--max-tokens-cap",
        type=int,
        default=4096,
        help="largest max_tokens a request may ask for: above it the request gets INVALID_ARGUMENT, never "
        "a silently shorter answer; also the max_tokens of requests that leave it unset (default: 4096)",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="tokens per stream message: a request's tokens are sent once this many are ready (the "
        "first token and the end at once); larger values cut per-message CPU under load (default: 1)",
    )
    parser.add_argument(
        "--drain-grace-seconds",
        type=float,
        default=30.0,
        help="on SIGTERM, how long running requests may take to finish (default: 30)",
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
        help="also log prompts and generated text (default: only request ids, counts and timings)",
    )
    parser.add_argument(
        "--max-concurrent-streams",
        type=int,
        default=DEFAULT_MAX_CONCURRENT_STREAMS,
        help="concurrent calls one client connection may have open, at most (default: "
        f"{DEFAULT_MAX_CONCURRENT_STREAMS})",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--tls-cert", type=Path, default=None, help="server certificate (PEM); enables TLS")
    parser.add_argument("--tls-key", type=Path, default=None, help="server private key (PEM)")
    parser.add_argument(
        "--auth-token-file",
        type=Path,
        default=None,
        help="file holding the bearer token every call must carry (default: $TANDEM_AUTH_TOKEN; unset: off)",
    )
    _add_prefill_arguments(parser)


def _add_prefill_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of disaggregated prefill; without --prefill the server prefills everything itself."""
    group = parser.add_argument_group("disaggregated prefill")
    group.add_argument(
        "--prefill",
        default="",
        metavar="TARGETS",
        help="prefill replicas: host:port[,host:port], or dns:///name:port for every address the name "
        "resolves to (a headless Service; re-resolved periodically). Default: none, prefill locally",
    )
    group.add_argument(
        "--local-prefill-threshold",
        type=int,
        default=0,
        metavar="N",
        help="prompts shorter than N tokens are prefilled on this replica (default: 0, none)",
    )
    group.add_argument(
        "--fallback-local",
        action="store_true",
        help="prefill on this replica when no prefill replica can (default: fail with UNAVAILABLE)",
    )
    group.add_argument(
        "--prefill-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="deadline of one Prefill call in seconds; past it the prompt is retried on another replica "
        "(default: 60)",
    )
    group.add_argument(
        "--prefill-tls-ca",
        type=Path,
        default=None,
        help="CA (PEM) that signed the prefill servers' certificates; enables TLS toward prefill",
    )
    group.add_argument(
        "--prefill-tls-cert", type=Path, default=None, help="client certificate (PEM) for mutual TLS"
    )
    group.add_argument("--prefill-tls-key", type=Path, default=None, help="client private key (PEM)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags describe (sizes checked here, where the flag names are known)."""
    from engine.config import CacheConfig, EngineConfig, parse_dtype, parse_memory_size
    from engine.errors import ConfigError

    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return EngineConfig(
        dtype=parse_dtype(args.dtype),
        device=args.device,
        cache=CacheConfig(block_size=args.block_size, memory_bytes=parse_memory_size(args.kv_cache_memory)),
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )


def service_config_from_args(args: argparse.Namespace) -> DecodeServiceConfig:
    """The validated DecodeServiceConfig the flags describe (reads the auth token file, if any)."""
    from decode_service.config import DecodeServiceConfig, parse_tenant_weights
    from tandem.security import load_auth_token

    config = DecodeServiceConfig(
        host=args.host,
        port=args.port,
        policy=args.policy,
        tenant_weights=parse_tenant_weights(args.tenant_weights),
        batching=args.batching,
        static_batch_timeout_s=args.static_batch_timeout,
        max_queue=args.max_queue,
        max_tokens_cap=args.max_tokens_cap,
        stream_interval=args.stream_interval,
        drain_grace_seconds=args.drain_grace_seconds,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        auth_token=load_auth_token(args.auth_token_file),
        prefill=args.prefill,
        local_prefill_threshold=args.local_prefill_threshold,
        fallback_local=args.fallback_local,
        prefill_timeout_s=args.prefill_timeout,
        prefill_tls_ca=args.prefill_tls_ca,
        prefill_tls_cert=args.prefill_tls_cert,
        prefill_tls_key=args.prefill_tls_key,
    )
    config.validate()
    return config


def run(args: argparse.Namespace) -> int:
    """Load the model, start the server, serve until SIGTERM/SIGINT, drain; returns the exit status."""
    import asyncio

    import torch
    from prometheus_client import CollectorRegistry, start_http_server

    from decode_service.server import serve
    from engine.engine import Engine
    from engine.errors import ConfigError
    from engine.model_store import model_fingerprint, resolve_model
    from tandem.logs import set_log_prompts, use_log_format

    use_log_format(args.log_format)
    set_log_prompts(args.log_prompts)
    if args.max_concurrent_streams < 1:
        raise ConfigError(f"--max-concurrent-streams must be >= 1, got {args.max_concurrent_streams}")
    engine_config = engine_config_from_args(args)
    config = service_config_from_args(args)
    model_dir = resolve_model(args.model)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    metrics_registry = CollectorRegistry()
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.host, registry=metrics_registry)
    engine = Engine.from_pretrained(model_dir, engine_config)
    fingerprint = model_fingerprint(model_dir) if config.disaggregated else None
    return asyncio.run(
        serve(
            engine,
            config,
            model_fingerprint=fingerprint,
            metrics_registry=metrics_registry,
            max_concurrent_streams=args.max_concurrent_streams,
        )
    )
