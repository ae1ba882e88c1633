"""`tandem serve decode`: the shared engine and server flags (`serving.flags`), the decode tier's own,
and turning them into a running server.

`add_arguments` imports nothing heavy so that `tandem --help` stays fast.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from engine import kv_events
from engine.speculation import METHODS, SpeculativeConfig
from serving.flags import add_engine_arguments, add_server_arguments, add_token_budget_argument

if TYPE_CHECKING:
    from collections.abc import Coroutine

    from prometheus_client import CollectorRegistry

    from decode_service.config import DecodeServiceConfig
    from engine.config import EngineConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the flags of `tandem serve decode`."""
    add_engine_arguments(parser)
    add_server_arguments(parser, default_port=50051)
    parser.add_argument(
        "--engine-in-process",
        action="store_true",
        help="run the engine core (scheduler, model steps, remote prefill) on a thread of the server "
        "process instead of a process of its own, sharing the front door's GIL (default: own process)",
    )
    parser.add_argument(
        "--engine-heartbeat-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds the engine core process may leave a heartbeat unanswered (stopped, wedged) before "
        "it is killed, every live request ends with UNAVAILABLE and the server exits non-zero; must "
        "outlast the longest engine step, which --max-num-batched-tokens auto keeps within a quarter of it "
        "(default: 30)",
    )
    parser.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/responses, /v1/models, /health) on this port, same host, TLS and token (default: off)",
    )
    parser.add_argument(
        "--http-max-connections",
        type=int,
        default=4096,
        help="open HTTP connections, at most (further ones are answered 503 and closed); lowered to half "
        "the process's open-file limit if that is smaller (default: 4096)",
    )
    parser.add_argument(
        "--http-read-timeout",
        type=float,
        default=30.0,
        help="seconds an HTTP client has to send a whole request, headers and body; slower ones get 408 "
        "and are closed (default: 30)",
    )
    parser.add_argument(
        "--enable-responses-store",
        action="store_true",
        help="keep finished /v1/responses answers in memory, per tenant (--tenant-header), for "
        "previous_response_id and GET /v1/responses/{id} (default: off; store: true then keeps nothing "
        "and previous_response_id is refused)",
    )
    parser.add_argument(
        "--responses-store-bytes",
        default="64MiB",
        metavar="SIZE",
        help="memory the stored responses may take in all, oldest dropped first (e.g. 64MiB, 1GiB; "
        "default: 64MiB)",
    )
    parser.add_argument(
        "--responses-store-ttl",
        type=float,
        default=3600.0,
        metavar="S",
        help="seconds a stored response is kept (default: 3600)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="model name the HTTP API answers to and lists in /v1/models (default: the model's name)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=64, help="sequences per batch (default: 64)")
    add_token_budget_argument(
        parser,
        512,
        "tokens per step, decodes plus prefill chunks",
        "2 s (a quarter of --engine-heartbeat-timeout if that is shorter)",
    )
    parser.add_argument(
        "--max-prefills-per-step",
        type=_prefills_per_step,
        default="auto",
        metavar="auto|N",
        help="prompts prefilled in one step, at most. auto: on a CPU, per step, the count that gives the "
        "waiting prompts the least mean time to first token (one at a time when little else runs, more "
        "beside many decode rows), no cap on a GPU; 0: no cap (the token budget alone); N: at most N "
        "(default: auto)",
    )
    parser.add_argument("--policy", default="fifo", choices=["fifo", "priority", "sjf", "wfq"])
    parser.add_argument(
        "--tenant-weights", default="", help="wfq weights per tenant, e.g. a=2,b=1 (others weigh 1)"
    )
    parser.add_argument(
        "--cache-salt-by-tenant",
        action="store_true",
        help="fold each request's tenant into its prefix-cache salt, so tenants never share cached KV "
        "(closes the cache's timing side channel between tenants; default: off)",
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
        "first token and the end at once); larger values cut per-message CPU under load (default: 1). "
        "Whatever the interval, tokens that piled up while a stream's writer was busy go out together, "
        "so a message may carry several tokens",
    )
    parser.add_argument("--kv-events-config", default=None, metavar="JSON", help=kv_events.FLAG_HELP)
    _add_prefill_arguments(parser)
    _add_limit_arguments(parser)
    _add_structured_output_arguments(parser)
    _add_speculative_arguments(parser)


def _prefills_per_step(value: str) -> int | None:
    """`--max-prefills-per-step`: `auto` (None) or a count, 0 for no cap."""
    if value == "auto":
        return None
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        raise argparse.ArgumentTypeError(f"expected auto or a count >= 0, got {value!r}")
    return count


def _add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of speculative decoding (`engine.speculation`), in vLLM's terms; defaults are the config's."""
    defaults = SpeculativeConfig()
    group = parser.add_argument_group("speculative decoding")
    group.add_argument(
        "--speculative",
        default=defaults.method,
        choices=list(METHODS),
        help="ngram: draft the next tokens from the latest earlier occurrence of the context's last tokens "
        "(prompt and output) and verify them in one step; greedy output is unchanged and sampled output "
        "keeps its distribution. Pays on text that copies (code edits, extraction, rewrites); each sequence "
        "drafts only as far as its recent acceptance pays, and a request may opt out with "
        f"disable_speculation (default: {defaults.method})",
    )
    group.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=defaults.num_speculative_tokens,
        metavar="K",
        help=f"draft tokens per step and sequence, at most (default: {defaults.num_speculative_tokens})",
    )
    group.add_argument(
        "--prompt-lookup-min",
        type=int,
        default=defaults.prompt_lookup_min,
        metavar="N",
        help=f"shortest suffix of the context looked up for a draft (default: {defaults.prompt_lookup_min})",
    )
    group.add_argument(
        "--prompt-lookup-max",
        type=int,
        default=defaults.prompt_lookup_max,
        metavar="N",
        help="longest suffix of the context looked up for a draft; longer ones are tried first "
        f"(default: {defaults.prompt_lookup_max})",
    )
    group.add_argument(
        "--speculative-disable-by-batch-size",
        type=int,
        default=defaults.disable_by_batch_size,
        metavar="N",
        help="no drafts in a step decoding more than N sequences; below it a draft token must be likelier "
        f"to be kept the larger the batch (default: {defaults.disable_by_batch_size})",
    )


def _add_structured_output_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of constrained outputs, tool calling and reasoning models."""
    group = parser.add_argument_group("structured outputs and tools")
    group.add_argument(
        "--structured-output-compile-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds a request's JSON schema, regex or grammar may take to compile in the engine core's "
        "compile worker; past it the request gets INVALID_ARGUMENT (HTTP 400) and the worker is restarted "
        "(default: 10)",
    )
    group.add_argument(
        "--grammar-cache-size",
        type=int,
        default=256,
        metavar="N",
        help="compiled grammars (and constraints xgrammar refused) kept for reuse, least recently used "
        "dropped first (default: 256)",
    )
    group.add_argument(
        "--grammar-cache-memory",
        default="512MiB",
        metavar="SIZE",
        help="memory the compiled grammars kept for reuse may take in all, least recently used dropped "
        "first (e.g. 512MiB, 1GiB; default: 512MiB)",
    )
    group.add_argument(
        "--max-grammar-memory",
        default="64MiB",
        metavar="SIZE",
        help="largest compiled grammar one request's constraint may make; a larger one gets INVALID_ARGUMENT "
        "(HTTP 400) naming its size (a 20,000-value enum makes about 40 MiB with a 49k-token vocabulary; "
        "default: 64MiB)",
    )
    group.add_argument(
        "--max-compiles-per-tenant",
        type=int,
        default=4,
        metavar="N",
        help="distinct constraints one tenant may have waiting for or in a compile at once; more get "
        "RESOURCE_EXHAUSTED (HTTP 429). Tenants (--tenant-header, or the request's tenant / user) take "
        "turns at the compiler, so one tenant's slow schemas delay another's new schema by at most one "
        "compile (default: 4)",
    )
    group.add_argument(
        "--structured-output-fill-timeout-ms",
        type=float,
        default=1000.0,
        metavar="MS",
        help="milliseconds a constrained request's token masks may take to fill for one token, all its "
        "choices (n) together; past it the request ends with INVALID_ARGUMENT (HTTP 400), and a grammar "
        "whose fills already take over a quarter of it on a trial answer is refused before it runs. "
        "Bounds what one ambiguous grammar can stall every stream's step by (default: 1000)",
    )
    group.add_argument(
        "--jump-forward",
        action="store_true",
        help="append the text a grammar forces at once and compute it in one chunk of the next step, instead "
        "of sampling it token by token: fewer steps per constrained answer, longer steps for the whole batch "
        "(off by default: on a CPU it raises everyone's tail inter-token latency; see bench/README.md)",
    )
    group.add_argument(
        "--chat-template",
        default=None,
        metavar="TEMPLATE",
        help="Jinja chat template, a file or the template text itself, that replaces the model's own (e.g. "
        "one that renders tools) or gives a model without one chat endpoints (default: the template in the "
        "model's tokenizer files; without one, chat requests are refused)",
    )
    group.add_argument(
        "--tool-call-parser",
        default=None,
        choices=["hermes", "llama3_json", "mistral"],
        help="how to read the tool calls a model writes under tool_choice auto: hermes (Qwen2/2.5 "
        "<tool_call> JSON), llama3_json, mistral (default: none; tool_choice auto is then refused)",
    )
    group.add_argument(
        "--reasoning-parser",
        default=None,
        choices=["deepseek_r1", "qwen3"],
        help="the model writes <think>...</think> first: that text goes to reasoning_content / "
        "reasoning_text, and constraints apply after </think> (default: none)",
    )


def _add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """Bounds on what one request or one client may cost; each refusal names its flag."""
    from decode_service.front_door.admission import RequestLimits

    defaults = RequestLimits()
    group = parser.add_argument_group("request limits")
    group.add_argument(
        "--max-id-bytes",
        type=int,
        default=defaults.max_id_bytes,
        help="longest request_id and tenant, in UTF-8 bytes; both must be printable "
        f"(default: {defaults.max_id_bytes})",
    )
    group.add_argument(
        "--max-prompt-bytes",
        type=int,
        default=defaults.max_prompt_bytes,
        help="largest text or chat prompt in UTF-8 bytes, refused before it is tokenized "
        f"(default: {defaults.max_prompt_bytes}, 1 MiB)",
    )
    group.add_argument(
        "--max-stop-strings",
        type=int,
        default=defaults.max_stop_strings,
        help=f"stop strings one request may give (default: {defaults.max_stop_strings})",
    )
    group.add_argument(
        "--max-stop-string-length",
        type=int,
        default=defaults.max_stop_string_length,
        help=f"longest stop string, in characters (default: {defaults.max_stop_string_length})",
    )
    group.add_argument(
        "--max-logit-bias",
        type=int,
        default=defaults.max_logit_bias,
        help=f"logit_bias entries one request may give (default: {defaults.max_logit_bias})",
    )
    group.add_argument(
        "--max-chat-messages",
        type=int,
        default=defaults.max_chat_messages,
        help=f"turns one chat request may hold (default: {defaults.max_chat_messages})",
    )
    group.add_argument(
        "--max-json-objects",
        type=int,
        default=defaults.max_json_objects,
        help=f"JSON objects one HTTP request body may hold (default: {defaults.max_json_objects})",
    )
    group.add_argument(
        "--max-unstreamed-tokens",
        type=int,
        default=defaults.max_unstreamed_tokens,
        help="HTTP: n x max_tokens x (1 + logprobs) a non-streamed answer may hold; larger requests are "
        f"told to stream (default: {defaults.max_unstreamed_tokens})",
    )
    group.add_argument(
        "--max-validation-queue",
        type=int,
        default=16,
        help="large prompts (over 16 KiB) waiting to be tokenized, at most; more get RESOURCE_EXHAUSTED "
        "(default: 16)",
    )
    group.add_argument(
        "--max-stream-buffer",
        type=int,
        default=1024,
        help="messages a stream may hold for a client that is not reading; past it the request is "
        "cancelled and its KV freed (default: 1024)",
    )
    group.add_argument(
        "--max-idle-tenants",
        type=int,
        default=1024,
        help="wfq: idle tenants whose fair-share lead is remembered, at most (default: 1024)",
    )
    group.add_argument(
        "--tenant-header",
        default="",
        help="take each request's tenant from this request header, set by a trusted gateway, instead of "
        "its tenant field (default: the field, which any client chooses)",
    )
    group.add_argument(
        "--priority-header",
        default="",
        help="take each request's priority from this request header, set by a trusted gateway, instead of "
        "its priority field (default: the field, which any client chooses)",
    )


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
        help="prompts with fewer than N tokens left to compute after this replica's prefix cache hit are "
        "prefilled here (default: 0, none)",
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


def service_config_from_args(args: argparse.Namespace) -> DecodeServiceConfig:
    """The validated DecodeServiceConfig the flags describe (reads the auth token file, if any)."""
    from decode_service.config import DecodeServiceConfig, parse_tenant_weights
    from decode_service.front_door.admission import RequestLimits
    from engine.config import parse_memory_size
    from serving.flags import server_settings_from_args

    config = DecodeServiceConfig(
        **server_settings_from_args(args),
        http_port=args.http_port,
        http_max_connections=args.http_max_connections,
        http_read_timeout_s=args.http_read_timeout,
        enable_responses_store=args.enable_responses_store,
        responses_store_bytes=parse_memory_size(args.responses_store_bytes),
        responses_store_ttl_s=args.responses_store_ttl,
        served_model_name=args.served_model_name,
        policy=args.policy,
        tenant_weights=parse_tenant_weights(args.tenant_weights),
        batching=args.batching,
        static_batch_timeout_s=args.static_batch_timeout,
        max_tokens_cap=args.max_tokens_cap,
        max_prefills_per_step=args.max_prefills_per_step,
        stream_interval=args.stream_interval,
        prefill=args.prefill,
        local_prefill_threshold=args.local_prefill_threshold,
        fallback_local=args.fallback_local,
        cache_salt_by_tenant=args.cache_salt_by_tenant,
        prefill_timeout_s=args.prefill_timeout,
        prefill_tls_ca=args.prefill_tls_ca,
        prefill_tls_cert=args.prefill_tls_cert,
        prefill_tls_key=args.prefill_tls_key,
        limits=RequestLimits(
            max_id_bytes=args.max_id_bytes,
            max_prompt_bytes=args.max_prompt_bytes,
            max_stop_strings=args.max_stop_strings,
            max_stop_string_length=args.max_stop_string_length,
            max_logit_bias=args.max_logit_bias,
            max_chat_messages=args.max_chat_messages,
            max_json_objects=args.max_json_objects,
            max_unstreamed_tokens=args.max_unstreamed_tokens,
        ),
        max_validation_queue=args.max_validation_queue,
        max_stream_buffer=args.max_stream_buffer,
        max_idle_tenants=args.max_idle_tenants,
        tenant_header=args.tenant_header.lower(),
        priority_header=args.priority_header.lower(),
        structured_output_compile_timeout_s=args.structured_output_compile_timeout,
        grammar_cache_size=args.grammar_cache_size,
        grammar_cache_memory=parse_memory_size(args.grammar_cache_memory),
        max_grammar_memory=parse_memory_size(args.max_grammar_memory),
        max_compiles_per_tenant=args.max_compiles_per_tenant,
        structured_output_fill_timeout_ms=args.structured_output_fill_timeout_ms,
        chat_template=args.chat_template,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        engine_heartbeat_timeout_s=args.engine_heartbeat_timeout,
        kv_events=kv_events.KVEventsConfig.from_flag(args.kv_events_config, args.host),
    )
    config.validate()
    return config


def run(args: argparse.Namespace) -> int:
    """Start the engine core and the server, serve until SIGTERM/SIGINT, drain; returns the exit status."""
    from decode_service.engine_core.config import CoreSpec
    from decode_service.server import serve
    from engine.engine import Engine
    from engine.model_store import model_fingerprint
    from serving import tracing
    from serving.flags import run_tier

    config = service_config_from_args(args)

    def serve_decode(
        model_dir: Path, engine_config: EngineConfig, metrics_registry: CollectorRegistry
    ) -> Coroutine:
        fingerprint = model_fingerprint(model_dir) if config.disaggregated else None
        if args.engine_in_process:
            engine: Engine | CoreSpec = Engine.from_pretrained(model_dir, engine_config)
        else:
            engine = CoreSpec(
                model_dir,
                engine_config,
                config.core,
                fingerprint,
                args.threads,
                args.log_level,
                args.log_format,
                tracing.exporting_to(),
            )
        return serve(
            engine,
            config,
            model_fingerprint=fingerprint,
            metrics_registry=metrics_registry,
            max_concurrent_streams=args.max_concurrent_streams,
        )

    return run_tier(args, serve_decode)
