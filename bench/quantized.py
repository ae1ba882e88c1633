"""`tandem bench quantized`: tandem's precision modes against llama-server F32 and Q8_0, in one run.

    tandem bench quantized [--systems ...] [--quick] [--out-dir DIR]

Systems, each a fresh server measured alone, one after another (`tandem bench compare` starts them):
tandem aggregated in fp32, with int8 weights (`--quantization int8`) and with int8 weights and int8 KV
(`--kv-cache-dtype int8`); llama-server (`-np 16 -cb -t 2`) on the F32 GGUF and on the Q8_0 GGUF of the
same weights. On each server, in this order:

- multi-turn: bench.multi_turn's chat (4 conversations x 4 turns, a shared 512-token system prompt,
  history resent each turn, 32-token replies), first, while the server's prompt cache is cold: output
  tok/s and the median TTFT of turns >= 2;
- single: one request at a time (4 prompts of the headline's lengths, 256 greedy tokens): decode tok/s
  (1 / TPOT p50) and TTFT p50;
- headline: `tandem bench compare`'s workload all at once (64 requests): output tok/s;
- memory: the peak RSS of the system's server processes over the three.

Writes `quantized.json`, `quantized.png` and `README_quantized_table.md` (the README's benchmark table)
and prints the ratios of tandem int8 to llama-server Q8_0. Takes about 15 minutes on a quiet 2-core
machine; `--quick` runs a smoke-sized version.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path

from bench import compare
from bench.report import results_dir

logger = logging.getLogger(__name__)

SYSTEMS = (
    "tandem-aggregated",
    "tandem-aggregated-int8",
    "tandem-aggregated-int8-kv-int8",
    "llama-server",
    "llama-server-q8_0",
)
LABELS = {
    "tandem-aggregated": "tandem fp32",
    "tandem-aggregated-int8": "tandem int8",
    "tandem-aggregated-int8-kv-int8": "tandem int8 + int8 KV",
    "llama-server": "llama-server F32",
    "llama-server-q8_0": "llama-server Q8_0",
    "tandem-aggregated-in-process": "tandem fp32, engine in process",
}
# Known but not run by default: the engine-core shapes compared on the real model (issue 23).
OPTIONAL_SYSTEMS = ("tandem-aggregated-in-process",)
# The pair the ratios compare: tandem's 8-bit weights against llama.cpp's.
TANDEM, PEER = "tandem-aggregated-int8", "llama-server-q8_0"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model dir (default: the cached default model)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list (default: {SYSTEMS})")
    parser.add_argument("--threads", type=int, default=2, help="threads of each system (default: 2)")
    parser.add_argument("--quick", action="store_true", help="smoke-sized workloads")
    parser.add_argument("--allow-load", action="store_true", help="run on a busy machine (recorded as such)")
    parser.add_argument(
        "--alternate-single",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="then, with tandem int8 and llama-server Q8_0 up together, alternate the single-stream "
        "workload between them ROUNDS times: a ratio per round that host noise hits on both sides",
    )
    compare.add_decode_args(parser)
    parser.add_argument("--out-dir", type=Path, default=results_dir())


def _parse(add: Callable[[argparse.ArgumentParser], None], argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add(parser)
    return parser.parse_args(argv)


@contextlib.contextmanager
def serving(name: str, args: argparse.Namespace, model: str) -> Iterator[tuple[str, str, dict]]:
    """The system as `tandem bench compare` starts it, with every workload's needs met."""
    compare_args = _parse(
        compare.add_arguments,
        [
            "--threads",
            str(args.threads),
            "--no-progress",
            "--kv-cache-memory",
            "2GiB",
            "--decode-args",
            args.decode_args,
        ],
    )
    with compare.serving(name, compare_args, model) as served:
        yield served


def _chat_client(kind: str, target: str):
    from bench.multi_turn import LlamaServerChatClient, TandemChatClient

    return TandemChatClient(target) if kind == "tandem" else LlamaServerChatClient(target)


def measure_system(name: str, args: argparse.Namespace, model_dir: Path, workloads: dict) -> dict:
    """Multi-turn, single stream and headline on one fresh server of system `name`."""
    from bench import session
    from bench.multi_turn import FIRST_PLAIN_TOKEN, run_conversations, summarize
    from bench.serve import make_backend

    with serving(name, args, str(model_dir)) as (kind, target, extra):

        async def chat() -> dict:
            client = _chat_client(kind, target)
            async for _ in client.complete([FIRST_PLAIN_TOKEN + i for i in range(8)], 2):
                pass
            turns, wall_s = await run_conversations(client, workloads["chat"])
            await client.close()
            return summarize(turns, wall_s)

        multi_turn = asyncio.run(chat())
        single_metrics = session.at_once(make_backend(kind, target, name), workloads["single"], extra, 1)
        headline_metrics = session.at_once(make_backend(kind, target, name), workloads["headline"], extra)
        memory = session.peak_rss_bytes(session.server_pids())
    result = {
        "system": name,
        "label": LABELS[name],
        "server": extra,
        "single_decode_tok_s": 1000.0 / single_metrics["tpot_ms"]["p50"],
        "single_ttft_ms_p50": single_metrics["ttft_ms"]["p50"],
        "multi_turn_tok_s": multi_turn["output_throughput"],
        "multi_turn_median_ttft_ms": multi_turn["median_ttft_ms_turns_2_plus"],
        "headline_tok_s": headline_metrics["output_throughput"],
        "peak_rss_bytes": memory,
        "failed": single_metrics["failed"] + headline_metrics["failed"],
        "multi_turn": multi_turn,
    }
    logger.info(
        "%s: single %.1f tok/s, multi-turn %.1f tok/s (TTFT %.0f ms), headline %.1f tok/s, peak RSS %.0f MiB",
        name,
        result["single_decode_tok_s"],
        result["multi_turn_tok_s"],
        result["multi_turn_median_ttft_ms"] or math.nan,
        result["headline_tok_s"],
        memory / 2**20,
    )
    return result


def alternate_single(args: argparse.Namespace, model_dir: Path, workload, rounds: int) -> dict:
    """Single-stream decode of tandem int8 and llama-server Q8_0, both servers up, the workload sent to
    each in turn `rounds` times. On a host whose memory bandwidth moves with its neighbours (the
    same server's rate swings 20% within minutes), a pair measured seconds apart shares the swing, where
    fresh servers measured one after another do not."""
    from bench import session
    from bench.serve import make_backend

    with contextlib.ExitStack() as stack:
        served = {name: stack.enter_context(serving(name, args, str(model_dir))) for name in (TANDEM, PEER)}
        per_round = []
        for _ in range(rounds):
            rates = {}
            for name, (kind, target, extra) in served.items():
                metrics = session.at_once(make_backend(kind, target, name), workload, extra, 1)
                rates[name] = 1000.0 / metrics["tpot_ms"]["p50"]
            per_round.append({"tandem_tok_s": rates[TANDEM], "peer_tok_s": rates[PEER]})
            per_round[-1]["ratio"] = rates[TANDEM] / rates[PEER]
            logger.info("alternated single stream: %s", per_round[-1])
    found = [row["ratio"] for row in per_round]
    return {
        "rounds": per_round,
        "median_ratio": statistics.median(found),
        "min_ratio": min(found),
        "max_ratio": max(found),
    }


def ratios(runs: list[dict]) -> dict | None:
    """tandem int8 over llama-server Q8_0 on each figure, where both ran."""
    by_name = {run["system"]: run for run in runs}
    if TANDEM not in by_name or PEER not in by_name:
        return None
    ours, theirs = by_name[TANDEM], by_name[PEER]
    return {
        "single_decode": ours["single_decode_tok_s"] / theirs["single_decode_tok_s"],
        "multi_turn_throughput": ours["multi_turn_tok_s"] / theirs["multi_turn_tok_s"],
        "multi_turn_median_ttft": ours["multi_turn_median_ttft_ms"] / theirs["multi_turn_median_ttft_ms"],
        "headline_throughput": ours["headline_tok_s"] / theirs["headline_tok_s"],
    }


def workloads_for(args: argparse.Namespace, vocab: int) -> dict:
    from bench.multi_turn import ChatWorkload
    from bench.serve import build_workload

    sizes = ["--num-prompts", "4", "--output-len", "fixed:16"] if args.quick else []
    headline_args = _parse(compare.add_arguments, ["--no-progress", *sizes])
    single_sizes = [
        "--num-prompts",
        "1" if args.quick else "4",
        "--output-len",
        f"fixed:{16 if args.quick else 256}",
    ]
    single_args = _parse(compare.add_arguments, ["--no-progress", "--num-warmups", "1", *single_sizes])
    chat = ChatWorkload.synthetic(vocab, 2 if args.quick else 4, 2 if args.quick else 4, 512, 48, 32, seed=0)
    return {
        "headline": build_workload(headline_args, vocab),
        "single": build_workload(single_args, vocab),
        "chat": chat,
    }


def run(args: argparse.Namespace) -> int:
    from bench import session
    from bench.plots import draw_quantized, quantized_table
    from bench.roofline import ModelShape
    from bench.servers import ServerStartError
    from engine.model_store import resolve_model

    names = session.systems(args.systems, SYSTEMS + OPTIONAL_SYSTEMS)
    start_load, valid = session.quiet_machine(args.allow_load)
    model_dir = resolve_model(args.model)
    workloads = workloads_for(args, ModelShape.from_config_file(model_dir / "config.json").vocab)
    document = session.header(
        "quantized",
        start_load,
        model=model_dir.name,
        threads=args.threads,
        valid=valid,
        workloads={
            "chat": workloads["chat"].describe(),
            "single": workloads["single"].description,
            "headline": workloads["headline"].description,
        },
    )
    document["runs"], document["skipped"] = session.each_system(
        names, lambda name: measure_system(name, args, model_dir, workloads)
    )
    document["ratios"] = ratios(document["runs"])
    if args.alternate_single > 0:
        try:
            document["single_alternated"] = alternate_single(
                args, model_dir, workloads["single"], args.alternate_single
            )
        except (session.SystemSkipped, ServerStartError) as exc:
            logger.warning("skipping the alternated single stream: %s", exc)
            document["skipped"]["single_alternated"] = str(exc)
    session.finish(document, args.out_dir, quantized_table, draw_quantized)
    return 0 if not document["skipped"] else 1
