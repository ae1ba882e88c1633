"""KV transfer between the tiers over loopback, and what it costs the time to first token.

Two sections, on SmolLM2-135M-Instruct's KV layout (the default model; fp32, 16-token blocks):

- wire (`bench.kv_wire`, no model runs): a sender process streams a prompt's KV blocks through the
  prefill tier's KVSender and Prefill codec; this process receives with the decode tier's stub and
  writes into its own cache. Per prompt length (default 128/1k/4k/16k) and per payload budget per
  message (default 1-16 MiB; the product sends 4 MiB): GB/s by wall clock, and the CPU seconds each
  side spent (which move far less than wall time on a loaded machine). Plus the GB/s of one CRC32C
  pass: each byte gets two (computed by the sender, checked by the receiver).
- serve: real servers in this process. A disaggregated decode server calls a prefill server whose
  token budget holds the whole prompt, so every KV block is ready after one forward; the decode
  side's time from the first KV message to `PrefillDone` is then pure transfer. Then TTFT through
  two decode servers, one aggregated (prefills itself) and one disaggregated (every prompt remote),
  both chunking prefill with the same token budget; the ratio disaggregated / aggregated is the
  price of moving the KV (target <= 1.2 for prompts of 1k tokens and more).

    python -m bench.kv_transfer [--sections wire,serve] [--model DIR] [--wire-lengths 128,1024,4096,16384]
        [--message-sizes 1024,2048,4096,8192,16384] [--lengths 128,1024,4096] [--repeats 3]
        [--out FILE]

The serve section runs one CPU forward per prompt (a 4k prompt takes tens of seconds on two cores).
On a shared machine the numbers move with the load: the result file records the load average
before and after the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import grpc
import torch

from bench.kv_wire import measure_crc32c, measure_wire
from bench.machine import load_average, machine_info
from bench.report import results_dir
from decode_service.config import DecodeServiceConfig
from decode_service.server import DecodeServer
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.engine import Engine
from engine.model_store import model_fingerprint, resolve_model
from kv_transfer import KVLayout
from prefill_service.config import PrefillServiceConfig
from prefill_service.server import PrefillServer
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc

logger = logging.getLogger(__name__)

BLOCK_SIZE = 16
KV_POOL = "768MiB"
TTFT_TOKEN_BUDGET = 512


class ServerThread:
    """An asyncio loop on a thread, hosting one server."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def call(self, coroutine, timeout: float = 600.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def engine_config(token_budget: int, max_model_len: int) -> EngineConfig:
    from engine.config import parse_memory_size

    return EngineConfig(
        dtype=torch.float32,
        cache=CacheConfig(block_size=BLOCK_SIZE, memory_bytes=parse_memory_size(KV_POOL)),
        max_model_len=max_model_len,
        max_num_seqs=8,
        max_num_batched_tokens=token_budget,
    )


def start_prefill(
    model_dir: Path, token_budget: int, max_model_len: int
) -> tuple[ServerThread, PrefillServer]:
    engine = Engine.from_pretrained(model_dir, engine_config(token_budget, max_model_len))
    thread = ServerThread()

    async def create() -> PrefillServer:
        config = PrefillServiceConfig(host="127.0.0.1", port=0)
        return PrefillServer(engine, model_fingerprint(model_dir), config)

    server = thread.call(create())
    thread.call(server.start())
    return thread, server


def start_decode(model_dir: Path, max_model_len: int, prefill: str = "") -> tuple[ServerThread, DecodeServer]:
    engine = Engine.from_pretrained(model_dir, engine_config(TTFT_TOKEN_BUDGET, max_model_len))
    thread = ServerThread()
    # A 4k-token prompt in one CPU forward takes long on a loaded box; this measures, not guards.
    config = DecodeServiceConfig(host="127.0.0.1", port=0, prefill=prefill, prefill_timeout_s=3600.0)

    async def create() -> DecodeServer:
        return DecodeServer(engine, config, model_fingerprint=model_fingerprint(model_dir))

    server = thread.call(create())
    thread.call(server.start())
    return thread, server


def remote_transfer(
    decode: DecodeServer, stub: generation_pb2_grpc.GenerationStub, prompt: list[int], request_id: str
) -> dict:
    """One prompt through a disaggregated decode server: what its prefill client counted for it."""
    stats = decode.remote_prefill.stats

    def counters() -> tuple[float, ...]:
        return (
            stats.kv_bytes_received,
            stats.kv_messages_received,
            stats.kv_stream_seconds,
            stats.transfer_seconds,
        )

    before = counters()
    time_to_first_token(stub, prompt, request_id)
    payload, messages, stream_s, call_s = (b - a for a, b in zip(before, counters(), strict=True))
    return {
        "payload_bytes": payload,
        "messages": messages,
        "transfer_seconds": stream_s,
        "compute_seconds": call_s - stream_s,
    }


def time_to_first_token(
    stub: generation_pb2_grpc.GenerationStub, prompt: list[int], request_id: str
) -> float:
    request = pb.GenerateRequest(
        request_id=request_id,
        token_ids=prompt,
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingParams(max_tokens=2, ignore_eos=True),
    )
    started = time.perf_counter()
    stream = stub.Generate(request, timeout=600)
    next(iter(stream))
    first = time.perf_counter() - started
    for _ in stream:
        pass
    return first


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    # Skip the low ids, where the tokenizer keeps its special tokens.
    return [rng.randrange(100, vocab_size) for _ in range(length)]


def measure(model_dir: Path, lengths: list[int], repeats: int) -> dict:
    max_model_len = max(lengths) + 16
    transfer_thread, transfer_server = start_prefill(model_dir, max(lengths), max_model_len)
    receiver_thread, receiver = start_decode(
        model_dir, max_model_len, prefill=f"127.0.0.1:{transfer_server.port}"
    )
    ttft_prefill_thread, ttft_prefill = start_prefill(model_dir, TTFT_TOKEN_BUDGET, max_model_len)
    aggregated_thread, aggregated = start_decode(model_dir, max_model_len)
    disaggregated_thread, disaggregated = start_decode(
        model_dir, max_model_len, prefill=f"127.0.0.1:{ttft_prefill.port}"
    )
    vocab_size = aggregated.engine.vocab_size
    model = aggregated.engine.model_config
    rng = random.Random(0)
    results = []
    try:
        stubs = {
            name: generation_pb2_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
            for name, server in (
                ("aggregated", aggregated),
                ("disaggregated", disaggregated),
                ("receiver", receiver),
            )
        }
        # Warm every path (first-call allocations, gRPC connections) before timing anything.
        warm = random_prompt(rng, 64, vocab_size)
        for name, stub in stubs.items():
            time_to_first_token(stub, warm, f"warm-{name}")
        for length in lengths:
            transfers = [
                remote_transfer(
                    receiver,
                    stubs["receiver"],
                    random_prompt(rng, length, vocab_size),
                    f"kv-{length}-{index}",
                )
                for index in range(repeats)
            ]
            ttft_stubs = {name: stubs[name] for name in ("aggregated", "disaggregated")}
            ttft: dict[str, list[float]] = {"aggregated": [], "disaggregated": []}
            for index in range(repeats):
                prompt = random_prompt(rng, length, vocab_size)
                # Alternate which goes first, so neither always runs on a warmer cache.
                order = list(ttft_stubs) if index % 2 == 0 else list(reversed(ttft_stubs))
                for name in order:
                    request_id = f"{name}-{length}-{index}"
                    ttft[name].append(time_to_first_token(ttft_stubs[name], prompt, request_id))
            transfer_s = statistics.median(t["transfer_seconds"] for t in transfers)
            payload = transfers[0]["payload_bytes"]
            agg, disagg = statistics.median(ttft["aggregated"]), statistics.median(ttft["disaggregated"])
            row = {
                "prompt_tokens": length,
                "kv_payload_bytes": payload,
                "kv_messages": transfers[0]["messages"],
                "kv_bytes_per_token": payload / length,
                "transfer_seconds_median": transfer_s,
                "transfer_seconds_all": [t["transfer_seconds"] for t in transfers],
                "transfer_MBps": payload / transfer_s / 1e6,
                "transfer_us_per_token": transfer_s / length * 1e6,
                "single_forward_prefill_seconds_median": statistics.median(
                    t["compute_seconds"] for t in transfers
                ),
                "ttft_aggregated_seconds_median": agg,
                "ttft_disaggregated_seconds_median": disagg,
                "ttft_aggregated_seconds_all": ttft["aggregated"],
                "ttft_disaggregated_seconds_all": ttft["disaggregated"],
                "ttft_ratio_disaggregated_over_aggregated": disagg / agg,
                "ttft_overhead_us_per_token": (disagg - agg) / length * 1e6,
            }
            results.append(row)
            logger.info(
                "%5d tokens: %.1f MB KV, transfer %.3f s = %.0f MB/s (%.1f us/token); TTFT agg %.3f s, "
                "disagg %.3f s (x%.2f)",
                length,
                payload / 1e6,
                transfer_s,
                row["transfer_MBps"],
                row["transfer_us_per_token"],
                agg,
                disagg,
                row["ttft_ratio_disaggregated_over_aggregated"],
            )
        stats = disaggregated.remote_prefill.stats
        remote = {
            "remote_prefills_completed": stats.remote_prefills_completed,
            "local_prefills": stats.local_prefills,
            "kv_bytes_received": stats.kv_bytes_received,
            "attempt_failures": stats.attempt_failures,
        }
    finally:
        for thread, server in (
            (receiver_thread, receiver),
            (disaggregated_thread, disaggregated),
            (aggregated_thread, aggregated),
            (ttft_prefill_thread, ttft_prefill),
            (transfer_thread, transfer_server),
        ):
            thread.call(server.stop())
            thread.close()
    return {
        "model": model_dir.name,
        "dtype": "float32",
        "block_size": BLOCK_SIZE,
        "kv_layout": {
            "num_layers": model.num_layers,
            "num_kv_heads": model.num_kv_heads,
            "head_dim": model.head_dim,
        },
        "ttft_token_budget": TTFT_TOKEN_BUDGET,
        "repeats": repeats,
        "torch_threads": torch.get_num_threads(),
        "disaggregated_decode_counters": remote,
        "results": results,
    }


def model_layout(model_dir: Path) -> KVLayout:
    """The KV layout the serve section's servers use, without loading the weights."""
    from transformers import AutoConfig

    model = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))
    return KVLayout(model.num_layers, model.num_kv_heads, model.head_dim, BLOCK_SIZE, torch.float32)


def measure_wire_section(
    layout: KVLayout, lengths: list[int], message_sizes: list[int], repeats: int
) -> dict:
    rows = measure_wire(layout, lengths, message_sizes, repeats)
    crc_gbps = measure_crc32c()
    for row in rows:
        logger.info(
            "wire %5d tokens, %4d KiB messages (%d): %.3f s = %.2f GB/s; CPU sender %.3f s, receiver %.3f s "
            "(CPU-bound %.2f GB/s)",
            row["prompt_tokens"],
            row["max_payload_bytes"] >> 10,
            row["messages"],
            row["seconds_median"],
            row["GBps"],
            row["sender_cpu_seconds_median"],
            row["receiver_cpu_seconds_median"],
            row["cpu_bound_GBps"],
        )
    logger.info("crc32c: %.1f GB/s per pass", crc_gbps)
    return {
        "kv_layout": {
            "num_layers": layout.num_layers,
            "num_kv_heads": layout.num_kv_heads,
            "head_dim": layout.head_dim,
            "block_size": layout.block_size,
            "dtype": layout.dtype_name,
        },
        "repeats": repeats,
        "crc32c_GBps_one_pass": crc_gbps,
        "results": rows,
    }


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="wire,serve", help="which sections to run: wire, serve")
    parser.add_argument("--model", default=None, help="model dir (default: the cached SmolLM2-135M-Instruct)")
    parser.add_argument("--wire-lengths", default="128,1024,4096,16384", help="wire section prompt lengths")
    parser.add_argument(
        "--message-sizes",
        default="1024,2048,4096,8192,16384",
        help="wire section payload budgets per message, KiB",
    )
    parser.add_argument("--lengths", default="128,1024,4096", help="serve section prompt lengths in tokens")
    parser.add_argument("--repeats", type=int, default=3, help="runs per length and path (median reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=results_dir() / "kv_transfer.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for noisy in ("decode_service", "prefill_service", "engine", "kernels", "serving"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    sections = set(args.sections.split(","))
    model_dir = resolve_model(args.model)
    report: dict = {"machine": machine_info(), "command": " ".join(sys.argv)}
    if "wire" in sections:
        sizes = [size << 10 for size in _ints(args.message_sizes)]
        report["wire"] = measure_wire_section(
            model_layout(model_dir), _ints(args.wire_lengths), sizes, args.repeats
        )
    if "serve" in sections:
        report["serve"] = measure(model_dir, _ints(args.lengths), args.repeats)
    report["load_average_after"] = load_average()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    logger.info("wrote %s", out)


if __name__ == "__main__":
    main()
