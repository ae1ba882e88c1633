"""`tandem bench serve`: load-test one running server over the network, like `vllm bench serve`.

    tandem bench serve --target localhost:50051 --num-prompts 64 --output-len uniform:16:256 \\
        --request-rate 4 --goodput ttft:1000 tpot:100 --result-file result.json

Targets a tandem decode server over gRPC, or with `--backend openai --target http://host:port` any
OpenAI-compatible server (tandem's HTTP API, vLLM, ...), or with `--backend llama-server` llama.cpp's
server through the same OpenAI client. Prints a table and writes the JSON result (see bench.report).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from bench.backends import StreamingBackend
from bench.metrics import compute_metrics, distributions, parse_goodput
from bench.report import command_line, metrics_table, print_table, results_dir, run_result, write_json
from bench.runner import run_load
from bench.workload import (
    ArrivalProcess,
    LengthDistribution,
    SyntheticWorkload,
    WorkloadError,
    WorkloadRequest,
    load_jsonl,
    workload_summary,
)

logger = logging.getLogger(__name__)

DEFAULT_PROMPT_LEN = "uniform:60:330"
DEFAULT_OUTPUT_LEN = "uniform:16:256"


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by `bench serve` and `bench compare`: what to send."""
    parser.add_argument("--num-prompts", type=int, default=64, help="measured requests (default: 64)")
    parser.add_argument(
        "--prompt-len",
        type=LengthDistribution.parse,
        default=LengthDistribution.parse(DEFAULT_PROMPT_LEN),
        help=f"prompt length distribution: fixed:N, uniform:LO:HI or exp:MEAN:CAP "
        f"(default: {DEFAULT_PROMPT_LEN})",
    )
    parser.add_argument(
        "--output-len",
        type=LengthDistribution.parse,
        default=LengthDistribution.parse(DEFAULT_OUTPUT_LEN),
        help=f"exact output length distribution, EOS ignored (default: {DEFAULT_OUTPUT_LEN})",
    )
    parser.add_argument(
        "--dataset-path",
        type=Path,
        default=None,
        help="JSONL of prompts ({'prompt': text | 'prompt_token_ids': [...], 'output_len': N}) instead of "
        "synthetic prompts; missing output_len is drawn from --output-len",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="model dir whose tokenizer encodes JSONL text prompts (default: the default model)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of prompts, lengths, arrivals (default: 0)")
    parser.add_argument(
        "--num-warmups",
        type=int,
        default=2,
        help="requests sent first, not measured (default: 2)",
    )
    parser.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="NAME:MS",
        help="SLOs for goodput in ms, any of ttft:MS tpot:MS e2el:MS",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the flags of `tandem bench serve`."""
    parser.add_argument(
        "--target", default="localhost:50051", help="host:port (openai, llama-server: http://host:port)"
    )
    parser.add_argument(
        "--backend",
        default="tandem",
        choices=["tandem", "openai", "llama-server"],
        help="tandem: gRPC; openai: any OpenAI-compatible HTTP server, tandem's included (default: tandem)",
    )
    parser.add_argument("--label", default=None, help="system name in the table and JSON (default: backend)")
    add_workload_arguments(parser)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson/gamma arrivals (default: inf, all at once)",
    )
    parser.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of inter-arrival gaps (1: Poisson)"
    )
    parser.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    parser.add_argument(
        "--server-threads",
        type=int,
        default=None,
        help="torch threads the server runs with, recorded in the JSON (the client cannot see it)",
    )
    parser.add_argument("--result-file", type=Path, default=results_dir() / "serve.json")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def make_backend(kind: str, target: str, label: str | None = None) -> StreamingBackend:
    url = target if target.startswith("http") else f"http://{target}"
    if kind == "llama-server":
        from bench.backends.llama_server import LlamaServerBackend

        return LlamaServerBackend(url, label or kind)
    if kind == "openai":
        from bench.backends.openai_http import OpenAIBackend

        return OpenAIBackend(url, label or kind)
    from bench.backends.tandem_grpc import TandemBackend

    return TandemBackend(target, label or kind)


@dataclass(frozen=True)
class Workload:
    """Measured and warm-up requests, and how they were made (for the result file)."""

    requests: list[WorkloadRequest]
    warmups: list[WorkloadRequest]
    description: dict


def build_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    """The requests `args` describe; warm-ups are extra requests from a different seed, same shapes."""
    if args.dataset_path is not None:
        from engine.model_store import resolve_model
        from engine.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_pretrained(resolve_model(args.tokenizer))
        requests = load_jsonl(args.dataset_path, tokenizer, args.output_len, args.seed, args.num_prompts)
        warmups = requests[: args.num_warmups]
        description = {"source": str(args.dataset_path), "output_len_default": str(args.output_len)}
    else:
        spec = SyntheticWorkload(args.num_prompts, args.prompt_len, args.output_len, vocab_size, args.seed)
        requests = spec.requests()
        warm_spec = SyntheticWorkload(
            args.num_warmups, args.prompt_len, LengthDistribution.parse("fixed:8"), vocab_size, args.seed + 1
        )
        warmups = warm_spec.requests() if args.num_warmups else []
        description = spec.describe()
    return Workload(requests, warmups, {**description, **workload_summary(requests)})


async def measure(
    backend: StreamingBackend,
    args: argparse.Namespace,
    arrivals: ArrivalProcess,
    show_progress: bool,
    system_extra: dict | None = None,
    workload: Workload | None = None,
    max_concurrency: int | None = None,
) -> dict:
    """Open `backend`, run the workload (`args`' unless given) at `arrivals`, close; returns one run's
    result object."""
    server_info = await backend.open()
    try:
        if workload is None:
            vocab_size = server_info.get("vocab_size")
            if not vocab_size and args.dataset_path is None:
                raise WorkloadError(f"{backend.name} did not report its vocabulary size; use --dataset-path")
            workload = build_workload(args, vocab_size or 0)
        load = await run_load(
            backend,
            workload.requests,
            arrivals,
            max_concurrency,
            workload.warmups,
            show_progress,
        )
    finally:
        await backend.close()
    slos = parse_goodput(args.goodput)
    system = {"name": backend.name, **server_info, **(system_extra or {})}
    arrival_info = {
        **arrivals.describe(),
        "max_concurrency": max_concurrency,
        "warmups": len(workload.warmups),
    }
    result = run_result(
        system,
        workload.description,
        arrival_info,
        compute_metrics(load.records, load.duration_s, slos),
        distributions(load.records),
    )
    result["client"] = {
        "cpu_s": round(load.client_cpu_s, 2),
        "cpu_share": round(load.client_cpu_s / load.duration_s, 3),
    }
    return result


def run(args: argparse.Namespace) -> int:
    """Entry of `tandem bench serve`: measure, print the table, write the JSON."""
    from bench.machine import machine_info

    backend = make_backend(args.backend, args.target, args.label)
    arrivals = ArrivalProcess(args.request_rate, args.burstiness, args.seed)
    extra = {"server_threads": args.server_threads} if args.server_threads else {}
    machine = machine_info()
    result = asyncio.run(
        measure(backend, args, arrivals, not args.no_progress, extra, max_concurrency=args.max_concurrency)
    )
    print_table(metrics_table([result], title=f"tandem bench serve: {backend.name}"))
    path = write_json(
        args.result_file, {"benchmark": "serve", "machine": machine, "command": command_line(), **result}
    )
    logger.info("wrote %s", path)
    return 0 if result["metrics"]["failed"] == 0 else 1
