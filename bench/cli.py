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
    ("compare", "bench.compare", "every peer on the same workload back to back, ratios printed, plots drawn"),
    (
        "multi-turn",
        "bench.multi_turn",
        "multi-turn chat with history resent: prefix cache on vs off, llama-server",
    ),
    (
        "replicas",
        "bench.replicas",
        "two decode replicas, one prefill tier: prefix-affine client against round robin, a replica killed",
    ),
    ("occupancy", "bench.occupancy", "batch-occupancy timeline, static vs continuous, from the event log"),
    ("chunked-prefill", "bench.chunked_prefill", "ITL of running streams while a long prompt is prefilled"),
    (
        "structured-output",
        "bench.structured_output",
        "ITL of JSON-schema-constrained vs unconstrained streams, grammar costs, jump-forward potential",
    ),
    ("probe", "bench.roofline", "memory bandwidth and matmul FLOP/s; the workload's tokens/s upper bound"),
    (
        "linear-kernels",
        "bench.linear_kernels",
        "the CPU linear kernels (fp32 / int8 weights, GEMV / GEMM) on the model's projections: µs and GB/s",
    ),
    (
        "serving-path",
        "bench.serving_path",
        "server CPU per generated token with a near-zero-cost model: the serving path's own cost",
    ),
    (
        "quantized",
        "bench.quantized",
        "tandem fp32 / int8 / int8 + int8 KV against llama-server F32 and Q8_0: one run, the README table",
    ),
    (
        "ladder",
        "bench.model_ladder",
        "0.5 B / 3 B / 8 B Llama shapes: start time, memory, decode of tandem and llama-server, same weights",
    ),
    (
        "gemma",
        "bench.gemma",
        "Gemma 3 270M: tandem int8 against llama-server on the same Q4_K_M GGUF, completions",
    ),
    (
        "speculative",
        "bench.speculative",
        "n-gram speculative decoding on four held-out chat workloads, against plain decoding and llama.cpp",
    ),
    (
        "memory",
        "bench.memory",
        "every resident MiB of one idle int8 decode server (both processes), against llama-server's",
    ),
    (
        "request-files",
        "bench.request_files",
        "the repository's files one aggregated gRPC Generate executes, in both server processes",
    ),
    (
        "slow-front-door",
        "bench.slow_front_door",
        "core steps while the front door stops reading its replies for 2 s, inline writes vs the writer",
    ),
    ("perf-report", "bench.perf_report", "issue 17's figures in one run, each against its target"),
    ("profile", "bench.profile_decode", "profile decode steps on the headline workload: where time goes"),
    ("plots", "bench.plots", "redraw the PNGs and the README table from the JSON results"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Attach the `bench` subcommands to `parser`; each sets `handler` to its module's `run`."""
    commands = parser.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND", required=True)
    for name, module_name, help_text in BENCH_COMMANDS:
        module = importlib.import_module(module_name)
        sub = commands.add_parser(
            name,
            help=help_text,
            description=(module.__doc__ or help_text).strip(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(handler=module.run)
