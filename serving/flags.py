"""The flags both tiers share, with the same names, defaults and help, and what they turn into.

`add_engine_arguments` and `add_server_arguments` import nothing heavy, so `tandem --help` stays fast;
`run_tier` loads torch, the model and gRPC only when a server actually starts. The flags are the CLI
contract the Helm chart uses. Each tier adds its own flags (batch sizes, queue, policies) next to these.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from engine.config import EngineConfig
    from engine.speculation import SpeculativeConfig
    from serving.config import TLSConfig

# Per connection: generous for a real caller's concurrency (a decode replica multiplexes all its
# Prefill calls over one connection), a wall against one caller opening thousands.
DEFAULT_MAX_CONCURRENT_STREAMS = 256
# The KV pool's budget when `--kv-cache-memory` is not given (the pool may hold less: see CacheConfig).
DEFAULT_KV_CACHE_MEMORY = "2GiB"


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and the engine it runs on: identical on both tiers, so their KV layouts match."""
    parser.add_argument(
        "--model",
        default=None,
        help="model directory (safetensors, config, tokenizer) or a fetched model's name, e.g. gemma-3-270m "
        "(default: SmolLM2-135M-Instruct from the cache; run `tandem fetch-model [NAME]` first)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="weights, activations and KV cache: float32 (exact parity with transformers), bfloat16 (half "
        "the memory; fp32 sums, norms, softmax and logits; C++ kernels on the CPU; drifts from float32 by "
        "bf16 rounding) or float16 (torch ops on the CPU) (default: float32)",
    )
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument(
        "--quantization",
        default="none",
        choices=["none", "int8", "w8a8_int8"],
        help="weights of the linears, LM head and embedding, quantized at load (needs --dtype float32 on "
        "the CPU): int8 is weight-only, symmetric per output channel (greedy output equals the dequantized "
        "weights'); w8a8_int8 also quantizes each token's activations to int8 (int8 dot products: 2-3x "
        "the compute of fp32 in prefill and large batches). Both tiers must agree (default: none)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    parser.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="do not reuse the KV of prompt prefixes across requests (default: automatic prefix caching on)",
    )
    parser.add_argument(
        "--kv-cache-memory",
        default=None,
        help="memory for the KV pool, all layers' K and V (e.g. 2GiB, 512MiB; default: what "
        f"--max-model-len x --max-num-seqs tokens fill, at most {DEFAULT_KV_CACHE_MEMORY})",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "int8", "fp8_e4m3"],
        help="KV cache element type: auto (the --dtype), or int8 / fp8_e4m3 with a scale per token and head "
        "(about 3.8x the blocks of float32 in --kv-cache-memory, and as many fewer bytes between the tiers; "
        "fp8_e4m3 on a CPU or a GPU of compute capability 8.9+). Both tiers must agree (default: auto)",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="context length (default: the model's)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")


@dataclass(frozen=True)
class AutoTokenBudget:
    """`--max-num-batched-tokens auto`: the budget is fitted at start to the step cost measured then
    (`engine.step_cost`), at most `ceiling` (the tier's default budget)."""

    ceiling: int

    def __str__(self) -> str:
        return "auto"


def parse_token_budget(ceiling: int, value: str) -> AutoTokenBudget | int:
    """`--max-num-batched-tokens`: `auto` or a count of tokens."""
    if value == "auto":
        return AutoTokenBudget(ceiling)
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a count of tokens, got {value!r}") from None


def add_token_budget_argument(parser: argparse.ArgumentParser, ceiling: int, what: str, target: str) -> None:
    """The tier's `--max-num-batched-tokens auto|N`: `what` the tokens of a step are, and the `target`
    duration of a step that `auto` fits the budget to (`engine.step_cost.step_target_s`)."""
    parser.add_argument(
        "--max-num-batched-tokens",
        type=functools.partial(parse_token_budget, ceiling),
        default="auto",
        metavar="auto|N",
        help=f"{what}, at most. auto: as many as one step computes in {target}, timed at start on this "
        f"host, at most {ceiling}; the start log says what a step costs. N: N tokens, however long their "
        "step takes (default: auto)",
    )


def add_server_arguments(parser: argparse.ArgumentParser, default_port: int) -> None:
    """Address, metrics, drain, logs, stream cap, TLS and auth of a tier's server."""
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: 0.0.0.0)")
    parser.add_argument(
        "--port",
        type=int,
        default=default_port,
        help=f"gRPC port; 0 picks a free one (default: {default_port})",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus metrics over HTTP on this port (default: 0, off)",
    )
    parser.add_argument(
        "--drain-grace-seconds",
        type=float,
        default=30.0,
        help="on SIGTERM, how long live calls may take to finish (default: 30)",
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
    parser.add_argument(
        "--stream-stall-timeout",
        type=float,
        default=30.0,
        help="seconds one stream message may wait for a caller that is not reading before the call is "
        "ended with DEADLINE_EXCEEDED and what it holds (slot, KV blocks) freed (default: 30)",
    )
    parser.add_argument("--tls-cert", type=Path, default=None, help="server certificate (PEM); enables TLS")
    parser.add_argument("--tls-key", type=Path, default=None, help="server private key (PEM)")
    parser.add_argument(
        "--tls-client-ca",
        type=Path,
        default=None,
        help="CA (PEM) that signs callers' certificates; requires mutual TLS when given",
    )
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="export OpenTelemetry traces of each request to this OTLP gRPC collector: http://host:port "
        "(plaintext) or https://host:port (TLS); the OTEL_* variables configure the rest (headers, "
        "certificates, OTEL_SERVICE_NAME). Needs `pip install tandem-serve[tracing]` (default: "
        "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; unset: off)",
    )
    parser.add_argument(
        "--auth-token-file",
        type=Path,
        default=None,
        help="file holding the bearer token every call must carry (default: $TANDEM_AUTH_TOKEN; unset: off)",
    )


def check_positive(args: argparse.Namespace, *names: str) -> None:
    """Refuse a size flag below 1, naming the flag as the user typed it."""
    from base.errors import ConfigError

    for name in names:
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags describe (sizes checked here, where the flag names are known)."""
    from engine.config import CacheConfig, EngineConfig, parse_dtype, parse_memory_size

    check_positive(args, "block_size", "max_num_seqs")
    budget = args.max_num_batched_tokens
    fit = isinstance(budget, AutoTokenBudget)
    if not fit:
        check_positive(args, "max_num_batched_tokens")
    return EngineConfig(
        dtype=parse_dtype(args.dtype),
        device=args.device,
        cache=CacheConfig(
            block_size=args.block_size,
            memory_bytes=parse_memory_size(args.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY),
            fit_to_sequences=args.kv_cache_memory is None,
        ),
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=budget.ceiling if fit else budget,
        fit_token_budget=fit,
        enable_prefix_caching=not args.no_prefix_caching,
        # A decode flag: the prefill tier never samples under a grammar.
        grammar_jump_forward=getattr(args, "jump_forward", False),
        quantization=args.quantization,
        speculative=speculative_config_from_args(args),
    )


def speculative_config_from_args(args: argparse.Namespace) -> SpeculativeConfig:
    """The decode tier's `--speculative` flags; the prefill tier has none and never speculates."""
    from engine.speculation import SpeculativeConfig

    if not hasattr(args, "speculative"):
        return SpeculativeConfig()
    return SpeculativeConfig(
        method=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_min=args.prompt_lookup_min,
        prompt_lookup_max=args.prompt_lookup_max,
        disable_by_batch_size=args.speculative_disable_by_batch_size,
    )


def tls_from_args(args: argparse.Namespace) -> TLSConfig | None:
    """The server's TLS settings, or None for plaintext."""
    from base.errors import ConfigError
    from serving.config import TLSConfig

    if args.tls_cert is None and args.tls_key is None:
        if args.tls_client_ca is not None:
            raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if args.tls_cert is None or args.tls_key is None:
        raise ConfigError("--tls-cert and --tls-key go together")
    return TLSConfig(cert=args.tls_cert, key=args.tls_key, client_ca=args.tls_client_ca)


def server_settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The `serving.config.ServerConfig` fields the shared flags set (reads the auth token file, if any)."""
    from base.auth import load_auth_token

    return {
        "host": args.host,
        "port": args.port,
        "max_queue": args.max_queue,
        "drain_grace_seconds": args.drain_grace_seconds,
        "tls": tls_from_args(args),
        "auth_token": load_auth_token(args.auth_token_file),
        "stream_stall_timeout_s": args.stream_stall_timeout,
    }


ServeFn = Callable[[Path, "EngineConfig", "CollectorRegistry"], Coroutine[Any, Any, int]]


def check_tier_memory(args: argparse.Namespace, model_dir: Path, engine_config: EngineConfig) -> None:
    """Log what the tier's processes will hold and refuse (ModelTooLargeError, one line) before any weight
    is read when that exceeds the memory this machine allows (`engine.load_plan`). Decode runs its engine
    core in a process of its own beside the front door unless `--engine-in-process` (a prefill tier has no
    such flag: it is one process)."""
    from engine.checkpoints import open_checkpoint
    from engine.load_plan import check_memory

    tier = getattr(args, "tier", None) or "engine"
    roles: list[tuple[str, EngineConfig | None]] = [(tier, engine_config)]
    if not getattr(args, "engine_in_process", True):
        roles = [(f"{tier} core", engine_config), (f"{tier} front door", None)]
    check_memory(open_checkpoint(model_dir), roles)


def run_tier(args: argparse.Namespace, serve: ServeFn) -> int:
    """Set up logging and threads, find the model, then serve until SIGTERM/SIGINT; the exit status.

    The tier has built (and so checked) its own config before calling this, so a bad flag fails before
    the slow model load. `serve(model_dir, engine_config, metrics_registry)` is the tier's coroutine
    that loads the model where its engine runs, runs its server until the signal and returns the exit
    status.
    """
    import asyncio

    import torch
    from prometheus_client import CollectorRegistry, start_http_server

    from base.logs import set_log_prompts, use_log_format
    from engine.model_store import resolve_model
    from serving import tracing
    from serving.open_files import raise_open_file_limit
    from serving.parent_watch import stop_with_parent

    stop_with_parent()
    use_log_format(args.log_format)
    set_log_prompts(args.log_prompts)
    raise_open_file_limit()
    check_positive(args, "max_concurrent_streams")
    engine_config = engine_config_from_args(args)
    tier = getattr(args, "tier", None) or "engine"
    tracing.configure(tracing.resolve_endpoint(args.otlp_traces_endpoint), f"tandem-{tier}")
    model_dir = resolve_model(args.model)
    check_tier_memory(args, model_dir, engine_config)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    metrics_registry = CollectorRegistry()
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.host, registry=metrics_registry)
    try:
        return asyncio.run(serve(model_dir, engine_config, metrics_registry))
    finally:
        tracing.shutdown()
