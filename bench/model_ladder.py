"""`tandem bench ladder`: tandem and llama-server on the same weights at 0.5 B, 3 B and 8 B, one at a time.

    tandem bench ladder [--rungs 0.5b,3b,8b] [--systems ...] [--output-tokens 32] [--long-prompt 4000]

Builds the model-size ladder first where missing (`bench.ladder_models`: random bf16 weights of Llama
shapes as safetensors; Q8_0 and Q4_K_M GGUFs by llama.cpp's converter and `llama-quantize`; the 8 B
rung takes about 30 GB of disk and 20 minutes), and llama.cpp's binaries (`bench.llama_cpp_build`).
Then per rung, each system alone, one after another:

- seconds from the command to a healthy server, and the peak resident memory of its process tree
  (sampled every 0.2 s while it loads and serves) and of each process (the kernel's high-water mark);
- idle resident and proportional (PSS: shared pages split between the processes mapping them) memory
  per process once it serves;
- decode: single stream (two requests in turn; 1 / median time per output token) and four streams at
  once (4 / median time per output token), `--output-tokens` greedy tokens each from a 32-token prompt;
- with `--long-prompt N`: a prompt of N tokens sent while four streams decode; the longest gap between
  two tokens of any stream while it is prefilled (what a step costs at worst) and any failed stream.

Every system gets the same KV capacity in tokens (`--context`). Writes `ladder.json` and
`ladder_table.md` under the results folder, with the host's CPU model. Never part of `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import re
import statistics
import threading
import time
from pathlib import Path

from bench.report import results_dir

logger = logging.getLogger(__name__)

SYSTEMS = ("tandem-int8", "tandem-q8_0", "llama-server-q8_0")
OPTIONAL_SYSTEMS = ("tandem-w8a8-int8", "tandem-q8_0-w8a8", "tandem-up-q8_0", "llama-server-q4_k_m")
PROMPT_TOKENS = 32
STREAMS = 4
SAMPLE_S = 0.2
# The decoding streams of the long-prompt probe ask for the servers' usual cap and are cancelled once the
# long prompt has its first tokens.
LONG_PROBE_STREAM_TOKENS = 4096
# Random prompts draw ids above the special tokens and below SmolLM2's vocabulary.
MIN_TOKEN_ID, VOCAB = 100, 49152


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rungs", default="0.5b,3b,8b", help="model sizes, from 0.5b, 3b, 8b (default: all)")
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"systems to run, from {', '.join(SYSTEMS + OPTIONAL_SYSTEMS)} (default: {','.join(SYSTEMS)})",
    )
    parser.add_argument(
        "--output-tokens", type=int, default=32, help="greedy tokens per request (default: 32)"
    )
    parser.add_argument(
        "--long-prompt",
        type=int,
        default=0,
        help="also send a prompt this long while 4 streams decode (0: no)",
    )
    parser.add_argument("--context", type=int, default=8192, help="KV capacity of every system in tokens")
    parser.add_argument("--threads", type=int, default=2, help="threads of every server (default: 2)")
    parser.add_argument("--out-dir", type=Path, default=results_dir(), help="results folder")


class MemorySampler:
    """Samples the summed resident memory of a process tree, from `watch(pid)` until `stop()`; keeps the peak.
    A sum of per-process peaks would overstate it: the tiers and the front door peak at different times."""

    def __init__(self) -> None:
        self.peak_tree_bytes = 0
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, root: int) -> None:
        self._thread = threading.Thread(target=self._run, args=(root,), daemon=True)
        self._thread.start()

    def _run(self, root: int) -> None:
        while not self._stopped.wait(SAMPLE_S):
            total = sum(_status_bytes(pid, "VmRSS") for pid in tree(root))
            self.peak_tree_bytes = max(self.peak_tree_bytes, total)

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()


def tree(root: int) -> list[int]:
    """`root` and every live descendant (through each thread's children list)."""
    found, pending = [], [root]
    while pending:
        pid = pending.pop()
        found.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*"):
            with contextlib.suppress(OSError):
                pending += [int(child) for child in (task / "children").read_text().split()]
    return found


def _status_bytes(pid: int, field: str) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _rollup_bytes(pid: int, field: str) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
    return ""


def process_memory(root: int) -> list[dict]:
    """Each process of the tree: its command, resident, proportional and peak resident bytes."""
    return [
        {
            "pid": pid,
            "command": _cmdline(pid),
            "rss": _status_bytes(pid, "VmRSS"),
            "pss": _rollup_bytes(pid, "Pss"),
            "peak_rss": _status_bytes(pid, "VmHWM"),
        }
        for pid in tree(root)
    ]


def _requests(count: int, prompt_len: int, output_len: int, seed: int):
    from bench.workload import WorkloadRequest

    rng = random.Random(seed)
    return [
        WorkloadRequest(i, tuple(rng.randrange(MIN_TOKEN_ID, VOCAB) for _ in range(prompt_len)), output_len)
        for i in range(count)
    ]


def _record(request):
    from bench.metrics import RequestRecord

    return RequestRecord(request.index, request.prompt_len, request.output_len, time.perf_counter())


async def _stream_into(backend, request, request_id: str, record) -> None:
    """Stream one request, timestamping its tokens into `record` (kept when the task is cancelled)."""
    try:
        async for tokens in backend.stream(request, request_id):
            record.add_chunk(time.perf_counter(), tokens)
    except Exception as exc:  # a failed stream is a result here, not a crash of the run
        record.error = f"{type(exc).__name__}: {exc}"
    record.end_time = time.perf_counter()


async def _timed(backend, request, request_id: str):
    record = _record(request)
    await _stream_into(backend, request, request_id, record)
    return record


def _median_tpot(records) -> float | None:
    tpots = [r.tpot for r in records if r.ok and r.tpot]
    return statistics.median(tpots) if tpots else None


def together_rate(records) -> float | None:
    """Tokens per second of all streams while every one of them decodes: from the last stream's first
    token to the first stream's last. The TPOT-based rate also holds the steps that prefill the other
    prompts, which a server chunking prefill into decode steps (tandem, vLLM) spreads over the first
    tokens and a server prefilling every waiting prompt first (llama.cpp) does not."""
    done = [r for r in records if r.ok and len(r.chunk_times) > 1]
    if len(done) < len(records) or not done:
        return None
    start = max(r.chunk_times[0] for r in done)
    end = min(r.chunk_times[-1] for r in done)
    tokens = sum(
        n for r in done for at, n in zip(r.chunk_times, r.chunk_tokens, strict=True) if start < at <= end
    )
    return tokens / (end - start) if end > start and tokens else None


async def decode_rates(backend, output_tokens: int) -> dict:
    """Single-stream and four-stream decode tok/s (from the median time per output token)."""
    await _timed(backend, _requests(1, 8, 4, seed=99)[0], "ladder-warmup")
    single = [
        await _timed(backend, r, f"ladder-single-{r.index}")
        for r in _requests(2, PROMPT_TOKENS, output_tokens, 1)
    ]
    batch = _requests(STREAMS, PROMPT_TOKENS, output_tokens, seed=2)
    four = await asyncio.gather(*(_timed(backend, r, f"ladder-four-{r.index}") for r in batch))
    single_tpot, four_tpot = _median_tpot(single), _median_tpot(four)
    return {
        "single_tok_s": 1 / single_tpot if single_tpot else None,
        "four_streams_tok_s": STREAMS / four_tpot if four_tpot else None,
        "four_together_tok_s": together_rate(four),
        "errors": [r.error for r in [*single, *four] if r.error],
    }


async def long_prompt_probe(backend, prompt_len: int) -> dict:
    """Four streams decode; a `prompt_len` prompt arrives; the longest token gap of any stream meanwhile."""
    streams = _requests(STREAMS, PROMPT_TOKENS, LONG_PROBE_STREAM_TOKENS, seed=3)
    records = [_record(r) for r in streams]
    tasks = [
        asyncio.create_task(_stream_into(backend, r, f"ladder-bg-{r.index}", record))
        for r, record in zip(streams, records, strict=True)
    ]
    await asyncio.sleep(10.0)
    sent = time.perf_counter()
    long_record = await _timed(backend, _requests(1, prompt_len, 2, seed=4)[0], "ladder-long")
    done = time.perf_counter()
    failed = [r.error for r in records if r.error]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    gaps = []
    for record in records:
        times = [sent, *(t for t in record.chunk_times if sent < t < done), done]
        gaps += [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
    return {
        "prompt_tokens": prompt_len,
        "ttft_s": long_record.ttft if long_record.ok else None,
        "prefill_s": done - sent,
        "max_token_gap_s": max(gaps) if gaps else None,
        "failed_streams": failed,
        "long_error": long_record.error,
    }


def kv_bytes_per_token(rung) -> int:
    """fp32 K and V of every layer (tandem's default cache type on the CPU)."""
    return 2 * rung.layers * rung.kv_heads * (rung.hidden // rung.heads) * 4


def _server(system: str, rung, args: argparse.Namespace, tools):
    """The system's server process and its streaming backend (not yet opened)."""
    from bench import ladder_models
    from bench.backends.llama_server import LlamaServerBackend
    from bench.backends.tandem_grpc import TandemBackend
    from bench.servers import (
        ServerProcess,
        free_port,
        grpc_healthy,
        llama_server,
        tandem_command,
        tandem_decode_server,
        thread_env,
    )

    kv = ["--kv-cache-memory", str(args.context * kv_bytes_per_token(rung))]
    if system.startswith("llama-server"):
        gguf = ladder_models.gguf_path(rung, system.removeprefix("llama-server-").upper())
        server, url = llama_server(system, tools.server, gguf, args.threads, STREAMS, args.context)
        return server, LlamaServerBackend(url, system)
    q8_0 = str(ladder_models.gguf_path(rung, "Q8_0"))
    if system == "tandem-up-q8_0":
        port = free_port()
        target = f"127.0.0.1:{port}"
        command = tandem_command(
            "up", "--model", q8_0, "--port", str(port), "--http-port", str(free_port()),
            "--prefill-port", str(free_port()), "--metrics-port", "0", "--prefill-metrics-port", "0",
            "--threads", str(args.threads), "--no-status", *kv,
        )  # fmt: skip
        server = ServerProcess(system, command, lambda: grpc_healthy(target), thread_env(args.threads))
        return server, TandemBackend(target, system)
    if system == "tandem-int8":
        model, extra = str(ladder_models.checkpoint_dir(rung)), ["--quantization", "int8"]
    elif system == "tandem-w8a8-int8":
        model, extra = str(ladder_models.checkpoint_dir(rung)), ["--quantization", "w8a8_int8"]
    elif system == "tandem-q8_0":
        model, extra = q8_0, []
    elif system == "tandem-q8_0-w8a8":
        model, extra = q8_0, ["--quantization", "w8a8_int8"]
    else:
        raise ValueError(f"unknown system {system!r}")
    server, target = tandem_decode_server(system, model, args.threads, [*extra, *kv])
    return server, TandemBackend(target, system)


def measure_system(system: str, rung, args: argparse.Namespace, tools) -> dict:
    """Start one system alone, time its start, sample its memory, measure decode; stop it."""
    server, backend = _server(system, rung, args, tools)
    sampler = MemorySampler()
    started = time.monotonic()
    result: dict = {"system": system, "rung": rung.name}
    try:
        server.start(timeout_s=1800, on_spawn=sampler.watch)
        result["ready_s"] = time.monotonic() - started
        result["plan_bytes"] = planned_bytes(server.log_path.read_text(errors="replace"))
        result["processes_ready"] = process_memory(server.pid)

        async def drive() -> None:
            await backend.open()
            try:
                result.update(await decode_rates(backend, args.output_tokens))
                if args.long_prompt and system.startswith("tandem"):
                    result["long_prompt"] = await long_prompt_probe(backend, args.long_prompt)
            finally:
                await backend.close()

        asyncio.run(drive())
        result["processes_served"] = process_memory(server.pid)
    except Exception as exc:  # one system failing to start or serve is a row of the table, not the end
        result["error"] = f"{type(exc).__name__}: {exc}"
        logger.exception("%s on %s failed", system, rung.name)
    finally:
        sampler.stop()
        server.stop()
    result["peak_tree_rss"] = sampler.peak_tree_bytes
    logger.info("%s %s: %s", rung.name, system, {k: v for k, v in result.items() if "processes" not in k})
    return result


def planned_bytes(log_text: str) -> int | None:
    """What tandem's memory plan said the command's processes would hold (its `needs_gib`), if it logged
    one: the figure peak resident memory is held to."""
    match = re.search(r"memory plan .*?needs_gib=([0-9.]+)", log_text)
    return None if match is None else int(float(match.group(1)) * 2**30)


def _gib(value: int | None) -> str:
    return "—" if not value else f"{value / 2**30:.2f}"


def _rate(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def table(runs: list[dict], host: str) -> str:
    """The results as a markdown table, ratios against llama-server Q8_0 on the same rung."""
    lines = [
        f"Host: {host}. Each system alone, one after another.",
        "",
        "| rung | system | ready s | plan GiB | peak RSS GiB | idle RSS GiB | idle PSS GiB | 1 stream tok/s "
        "| 4 streams tok/s | 4 together tok/s | peak vs llama Q8_0 | 1 stream vs | 4 streams vs "
        "| 4 together vs | long prompt: max gap s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    peers = {run["rung"]: run for run in runs if run["system"] == "llama-server-q8_0" and "error" not in run}
    for run in runs:
        peer = peers.get(run["rung"], {})
        served = run.get("processes_served", [])
        idle_rss = sum(p["rss"] for p in served)
        idle_pss = sum(p["pss"] for p in served)

        def ratio(key: str, run: dict = run, peer: dict = peer) -> str:
            mine, theirs = run.get(key), peer.get(key)
            return f"{mine / theirs:.2f}x" if mine and theirs else "—"

        long_gap = (run.get("long_prompt") or {}).get("max_token_gap_s")
        lines.append(
            f"| {run['rung']} | {run['system']} | {run.get('ready_s', 0):.0f} "
            f"| {_gib(run.get('plan_bytes'))} | {_gib(run['peak_tree_rss'])} "
            f"| {_gib(idle_rss)} | {_gib(idle_pss)} | {_rate(run.get('single_tok_s'))} "
            f"| {_rate(run.get('four_streams_tok_s'))} | {_rate(run.get('four_together_tok_s'))} "
            f"| {ratio('peak_tree_rss')} | {ratio('single_tok_s')} | {ratio('four_streams_tok_s')} "
            f"| {ratio('four_together_tok_s')} | {_rate(long_gap)} |"
        )
        if "error" in run:
            lines.append(f"| | ↳ {run['error'][:150]} | | | | | | | | | | | | | |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    from bench import ladder_models
    from bench.llama_cpp_build import default_tools, ensure_llama_cpp
    from bench.machine import cpu_model
    from engine.model_store import fetch_default_model

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS + OPTIONAL_SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems: {', '.join(sorted(unknown))}")
    rungs = [ladder_models.RUNGS[name.strip()] for name in args.rungs.split(",")]
    # llama.cpp's tools make the GGUFs and run llama-server; tandem on safetensors alone needs neither.
    tools = ensure_llama_cpp(default_tools()) if systems != ["tandem-int8"] else None
    tokenizer_dir = fetch_default_model()
    out_dir = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    host = cpu_model()
    runs: list[dict] = []
    for rung in rungs:
        ladder_models.write_checkpoint(rung, tokenizer_dir, ladder_models.checkpoint_dir(rung))
        if tools is not None:
            ladder_models.write_ggufs(rung, tools)
        for system in systems:
            runs.append(measure_system(system, rung, args, tools))
            document = {"host": host, "context_tokens": args.context, "runs": runs}
            (out_dir / "ladder.json").write_text(json.dumps(document, indent=1) + "\n")
    text = table(runs, host)
    (out_dir / "ladder_table.md").write_text(text)
    print(text)
    return 0
