"""`tandem bench multi-turn`: prefix caching on a multi-turn chat, the cache on and off in one run.

C conversations x T turns share one system prompt of S tokens. Every turn resends the whole history
(system prompt, earlier user messages and the replies the server generated) plus a new user message of
U tokens and asks for R greedy tokens, EOS ignored; the conversations run concurrently, each turn after
its previous reply. Each system runs on a fresh server, so every cache starts cold:

- `tandem-aggregated` and `tandem-disaggregated`, each with the prefix cache on and off
  (`--no-prefix-caching`), on the same workload; greedy replies must be identical both ways;
- `llama-server` with its prompt cache (`cache_prompt`), when llama.cpp is built
  (`python -m bench.llama_cpp_build`); skipped otherwise.

Reported per run: median TTFT of turns >= 2 (the turns a cache can serve) and of turn 1, median TTFT by
turn, output throughput, and for disaggregated tandem the KV bytes the decode tier received per request
(its `tandem:kv_transfer_bytes` counter). Writes `multi_turn.json` and `multi_turn_ttft_by_turn.png`.

    tandem bench multi-turn                                  # the full measurement (about 30 min on 2 cores)
    tandem bench multi-turn --conversations 2 --turns 2 --system-len 48 --user-len 8 --reply-len 4 \\
        --systems tandem-aggregated                          # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import statistics
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from bench.report import results_dir

logger = logging.getLogger(__name__)

SYSTEMS = ("tandem-aggregated", "tandem-disaggregated", "llama-server")
# Ids below this are left out of synthetic prompts: small ids are the special tokens of common vocabularies.
FIRST_PLAIN_TOKEN = 100


def add_workload_arguments(parser: argparse.ArgumentParser, turns: int) -> None:
    """The model and the chat's shape, shared with `bench.replicas`."""
    parser.add_argument("--model", default=None, help="model dir (default: the cached default model)")
    parser.add_argument(
        "--conversations", type=int, default=8, help="concurrent conversations C (default: 8)"
    )
    parser.add_argument(
        "--turns", type=int, default=turns, help=f"turns T per conversation (default: {turns})"
    )
    parser.add_argument(
        "--system-len", type=int, default=512, help="shared system prompt tokens (default: 512)"
    )
    parser.add_argument("--user-len", type=int, default=48, help="tokens of each user message (default: 48)")
    parser.add_argument("--reply-len", type=int, default=32, help="greedy tokens of each reply (default: 32)")
    parser.add_argument(
        "--think-time",
        type=float,
        default=0.0,
        help="mean seconds a user pauses before each later turn, exponentially distributed and seeded "
        "(default: 0, every turn sent the moment its previous reply ends)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic tokens (default: 0)")


def model_and_workload(args: argparse.Namespace) -> tuple[Path, ChatWorkload]:
    """The model directory and the synthetic chat `add_workload_arguments`' flags describe."""
    from bench.roofline import ModelShape
    from engine.model_store import resolve_model

    model_dir = resolve_model(args.model)
    vocab = ModelShape.from_config_file(model_dir / "config.json").vocab
    workload = ChatWorkload.synthetic(
        vocab,
        args.conversations,
        args.turns,
        args.system_len,
        args.user_len,
        args.reply_len,
        args.seed,
        args.think_time,
    )
    return model_dir, workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser, turns=6)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list (default: {SYSTEMS})")
    parser.add_argument("--threads", type=int, default=2, help="threads of each system (default: 2)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="tandem batch size cap (default: 64)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="tandem tokens per step")
    parser.add_argument("--kv-cache-memory", default="2GiB", help="tandem's KV pool (default: 2GiB)")
    parser.add_argument("--llama-parallel", type=int, default=8, help="llama-server slots (default: 8)")
    parser.add_argument("--llama-context", type=int, default=32768, help="llama-server total context")
    parser.add_argument("--out-dir", type=Path, default=results_dir())
    parser.add_argument("--no-plots", action="store_true", help="write the JSON only")


@dataclass(frozen=True)
class ChatWorkload:
    """The token ids of every message: one system prompt, and per conversation one user message per turn;
    `pauses` holds each conversation's seconds of user think time before each turn (0 before the first).
    """

    system: tuple[int, ...]
    users: tuple[tuple[tuple[int, ...], ...], ...]
    reply_len: int
    pauses: tuple[tuple[float, ...], ...]

    @classmethod
    def synthetic(
        cls,
        vocab: int,
        conversations: int,
        turns: int,
        system_len: int,
        user_len: int,
        reply_len: int,
        seed: int,
        think_time: float = 0.0,
    ) -> ChatWorkload:
        """Seeded token ids; pauses drawn from their own generator, so think time leaves the tokens alone."""
        rng, pause_rng = random.Random(seed), random.Random(seed + 1)

        def message(length: int) -> tuple[int, ...]:
            return tuple(rng.randrange(FIRST_PLAIN_TOKEN, vocab) for _ in range(length))

        def pause(turn: int) -> float:
            return pause_rng.expovariate(1 / think_time) if think_time > 0 and turn > 0 else 0.0

        users = tuple(tuple(message(user_len) for _ in range(turns)) for _ in range(conversations))
        pauses = tuple(tuple(pause(turn) for turn in range(turns)) for _ in range(conversations))
        return cls(message(system_len), users, reply_len, pauses)

    def describe(self) -> dict:
        return {
            "conversations": len(self.users),
            "turns": len(self.users[0]),
            "system_len": len(self.system),
            "user_len": len(self.users[0][0]),
            "reply_len": self.reply_len,
            "mean_think_time_s": statistics.fmean(p for row in self.pauses for p in row[1:])
            if self.pauses[0][1:]
            else 0.0,
        }


@dataclass(frozen=True)
class TurnResult:
    conversation: int
    turn: int
    prompt_len: int
    ttft_s: float
    reply: tuple[int, ...]


class ChatClient(Protocol):
    """Streams one greedy completion of a token-id prompt, yielding the new token ids of each message."""

    def complete(self, prompt: Sequence[int], max_tokens: int) -> AsyncIterator[list[int]]: ...

    async def close(self) -> None: ...


class TandemChatClient:
    """`affinity`: choose among the target's replicas by prompt prefix (`tandem.client.affinity`)."""

    def __init__(self, target: str, affinity: bool = False) -> None:
        from tandem.client import AsyncTandemClient

        self._client = AsyncTandemClient(target, affinity=affinity)

    async def complete(self, prompt: Sequence[int], max_tokens: int) -> AsyncIterator[list[int]]:
        async for delta in self._client.generate(
            token_ids=list(prompt), temperature=0.0, max_tokens=max_tokens, ignore_eos=True
        ):
            if delta.token_ids:
                yield list(delta.token_ids)

    async def close(self) -> None:
        await self._client.close()


class LlamaServerChatClient:
    """llama-server's native `/completion`: token-id prompt, `cache_prompt` on (its slot prompt cache),
    `return_tokens` so the history resent next turn holds exactly the generated ids."""

    def __init__(self, base_url: str) -> None:
        self._url = f"{base_url.rstrip('/')}/completion"

    async def complete(self, prompt: Sequence[int], max_tokens: int) -> AsyncIterator[list[int]]:
        from bench.backends.sse import post_sse

        payload = {
            "prompt": list(prompt),
            "n_predict": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "cache_prompt": True,
            "return_tokens": True,
            "stream": True,
        }
        async for event in post_sse(self._url, payload):
            if event.get("tokens"):
                yield list(event["tokens"])

    async def close(self) -> None:
        """Nothing to release: every request has its own connection."""


async def run_conversations(client: ChatClient, workload: ChatWorkload) -> tuple[list[TurnResult], float]:
    """Every conversation concurrently, its turns in sequence; returns the turns and the wall seconds."""

    async def conversation(index: int) -> list[TurnResult]:
        history, results = list(workload.system), []
        for turn, user in enumerate(workload.users[index], start=1):
            await asyncio.sleep(workload.pauses[index][turn - 1])
            history.extend(user)
            start, first, reply = time.perf_counter(), None, []
            async for token_ids in client.complete(history, workload.reply_len):
                first = first if first is not None else time.perf_counter() - start
                reply.extend(token_ids)
            results.append(TurnResult(index, turn, len(history), first or 0.0, tuple(reply)))
            history.extend(reply)
        return results

    start = time.perf_counter()
    per_conversation = await asyncio.gather(*(conversation(i) for i in range(len(workload.users))))
    return [turn for turns in per_conversation for turn in turns], time.perf_counter() - start


def kv_bytes_received(metrics_url: str) -> float:
    """The decode tier's `tandem:kv_transfer_bytes` counter, scraped from its Prometheus endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "tandem:kv_transfer_bytes":
            return sum(sample.value for sample in family.samples if sample.name.endswith("_total"))
    return 0.0


def summarize(turns: list[TurnResult], wall_s: float) -> dict:
    """Median TTFT overall by turn, of turn 1 and of turns >= 2 (ms), and output throughput."""
    by_turn: dict[int, list[float]] = {}
    for result in turns:
        by_turn.setdefault(result.turn, []).append(result.ttft_s * 1000)
    later = [ms for turn, values in by_turn.items() if turn >= 2 for ms in values]
    output_tokens = sum(len(result.reply) for result in turns)
    return {
        "num_requests": len(turns),
        "wall_s": wall_s,
        "output_tokens": output_tokens,
        "output_throughput": output_tokens / wall_s if wall_s else 0.0,
        "median_ttft_ms_turn_1": statistics.median(by_turn[1]),
        "median_ttft_ms_turns_2_plus": statistics.median(later) if later else None,
        "median_ttft_ms_by_turn": {str(turn): statistics.median(v) for turn, v in sorted(by_turn.items())},
    }


@contextlib.contextmanager
def serving(
    name: str, args: argparse.Namespace, model: str, caching: bool
) -> Iterator[tuple[Callable[[], ChatClient], dict]]:
    """Start one system on a fresh server (so its cache starts cold); yields a client factory (called
    inside the measuring event loop, which the client's channel belongs to) and a description."""
    from bench import servers

    cache_flag = [] if caching else ["--no-prefix-caching"]
    decode_args = [
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--kv-cache-memory",
        args.kv_cache_memory,
        *cache_flag,
    ]
    if name == "tandem-aggregated":
        decode, target = servers.tandem_decode_server(name, model, args.threads, decode_args)
        with decode:
            yield lambda: TandemChatClient(target), {"threads": {"decode": args.threads}}
    elif name == "tandem-disaggregated":
        prefill_threads = max(1, args.threads // 2)
        decode_threads = max(1, args.threads - prefill_threads)
        prefill, prefill_target = servers.tandem_prefill_server(
            f"{name}-prefill",
            model,
            prefill_threads,
            ["--max-num-batched-tokens", str(args.max_num_batched_tokens), *cache_flag],
        )
        metrics_port = servers.free_port()
        decode, target = servers.tandem_decode_server(
            f"{name}-decode",
            model,
            decode_threads,
            [*decode_args, "--metrics-port", str(metrics_port)],
            prefill_target,
        )
        with servers.running(prefill, decode):
            threads = {"prefill": prefill_threads, "decode": decode_threads}
            yield (
                lambda: TandemChatClient(target),
                {"threads": threads, "metrics": f"http://127.0.0.1:{metrics_port}/metrics"},
            )
    elif name == "llama-server":
        from bench.llama_cpp_build import default_tools

        tools = default_tools()
        if not tools.is_ready():
            raise servers.ServerStartError(
                f"llama.cpp not built in {tools.root}: run `python -m bench.llama_cpp_build`"
            )
        server, url = servers.llama_server(
            name, tools.server, tools.f32_model, args.threads, args.llama_parallel, args.llama_context
        )
        with server:
            yield (
                lambda: LlamaServerChatClient(url),
                {"threads": {"server": args.threads}, "parallel": args.llama_parallel},
            )
    else:
        raise ValueError(f"unknown system {name!r} (known: {', '.join(SYSTEMS)})")


def measure(name: str, args: argparse.Namespace, model: str, caching: bool, workload: ChatWorkload) -> dict:
    """One system on a fresh server: warm up off the workload's prefix, run the chat, summarize."""

    async def session(make_client: Callable[[], ChatClient], extra: dict) -> dict:
        client = make_client()
        warm_up = [FIRST_PLAIN_TOKEN + i for i in range(8)]
        async for _ in client.complete(warm_up, 2):
            pass
        before = kv_bytes_received(extra["metrics"]) if "metrics" in extra else None
        turns, wall_s = await run_conversations(client, workload)
        await client.close()
        result = {"system": name, "prefix_caching": caching, **extra, **summarize(turns, wall_s)}
        if before is not None:
            result["kv_bytes_per_request"] = (kv_bytes_received(extra["metrics"]) - before) / len(turns)
        result["replies"] = [[t.conversation, t.turn, list(t.reply)] for t in turns]
        return result

    with serving(name, args, model, caching) as (make_client, extra):
        result = asyncio.run(session(make_client, extra))
    logger.info(
        "%s (cache %s): median TTFT turns>=2 %.1f ms, turn 1 %.1f ms",
        name,
        "on" if caching else "off",
        result["median_ttft_ms_turns_2_plus"] or float("nan"),
        result["median_ttft_ms_turn_1"],
    )
    return result


def compare_runs(runs: list[dict]) -> list[dict]:
    """Per tandem system: the cache-on/off ratios of TTFT (turns >= 2) and KV bytes, and reply equality."""
    rows = []
    for name in sorted({run["system"] for run in runs}):
        on = next((r for r in runs if r["system"] == name and r["prefix_caching"]), None)
        off = next((r for r in runs if r["system"] == name and not r["prefix_caching"]), None)
        if on is None or off is None:
            continue
        row = {
            "system": name,
            "ttft_turns_2_plus_on_over_off": on["median_ttft_ms_turns_2_plus"]
            / off["median_ttft_ms_turns_2_plus"],
            "replies_identical": on["replies"] == off["replies"],
        }
        if off.get("kv_bytes_per_request"):
            row["kv_bytes_on_over_off"] = on["kv_bytes_per_request"] / off["kv_bytes_per_request"]
        rows.append(row)
    return rows


def draw_ttft_by_turn(document: dict, out: Path) -> Path:
    from bench.plots import pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in document["runs"]:
        by_turn = run["median_ttft_ms_by_turn"]
        label = run["system"] + (
            "" if run["system"] == "llama-server" else f" (cache {'on' if run['prefix_caching'] else 'off'})"
        )
        ax.plot([int(t) for t in by_turn], list(by_turn.values()), marker="o", label=label)
    ax.set_xticks(range(1, document["workload"]["turns"] + 1))
    ax.set_xlabel("turn (history resent each turn)")
    ax.set_ylabel("median TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title(f"multi-turn chat: {document['workload']['system_len']}-token shared system prompt")
    ax.grid(alpha=0.3)
    ax.legend()
    return save(plt, fig, out / "multi_turn_ttft_by_turn.png")


def run(args: argparse.Namespace) -> int:
    from bench import session
    from bench.servers import ServerStartError

    model_dir, workload = model_and_workload(args)
    document = session.header(
        "multi-turn", model=model_dir.name, workload=workload.describe(), runs=[], skipped={}
    )
    for name in [n.strip() for n in args.systems.split(",") if n.strip()]:
        for caching in (True,) if name == "llama-server" else (False, True):
            try:
                document["runs"].append(measure(name, args, str(model_dir), caching, workload))
            except ServerStartError as exc:
                logger.warning("skipping %s: %s", name, exc)
                document["skipped"][name] = str(exc)
                break
    document["cache_on_vs_off"] = compare_runs(document["runs"])
    session.finish(document, args.out_dir, name="multi_turn")
    print(
        json.dumps({"cache_on_vs_off": document["cache_on_vs_off"], "skipped": document["skipped"]}, indent=2)
    )
    for run_ in document["runs"]:
        print(
            f"{run_['system']:<22} cache {'on ' if run_['prefix_caching'] else 'off'}  "
            f"TTFT turns>=2 {run_['median_ttft_ms_turns_2_plus'] or float('nan'):9.1f} ms  "
            f"turn 1 {run_['median_ttft_ms_turn_1']:9.1f} ms  {run_['output_throughput']:7.1f} tok/s"
            + (
                f"  KV {run_['kv_bytes_per_request'] / 1e6:.2f} MB/req"
                if "kv_bytes_per_request" in run_
                else ""
            )
        )
    if not args.no_plots and document["runs"]:
        logger.info("wrote %s", draw_ttft_by_turn(document, args.out_dir))
    return 0
