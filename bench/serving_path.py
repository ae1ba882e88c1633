"""`tandem bench serving-path`: what the server itself spends per generated token, with a model that costs
next to nothing.

    tandem bench serving-path [--streams 128 --output-len 128 --stream-interval 1 --profile]

Writes a near-zero-cost model (3 layers of width 64, a vocabulary of the real SmolLM2 tokenizer's first
1,024 ids, random weights; see bench.near_zero_model), starts `tandem serve decode` on it in its own
process, and sends `--streams` greedy requests of exactly `--output-len` tokens all at once, `--rounds`
times after a warm-up. For each round it reads the CPU seconds of the server process and the processes
under it (the engine core) from the OS before and after (so the figure is the server's whole cost:
engine loop, asyncio loop, gRPC threads, both processes) and reports:

- server CPU per token (µs; the same number is ms per 1,000 tokens) and per thread;
- served tokens per second (wall clock: moves with the machine's load, unlike CPU time);
- the load generator's own CPU per token (it shares the machine with the server).

In the same rounds, alternating with tandem's, the same client drives a bare grpc.aio server
(bench.serving_bounds) that only writes one-token messages: the summary sets tandem's rate and CPU beside
its messages/s and CPU per message, issue 23's targets.

Then it splits the figure (bench.engine_floor): the engine loop alone, one decode step, the forward,
the LM head with the sampler, measured in this process on the same model and batch; and the floors
under it (bench.serving_bounds): the LM head at this core's GEMM peak, and what a bare grpc.aio server
spends per stream message. `--profile` adds a round under py-spy (every thread) and one sampling only
the GIL holder (bench.pyspy_profile).

`--api http` drives the OpenAI-compatible HTTP API instead of gRPC, when the server has one
(`tandem serve decode --http-port`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench.backends import StreamingBackend
from bench.near_zero_model import NearZeroModelSpec
from bench.report import results_dir
from bench.workload import ArrivalProcess, LengthDistribution, SyntheticWorkload, WorkloadRequest

if TYPE_CHECKING:
    from bench.servers import ServerProcess

logger = logging.getLogger(__name__)

PROMPT_LEN = 16
KV_CACHE_MEMORY = "64MiB"
# The model's default vocabulary: the first ids of the real tokenizer. With SmolLM2's whole 49,152 the LM
# head alone costs more per token on this CPU than a bare grpc.aio server spends per message, so the
# model would not be near zero; `--vocab-size 0` keeps the whole vocabulary.
NEAR_ZERO_VOCAB = 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the flags of `tandem bench serving-path`."""
    parser.add_argument("--streams", type=int, default=128, help="requests sent at once (default: 128)")
    parser.add_argument("--output-len", type=int, default=128, help="tokens per request (default: 128)")
    parser.add_argument("--prompt-len", type=int, default=PROMPT_LEN, help=f"(default: {PROMPT_LEN})")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds, median reported (default: 3)")
    parser.add_argument("--api", default="grpc", choices=["grpc", "http"], help="which API to drive")
    parser.add_argument("--stream-interval", type=int, default=1, help="the server's --stream-interval")
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads (default: 1)")
    parser.add_argument(
        "--server-args", default="", help="more `tandem serve decode` flags, one shell-quoted string"
    )
    parser.add_argument(
        "--tokenizer-model",
        default=None,
        help="checkpoint dir whose tokenizer (and vocabulary size) the model gets (default: the cached "
        "SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=NEAR_ZERO_VOCAB,
        help=f"the model's vocabulary, the first N ids of the tokenizer (default: {NEAR_ZERO_VOCAB}, or all "
        "of them if fewer; 0: all of them)",
    )
    parser.add_argument("--label", default="tandem", help="name of this run in the JSON (e.g. before/after)")
    parser.add_argument("--no-floor", action="store_true", help="skip the in-process engine-alone split")
    parser.add_argument("--profile", action="store_true", help="add py-spy rounds: all threads, GIL holder")
    parser.add_argument("--result-file", type=Path, default=results_dir() / "serving_path.json")


def _server_supports(flag: str) -> bool:
    from bench.servers import tandem_command

    help_text = subprocess.run(
        tandem_command("serve", "decode", "--help"), capture_output=True, text=True, timeout=120, check=False
    ).stdout
    return flag in help_text


def _server_args(args: argparse.Namespace, http_port: int | None) -> list[str]:
    streams = str(args.streams)
    flags = [
        "--max-num-seqs",
        streams,
        "--max-num-batched-tokens",
        str(max(512, args.streams)),
        "--max-queue",
        streams,
        "--kv-cache-memory",
        KV_CACHE_MEMORY,
        "--stream-interval",
        str(args.stream_interval),
        *shlex.split(args.server_args),
    ]
    if http_port is not None:
        flags += ["--http-port", str(http_port)]
    return flags


def _backend(api: str, grpc_target: str, http_port: int | None) -> StreamingBackend:
    if api == "http":
        from bench.backends.openai_http import OpenAIBackend

        return OpenAIBackend(f"http://127.0.0.1:{http_port}", "tandem-http")
    from bench.backends.tandem_grpc import TandemBackend

    return TandemBackend(grpc_target, "tandem-grpc")


async def _measure_round(backend: StreamingBackend, requests: list[WorkloadRequest], pid: int) -> dict:
    from bench.metrics import compute_metrics
    from bench.process_cpu import descendants, thread_cpu_delta, thread_cpu_seconds, tree_cpu_seconds
    from bench.runner import run_load

    processes = [pid, *descendants(pid)]
    threads_before = {p: thread_cpu_seconds(p) for p in processes}
    server_before = tree_cpu_seconds(pid)
    load = await run_load(backend, requests, ArrivalProcess(math.inf), show_progress=False)
    server_cpu_s = tree_cpu_seconds(pid) - server_before
    threads = [
        {**row, "process": "server" if p == pid else f"child {p}"}
        for p in processes
        for row in thread_cpu_delta(threads_before[p], thread_cpu_seconds(p), p)
    ]
    tokens = sum(record.output_len for record in load.records)
    messages = sum(len(record.chunk_tokens) for record in load.records)
    failed = [record.error for record in load.records if not record.ok]
    if failed:
        logger.warning("%d requests failed, e.g. %s", len(failed), failed[0])
    metrics = compute_metrics(load.records, load.duration_s, [])
    return {
        "tokens": tokens,
        "failed": len(failed),
        "wall_s": round(load.duration_s, 3),
        "served_tok_s": round(tokens / load.duration_s, 1),
        "server_cpu_s": round(server_cpu_s, 3),
        "server_cpu_us_per_token": round(1e6 * server_cpu_s / max(tokens, 1), 1),
        # Above 1 when writers fell behind and sent the tokens that piled up in one message.
        "tokens_per_message": round(tokens / max(messages, 1), 3),
        "server_cpu_us_per_message": round(1e6 * server_cpu_s / max(messages, 1), 1),
        "server_cores_busy": round(server_cpu_s / load.duration_s, 2),
        "client_cpu_us_per_token": round(1e6 * load.client_cpu_s / max(tokens, 1), 1),
        "server_threads_cpu_s": sorted(threads, key=lambda row: row["cpu_s"], reverse=True)[:8],
        "ttft_ms_p50": metrics["ttft_ms"]["p50"],
        "itl_ms_p50": metrics["itl_ms"]["p50"],
    }


async def _profiled_round(
    backend: StreamingBackend, requests: list[WorkloadRequest], pid: int, gil_only: bool
) -> dict:
    from bench.pyspy_profile import PySpyRecording, summarize
    from bench.runner import run_load

    recording = PySpyRecording(pid, gil_only=gil_only)
    recording.start()
    await asyncio.sleep(1.0)  # py-spy attaches before the round starts
    started = time.perf_counter()
    await run_load(backend, requests, ArrivalProcess(math.inf), show_progress=False)
    duration = time.perf_counter() - started
    return summarize(recording.stop(), duration, recording.rate_hz)


async def _drive(
    args: argparse.Namespace, servers: dict[str, tuple[StreamingBackend, int]], requests, warmups
) -> dict[str, dict]:
    """Warm every server up, then run the rounds alternating between them (tandem's round 1, the bare
    server's round 1, ...), so that a drift of the machine's speed during the run reaches both alike;
    `--profile` rounds come after, for the first server only."""
    from bench.runner import warm_up

    driven: dict[str, dict] = {}
    try:
        for name, (backend, _) in servers.items():
            driven[name] = {"server": await backend.open(), "rounds": [], "profile": {}}
            await warm_up(backend, warmups, "warmup")
        for index in range(args.rounds):
            for name, (backend, pid) in servers.items():
                driven[name]["rounds"].append(await _measure_round(backend, requests, pid))
                row = {k: v for k, v in driven[name]["rounds"][-1].items() if k != "server_threads_cpu_s"}
                logger.info("%s round %d: %s", name, index + 1, json.dumps(row))
        if args.profile:
            name, (backend, pid) = next(iter(servers.items()))
            profiles = driven[name]["profile"]
            profiles["all_threads"] = await _profiled_round(backend, requests, pid, gil_only=False)
            profiles["gil_holder"] = await _profiled_round(backend, requests, pid, gil_only=True)
    finally:
        for backend, _ in servers.values():
            await backend.close()
    return driven


def _bare_server() -> tuple[ServerProcess, str]:
    """A bare grpc.aio server that writes prebuilt one-token messages back to back (bench.serving_bounds,
    `--step-ms 0`), driven by the same client and streams as tandem: the messages/s and CPU per message
    this stack reaches with no serving work at all."""
    from bench.servers import ServerProcess, free_port, grpc_healthy, thread_env

    port = free_port()
    target = f"127.0.0.1:{port}"
    server = ServerProcess(
        "bare-grpc",
        [sys.executable, "-m", "bench.serving_bounds", "--port", str(port), "--step-ms", "0"],
        lambda: grpc_healthy(target),
        thread_env(1),
    )
    return server, target


def _bare_summary(rounds: list[dict]) -> dict:
    return {
        "msgs_per_s": _median(rounds, "served_tok_s"),
        "cpu_us_per_message": _median(rounds, "server_cpu_us_per_token"),
        "rounds": rounds,
    }


def split_server_cpu(server_cpu_us_per_token: float, floor: dict) -> dict[str, float]:
    """The served figure in layers (µs per token): the model's math (the forward, then its LM head and
    the sampler), the engine thread's Python around it, and the edge (asyncio, gRPC
    or HTTP messages); `serving_path_own` is the last two, what the server adds to the model's work.

    The split matters because the "near-zero" model is not near zero where it is vocabulary-sized: with
    the whole vocabulary (`--vocab-size 0`) its 49k x 64 LM head is a compute-bound matmul of ~0.8 GFLOP
    per 128-token step on this CPU, work a GPU deployment does on the device, not on the CPU the serving
    path runs on.
    """
    step = floor["decode_step_cpu_us_per_token"]
    model_math = step["forward_with_prepare"] + step["lm_head_and_sampler"]
    engine_loop = floor["engine_loop_alone"]["cpu_us_per_token"]
    return {
        "engine_loop_alone_cpu_us_per_token": engine_loop,
        "model_math_cpu_us_per_token": round(model_math, 1),
        "engine_python_cpu_us_per_token": round(engine_loop - model_math, 1),
        "edge_cpu_us_per_token": round(server_cpu_us_per_token - engine_loop, 1),
        "serving_path_own_cpu_us_per_token": round(server_cpu_us_per_token - model_math, 1),
    }


def _measure_bounds(args: argparse.Namespace, model_dir: Path, step_ms: float) -> dict:
    """The floors under the figure (bench.serving_bounds): the LM head at this core's GEMM peak, and
    for gRPC what a bare grpc.aio server spends per stream message when each stream gets one every
    `step_ms` (the served run's inter-token latency: grpc's cost per message grows with the gap)."""
    from bench.serving_bounds import grpc_write_floor, lm_head_floor

    config = json.loads((model_dir / "config.json").read_text())
    lm_head = lm_head_floor(args.streams, config["hidden_size"], config["vocab_size"], args.threads)
    bounds = {"lm_head": lm_head}
    if args.api == "grpc":
        bounds["grpc_write"] = grpc_write_floor(args.streams, args.output_len, step_ms=round(step_ms, 2))
    return bounds


def _median(rounds: list[dict], key: str, digits: int = 1) -> float:
    return round(statistics.median(r[key] for r in rounds), digits)


def run(args: argparse.Namespace) -> int:
    """Entry of `tandem bench serving-path`: model, server, rounds, split, JSON."""
    from bench.machine import load_average, machine_info
    from bench.near_zero_model import tokenizer_source, write_near_zero_model
    from bench.plots import draw_serving_path
    from bench.report import command_line, write_json
    from bench.servers import free_port, running, tandem_decode_server
    from engine.config import parse_memory_size

    http_port = None
    if args.api == "http":
        if not _server_supports("--http-port"):
            logger.error("this build's decode server has no HTTP API (--http-port); use --api grpc")
            return 2
        http_port = free_port()
    machine = machine_info()
    spec = NearZeroModelSpec(vocab_size=args.vocab_size or None)
    tokenizer_model = tokenizer_source(args.tokenizer_model)
    with tempfile.TemporaryDirectory(prefix="tandem-near-zero-") as scratch:
        model_dir = write_near_zero_model(Path(scratch) / "model", tokenizer_model, spec)
        vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        workload = SyntheticWorkload(
            args.streams,
            LengthDistribution.parse(f"fixed:{args.prompt_len}"),
            LengthDistribution.parse(f"fixed:{args.output_len}"),
            vocab_size,
            seed=0,
        )
        requests = workload.requests()
        warmups = SyntheticWorkload(
            args.streams, workload.prompt_len, LengthDistribution.parse("fixed:8"), vocab_size, seed=1
        ).requests()
        server, target = tandem_decode_server(
            "serving-path-decode", str(model_dir), args.threads, _server_args(args, http_port)
        )
        with contextlib.ExitStack() as started:
            started.enter_context(running(server))
            servers = {"tandem": (_backend(args.api, target, http_port), server.pid)}
            if args.api == "grpc":
                from bench.backends.tandem_grpc import TandemBackend

                bare_server, bare_target = _bare_server()
                started.enter_context(running(bare_server))
                servers["bare-grpc"] = (TandemBackend(bare_target, "bare-grpc"), bare_server.pid)
            both = asyncio.run(_drive(args, servers, requests, warmups))
        driven = both["tandem"]
        bare = _bare_summary(both["bare-grpc"]["rounds"]) if "bare-grpc" in both else None
        floor = bounds = None
        if not args.no_floor:
            import torch

            from bench.engine_floor import measure_engine_floor

            torch.set_num_threads(args.threads)
            floor = measure_engine_floor(
                model_dir, requests, args.streams, max(512, args.streams), parse_memory_size(KV_CACHE_MEMORY)
            )
            bounds = _measure_bounds(
                args, model_dir, statistics.median(r["itl_ms_p50"] for r in driven["rounds"])
            )
    rounds = driven["rounds"]
    summary = {
        "server_cpu_us_per_token": _median(rounds, "server_cpu_us_per_token"),
        "served_tok_s": _median(rounds, "served_tok_s"),
        "client_cpu_us_per_token": _median(rounds, "client_cpu_us_per_token"),
        "tokens_per_message": _median(rounds, "tokens_per_message", digits=3),
        "server_cpu_us_per_message": _median(rounds, "server_cpu_us_per_message"),
    }
    # A sized-down run may be shorter than the OS's CPU clock tick: then there is no ratio to give.
    if bare is not None and args.stream_interval == 1 and bare["cpu_us_per_message"] > 0:
        # Tandem's tokens/s and CPU per token against the bare server's messages/s and CPU per message,
        # the "serving path" targets (>= 0.7x the messages/s, <= 3x the CPU). The bare server
        # sends one token per message; tandem does too unless a writer fell behind, which
        # `tokens_per_message` shows (above 1, a message carried several and its cost was shared).
        summary["bare_grpc_msgs_per_s"] = bare["msgs_per_s"]
        summary["bare_grpc_cpu_us_per_message"] = bare["cpu_us_per_message"]
        summary["msgs_per_s_vs_bare"] = round(summary["served_tok_s"] / bare["msgs_per_s"], 2)
        summary["cpu_per_message_vs_bare"] = round(
            summary["server_cpu_us_per_token"] / bare["cpu_us_per_message"], 2
        )
    if floor is not None:
        summary.update(split_server_cpu(summary["server_cpu_us_per_token"], floor))
    if bounds is not None:
        summary["lm_head_floor_cpu_us_per_token"] = bounds["lm_head"]["cpu_us_per_token"]
        if "grpc_write" in bounds:
            summary["grpc_write_floor_cpu_us_per_message"] = bounds["grpc_write"]["server_cpu_us_per_message"]
    result = {
        "benchmark": "serving_path",
        "label": args.label,
        "machine": machine,
        "command": command_line(),
        "model": {**spec.describe(), "vocab_size": vocab_size, "tokenizer": tokenizer_model.name},
        "workload": {
            "streams": args.streams,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "api": args.api,
            "greedy": True,
            "ignore_eos": True,
        },
        "server": {
            **driven["server"],
            "threads": args.threads,
            "stream_interval": args.stream_interval,
            "args": _server_args(args, http_port),
        },
        "summary": summary,
        "rounds": rounds,
        "engine_floor": floor,
        "bounds": bounds,
        "bare_grpc": bare,
        "profile": driven["profile"],
        "load_average_at_end": load_average(),
    }
    write_json(args.result_file, result)
    plot = draw_serving_path(result, args.result_file.parent)
    if plot is not None:
        logger.info("wrote %s", plot)
    print(json.dumps({"summary": summary, "engine_floor": floor}, indent=2))
    if driven["profile"]:
        print_profile(driven["profile"])
    return 0 if all(r["failed"] == 0 for r in rounds) else 1


def print_profile(profiles: dict) -> None:
    """The profile's headline rows: thread busy shares, GIL-held share, top own-time functions."""
    every = profiles["all_threads"]
    for thread in every["threads"][:6]:
        print(f"thread {thread['thread']:<28} busy {thread['busy_share']:6.1%}")
    gil = profiles["gil_holder"]
    held = gil["samples"] / max(gil["rate_hz"] * gil["duration_s"], 1.0)
    print(f"GIL held {held:.1%} of the round")
    for row in every["top_own"][:20]:
        print(f"{row['share']:6.1%}  {row['function']}")
