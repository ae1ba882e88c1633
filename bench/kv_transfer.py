"""KV transfer between the tiers over loopback, and what it costs the time to first token.

Two measurements per prompt length, on SmolLM2-135M-Instruct (the default model), in one process:

- transfer: a disaggregated decode server calls a prefill server whose token budget holds the whole
  prompt, so every KV block is ready after one forward; the decode side's time from the first KV
  message to `PrefillDone` is then pure transfer (gather and CRC32C on the prefill side, gRPC over
  loopback, CRC check and write into the reserved blocks on the decode side). Reported as MB/s and
  microseconds per prompt token.
- TTFT: the same prompts through two decode servers, one aggregated (prefills itself) and one
  disaggregated (prefill tier, every prompt remote), both chunking prefill with the same token
  budget; the ratio disaggregated / aggregated is the price of moving the KV.

    python -m bench.kv_transfer [--model DIR] [--lengths 128,1024,4096] [--repeats 3]
        [--out bench/results/kv_transfer.json]

On a shared CPU box the numbers move with the load: the result file records the load average before
and after the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import threading
import time
from pathlib import Path

import grpc
import torch

from bench.machine import load_average, machine_info
from decode_service.config import DecodeServiceConfig
from decode_service.server import DecodeServer
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.model_store import model_fingerprint, resolve_model
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model dir (default: the cached SmolLM2-135M-Instruct)")
    parser.add_argument("--lengths", default="128,1024,4096", help="prompt lengths in tokens")
    parser.add_argument("--repeats", type=int, default=3, help="runs per length and path (median reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out", default="bench/results/kv_transfer.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for noisy in ("decode_service", "prefill_service", "engine", "kernels", "tandem"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    machine = machine_info()
    report = measure(resolve_model(args.model), [int(x) for x in args.lengths.split(",")], args.repeats)
    report["machine"] = machine
    report["load_average_after"] = load_average()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    logger.info("wrote %s", out)


if __name__ == "__main__":
    main()
