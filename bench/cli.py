"""`tandem bench ...`: the benchmark subcommands, declared here so `tandem/cli.py` only delegates.

Declaring flags imports nothing heavy (each module's `add_arguments` is imported when the parser is
built, and those modules keep torch, gRPC and matplotlib imports inside their `run`), so `tandem --help`
stays fast.
"""

from __future__ import annotations

import argparse
import importlib

# (subcommand, module with add_arguments(parser) and run(args) -> int, help)
BENCH_COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("serve", "bench.serve", "load-test one running server (tandem or llama-server), like vllm bench serve"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Attach the `bench` subcommands to `parser`; each sets `handler` to its module's `run`."""
    commands = parser.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND", required=True)
    for name, module_name, help_text in BENCH_COMMANDS:
        module = importlib.import_module(module_name)
        sub = commands.add_parser(
            name, help=help_text, description=(module.__doc__ or help_text).strip(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(handler=module.run)
