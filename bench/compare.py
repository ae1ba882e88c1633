"""`tandem bench compare`: tandem and its peers on the same workload, same machine, back to back.

Systems (each measured alone, one after another; servers as their own processes with explicit thread
counts):

- `hf-static`      transformers `generate`, static batches of --hf-batch-size (the baseline);
- `hf-continuous`  transformers' continuous-batching manager (when the installed version has it);
- `tandem-static`  `tandem serve decode --batching static`;
- `tandem-aggregated`  one decode server, chunked prefill mixed into decode steps;
- `tandem-aggregated-http`  the same server measured through its OpenAI-compatible HTTP API, by the
                   OpenAI backend that also measures llama-server (the HTTP path's cost vs gRPC);
- `tandem-disaggregated`  a prefill server and a decode server;
- `tandem-aggregated-int8`, `tandem-aggregated-int8-kv-int8`  the aggregated server with int8 weights
                   (`--quantization int8`), and with the int8 KV cache too (`--kv-cache-dtype int8`);
- `tandem-aggregated-in-process`  the aggregated server with its engine core on a thread of the server
                   process (`--engine-in-process`), the shape before issue 23;
- `llama-server`   llama.cpp, `-np 16 -cb`, on the F32 GGUF of the same Q4_1 weights (needs
                   `python -m bench.llama_cpp_build` once);
- `llama-server-q8_0`  the same on the Q8_0 GGUF (`--no-repack`), what CPU users of llama.cpp run.

The headline workload (all requests at once) runs on every system; then a rate sweep runs on the
server systems with the first --sweep-prompts requests of the same workload, Poisson arrivals. A
system that cannot run is skipped with its reason printed and recorded. Writes
`<out-dir>/compare.json`, prints the table with ratios to hf-static, then draws the plots.

    tandem bench compare [--out-dir DIR]     # default: bench.report.results_dir()
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from base.errors import TandemError
from bench.report import results_dir
from bench.serve import Workload, add_workload_arguments, build_workload, make_backend, measure
from bench.servers import ServerStartError
from bench.session import SystemSkipped
from bench.workload import ArrivalProcess, workload_summary

logger = logging.getLogger(__name__)

SYSTEMS = (
    "hf-static",
    "hf-continuous",
    "tandem-static",
    "tandem-aggregated",
    "tandem-aggregated-http",
    "tandem-disaggregated",
    "tandem-aggregated-int8",
    "tandem-aggregated-int8-kv-int8",
    "tandem-aggregated-in-process",
    "llama-server",
    "llama-server-q8_0",
)
# The server flags of each variant of the aggregated server.
AGGREGATED_FLAGS = {
    "tandem-aggregated": [],
    "tandem-aggregated-int8": ["--quantization", "int8"],
    "tandem-aggregated-int8-kv-int8": ["--quantization", "int8", "--kv-cache-dtype", "int8"],
    "tandem-aggregated-in-process": ["--engine-in-process"],
}
SWEEP_SYSTEMS = ("tandem-static", "tandem-aggregated", "tandem-disaggregated", "llama-server")
BASELINE = "hf-static"


def add_decode_args(parser: argparse.ArgumentParser, what: str = "every tandem server") -> None:
    """`--decode-args`: the benches that start tandem decode servers take extra server flags this way."""
    parser.add_argument(
        "--decode-args",
        default="",
        metavar="ARGS",
        help=f"more `tandem serve decode` flags for {what}, one shell-quoted string",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model dir (default: the cached default model)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list (default: all: {SYSTEMS})")
    parser.add_argument(
        "--sweep-systems", default=",".join(SWEEP_SYSTEMS), help="systems of the rate sweep (server systems)"
    )
    parser.add_argument(
        "--rates",
        default="0.25,0.5,1",
        help="request rates of the sweep, req/s ('' for none; default: "
        "0.25,0.5,1 — around where the default workload saturates a 2-core CPU)",
    )
    parser.add_argument(
        "--sweep-prompts", type=int, default=32, help="requests per sweep point (default: 32)"
    )
    parser.add_argument("--threads", type=int, default=2, help="threads of each system (default: 2)")
    parser.add_argument("--hf-batch-size", type=int, default=32, help="HF static batch size (default: 32)")
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=64,
        help="tandem and HF-continuous batch size cap (default: 64, every request of the headline at once)",
    )
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=512, help="tandem and HF-continuous tokens per step"
    )
    parser.add_argument("--kv-cache-memory", default="2GiB", help="tandem's KV pool (default: 2GiB)")
    add_decode_args(parser)
    parser.add_argument("--llama-parallel", type=int, default=16, help="llama-server slots (default: 16)")
    parser.add_argument("--llama-context", type=int, default=16384, help="llama-server total context")
    add_workload_arguments(parser)
    parser.add_argument("--out-dir", type=Path, default=results_dir())
    parser.add_argument(
        "--update",
        action="store_true",
        help="re-measure only --systems and keep the other systems' runs from the existing compare.json "
        "(same workload required); each measuring session is recorded",
    )
    parser.add_argument("--no-plots", action="store_true", help="write the JSON only")
    parser.add_argument("--no-progress", action="store_true")


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = set(names) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems: {', '.join(sorted(unknown))} (known: {', '.join(SYSTEMS)})")
    return names


@dataclass
class Comparison:
    """Everything a compare run gathers, in the shape written to compare.json."""

    config: dict
    workload: dict = field(default_factory=dict)
    runs: list[dict] = field(default_factory=list)
    sweep_workload: dict = field(default_factory=dict)
    sweep: list[dict] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    physical_limit: dict | None = None


def _tandem_server_args(args: argparse.Namespace, batching: str) -> list[str]:
    return [
        "--batching",
        batching,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--kv-cache-memory",
        args.kv_cache_memory,
        *shlex.split(args.decode_args),
    ]


@contextlib.contextmanager
def serving(name: str, args: argparse.Namespace, model: str) -> Iterator[tuple[str, str, dict]]:
    """Start system `name`; yields (backend kind, target, system description)."""
    from bench import servers

    if name in ("tandem-static", "tandem-aggregated-http", *AGGREGATED_FLAGS):
        batching = "static" if name == "tandem-static" else "continuous"
        server_args = _tandem_server_args(args, batching) + AGGREGATED_FLAGS.get(name, [])
        http_port = servers.free_port() if name.endswith("-http") else None
        if http_port is not None:
            server_args += ["--http-port", str(http_port)]
        decode, target = servers.tandem_decode_server(name, model, args.threads, server_args)
        with decode:
            description = {"threads": {"decode": args.threads}, "server_args": server_args}
            if http_port is None:
                yield "tandem", target, description
            else:
                yield "openai", f"http://127.0.0.1:{http_port}", description
    elif name == "tandem-disaggregated":
        # Two processes share the cores: split the threads between them.
        prefill_threads = max(1, args.threads // 2)
        decode_threads = max(1, args.threads - prefill_threads)
        prefill, prefill_target = servers.tandem_prefill_server(
            f"{name}-prefill",
            model,
            prefill_threads,
            ["--max-num-batched-tokens", str(args.max_num_batched_tokens)],
        )
        server_args = _tandem_server_args(args, "continuous")
        decode, target = servers.tandem_decode_server(
            f"{name}-decode", model, decode_threads, server_args, prefill_target
        )
        with servers.running(prefill, decode):
            threads = {"prefill": prefill_threads, "decode": decode_threads}
            yield "tandem", target, {"threads": threads, "server_args": server_args}
    elif name in ("llama-server", "llama-server-q8_0"):
        from bench.llama_cpp_build import default_tools

        tools = default_tools()
        if not tools.is_ready():
            raise SystemSkipped(f"llama.cpp not built in {tools.root}: run `python -m bench.llama_cpp_build`")
        gguf = tools.q8_0_model if name == "llama-server-q8_0" else tools.f32_model
        server, url = servers.llama_server(
            name, tools.server, gguf, args.threads, args.llama_parallel, args.llama_context
        )
        with server:
            manifest = json.loads(tools.manifest.read_text()) if tools.manifest.is_file() else {}
            yield (
                "llama-server",
                url,
                {
                    "threads": {"server": args.threads},
                    "parallel": args.llama_parallel,
                    "context": args.llama_context,
                    "gguf": gguf.name,
                    "build": manifest.get("sdist"),
                },
            )
    else:
        raise ValueError(name)


def _hf_run(name: str, args: argparse.Namespace, model_dir: Path, workload: Workload, hf_cache: dict) -> dict:
    """Run an in-process HF peer on the headline workload; returns a run result like `measure`'s."""
    import torch
    import transformers

    from bench import hf_peers
    from bench.metrics import compute_metrics, distributions, parse_goodput
    from bench.report import run_result

    torch.set_num_threads(args.threads)
    if "model" not in hf_cache:
        hf_cache["model"] = hf_peers.load_hf_model(model_dir)
    model = hf_cache["model"]
    if name == "hf-static":
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        peer = hf_peers.run_hf_static(model, workload.requests, args.hf_batch_size, pad)
    else:
        if not hf_peers.continuous_batching_available(model):
            raise SystemSkipped("this transformers has no continuous-batching manager")
        peer = hf_peers.run_hf_continuous(
            model, workload.requests, args.max_num_seqs, args.max_num_batched_tokens
        )
    system = {
        "name": name,
        **peer.info,
        "threads": {"process": args.threads},
        "transformers": transformers.__version__,
        "model_name": model_dir.name,
    }
    arrivals = {**ArrivalProcess().describe(), "max_concurrency": None, "warmups": 1}
    metrics = compute_metrics(peer.records, peer.duration_s, parse_goodput(args.goodput))
    return run_result(system, workload.description, arrivals, metrics, distributions(peer.records))


def _measure_server(
    kind: str, target: str, name: str, args: argparse.Namespace, rate: float, workload: Workload, extra: dict
) -> dict:
    backend = make_backend(kind, target, name)
    arrivals = ArrivalProcess(rate, 1.0, args.seed)
    result = asyncio.run(measure(backend, args, arrivals, not args.no_progress, extra, workload))
    logger.info(
        "%s @ %s req/s: %.1f output tok/s",
        name,
        result["arrivals"]["request_rate"],
        result["metrics"]["output_throughput"],
    )
    return result


def run_comparison(args: argparse.Namespace, on_progress: Callable[[Comparison], None]) -> Comparison:
    from bench.roofline import ModelShape, WorkloadCost, probe_machine, throughput_bound
    from engine.model_store import resolve_model

    model_dir = resolve_model(args.model)
    shape = ModelShape.from_config_file(model_dir / "config.json")
    workload = build_workload(args, shape.vocab)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    sweep_requests = workload.requests[: args.sweep_prompts]
    sweep_workload = Workload(
        sweep_requests,
        workload.warmups,
        {**workload.description, **workload_summary(sweep_requests), "first_of_headline_requests": True},
    )
    comparison = Comparison(
        config={
            "model": model_dir.name,
            "dtype": "float32",
            "threads": args.threads,
            "hf_batch_size": args.hf_batch_size,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "llama_parallel": args.llama_parallel,
            "rates": rates,
            "baseline": BASELINE,
        },
        workload=workload.description,
        sweep_workload=sweep_workload.description,
    )
    cost = WorkloadCost([r.prompt_len for r in workload.requests], [r.output_len for r in workload.requests])
    comparison.physical_limit = throughput_bound(
        shape, probe_machine(args.threads, shape), cost, args.max_num_seqs
    )
    on_progress(comparison)  # a result file that cannot be written (or merged) fails before any run
    hf_cache: dict = {}
    sweep_systems = set(_names(args.sweep_systems))
    for name in _names(args.systems):
        try:
            if name.startswith("hf-"):
                comparison.runs.append(_hf_run(name, args, model_dir, workload, hf_cache))
            else:
                with serving(name, args, str(model_dir)) as (kind, target, extra):
                    point = (kind, target, name, args)
                    comparison.runs.append(_measure_server(*point, math.inf, workload, extra))
                    on_progress(comparison)
                    for rate in rates if name in sweep_systems else []:
                        comparison.sweep.append(_measure_server(*point, rate, sweep_workload, extra))
                        on_progress(comparison)
        except (SystemSkipped, ServerStartError) as exc:
            # One system that cannot run must not cost the numbers of all the others.
            logger.warning("skipping %s: %s", name, exc)
            comparison.skipped[name] = str(exc)
        on_progress(comparison)
    return comparison


def _session(document: dict, systems: list[str]) -> dict:
    return {"systems": systems, "machine": document["machine"], "command": document["command"]}


def best_physical_limit(previous: dict, current: dict) -> dict | None:
    """Of two sessions' probes, the one with the higher bound: other processes on a shared machine only
    ever make the probe slower, so the faster one is closer to what the machine can do."""
    limits = [d["physical_limit"] for d in (previous, current) if d.get("physical_limit")]
    return max(limits, key=lambda limit: limit["output_tok_s_bound"], default=None)


def merge_documents(previous: dict, current: dict, measured: list[str]) -> dict:
    """`current` with the runs of the systems it did not measure taken from `previous`.

    Both must describe the same workload, or the ratios between their runs would mean nothing.
    """
    if previous.get("workload") != current["workload"]:
        raise TandemError("--update needs the same workload as the existing compare.json (seed, lengths...)")
    order = {name: index for index, name in enumerate(SYSTEMS)}

    def rank(name: str) -> int:
        return order.get(name, len(order))

    def merged(key: str) -> list[dict]:
        kept = [run for run in previous.get(key, []) if run["system"]["name"] not in measured]
        return sorted(kept + current[key], key=lambda run: rank(run["system"]["name"]))

    earlier_systems = sorted({run["system"]["name"] for run in previous.get("runs", [])}, key=rank)
    sessions = previous.get("sessions") or [_session(previous, earlier_systems)]
    skipped = {k: v for k, v in previous.get("skipped", {}).items() if k not in measured}
    return {
        **current,
        "physical_limit": best_physical_limit(previous, current),
        "runs": merged("runs"),
        "sweep": merged("sweep"),
        "skipped": {**skipped, **current["skipped"]},
        "sessions": [*sessions, _session(current, measured)],
    }


def run(args: argparse.Namespace) -> int:
    from bench.machine import load_average, machine_info
    from bench.report import command_line, metrics_table, print_table, write_json

    machine = machine_info()
    path = args.out_dir / "compare.json"
    previous = json.loads(path.read_text()) if args.update and path.is_file() else None
    document: dict = {}

    def save(comparison: Comparison) -> None:
        # Written after every system, so a long run interrupted late still leaves its numbers; the load
        # average at each write shows how busy the shared machine was along the way.
        nonlocal document
        document = {
            "benchmark": "compare",
            "machine": machine,
            "load_average_at_write": load_average(),
            "command": command_line(),
            "config": comparison.config,
            "workload": comparison.workload,
            "physical_limit": comparison.physical_limit,
            "skipped": comparison.skipped,
            "runs": comparison.runs,
            "sweep_workload": comparison.sweep_workload,
            "sweep": comparison.sweep,
        }
        if previous is not None:
            document = merge_documents(previous, document, _names(args.systems))
        write_json(path, document)

    run_comparison(args, save)
    print_table(metrics_table(document["runs"], "tandem bench compare (all requests at once)", BASELINE))
    if document["sweep"]:
        print_table(metrics_table(document["sweep"], "rate sweep"))
    for name, reason in document["skipped"].items():
        print(f"skipped {name}: {reason}")
    if not args.no_plots:
        from bench.plots import draw_comparison

        for written in draw_comparison(path, args.out_dir):
            logger.info("wrote %s", written)
    logger.info("wrote %s", path)
    return 0
