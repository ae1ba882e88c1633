"""`tandem bench replicas`: two decode replicas, prefix affinity against round robin.

`--topology disaggregated` (the default) puts the replicas behind one prefill tier; decode replicas
prefill a prompt themselves when fewer than `--local-prefill-threshold` of its tokens are uncached, as
llm-d sends only long uncached prompts to prefill. `--topology aggregated` has no prefill tier. The
multi-turn chat of `bench.multi_turn` (C conversations x T turns, a shared system prompt, each turn
resending the whole history) runs four times, each on fresh servers so every cache starts cold:

- `one-replica`: one decode replica and the prefill tier, the reference hit rate;
- `round-robin`: two decode replicas, the client spreading calls with gRPC's round_robin;
- `affinity`: two decode replicas, the client with `affinity=True` (`tandem.client.affinity`);
- `affinity-kill`: as `affinity`, and one replica is killed (SIGKILL) once a third of the turns are done.
  A turn cut off mid-stream is sent again whole (the client itself retries a call that got no answer),
  so a conversation is lost only if a turn fails twice: the run reports how many were.

Reported per run: the decode replicas' prefix-cache hit rate (hit tokens / queried tokens, summed over
the replicas' `tandem:prefix_cache_*` counters), median TTFT of turns >= 2 and of turn 1, throughput,
and the affinity / round-robin TTFT ratio. Writes `replicas_<topology>.json` to `--out-dir`.

    tandem bench replicas                                     # 8 conversations x 5 turns (about 5 min)
    tandem bench replicas --conversations 2 --turns 2 --system-len 48 --runs affinity   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import shlex
import signal
import statistics
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from bench.compare import add_decode_args
from bench.multi_turn import (
    FIRST_PLAIN_TOKEN,
    ChatClient,
    ChatWorkload,
    TandemChatClient,
    TurnResult,
    add_workload_arguments,
    model_and_workload,
    summarize,
)
from bench.report import results_dir

logger = logging.getLogger(__name__)

RUNS = ("one-replica", "round-robin", "affinity", "affinity-kill")
# What share of the turns is done when `affinity-kill` kills a replica.
KILL_AFTER_SHARE = 1 / 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser, turns=5)
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma list (default: {','.join(RUNS)})")
    parser.add_argument("--kv-cache-memory", default="512MiB", help="each tier's KV pool (default: 512MiB)")
    add_decode_args(parser, "every replica of every run")
    parser.add_argument(
        "--topology",
        choices=("disaggregated", "aggregated"),
        default="disaggregated",
        help="decode replicas behind one prefill tier, or each prefilling itself (default: disaggregated)",
    )
    parser.add_argument(
        "--local-prefill-threshold",
        type=int,
        default=256,
        help="decode replicas prefill prompts with fewer uncached tokens themselves, as llm-d sends only "
        "long uncached prompts to prefill (default: 256; 0: every prompt to the prefill tier)",
    )
    parser.add_argument("--out-dir", type=Path, default=results_dir())


class Replicas:
    """One prefill tier and N decode replicas as processes; `kill` takes one replica down hard."""

    def __init__(
        self,
        model: str,
        count: int,
        kv_cache_memory: str,
        local_prefill_threshold: int | None,
        decode_args: Sequence[str] = (),
    ) -> None:
        """`local_prefill_threshold` None: no prefill tier, each replica prefills itself (aggregated)."""
        from bench import servers

        sizing = ["--kv-cache-memory", kv_cache_memory]
        local, prefill_target, self.prefill = [], None, None
        if local_prefill_threshold is not None:
            local = ["--local-prefill-threshold", str(local_prefill_threshold)]
            self.prefill, prefill_target = servers.tandem_prefill_server("replicas-prefill", model, 1, sizing)
        self.decodes, self.targets, self.metrics = [], [], []
        for index in range(count):
            port = servers.free_port()
            decode, target = servers.tandem_decode_server(
                f"replicas-decode-{index}",
                model,
                1,
                [*sizing, *local, "--metrics-port", str(port), *decode_args],
                prefill_target,
            )
            self.decodes.append(decode)
            self.targets.append(target)
            self.metrics.append(f"http://127.0.0.1:{port}/metrics")
        self.killed: set[int] = set()

    @contextlib.contextmanager
    def running(self) -> Iterator[Replicas]:
        from bench import servers

        with servers.running(*([self.prefill] if self.prefill else []), *self.decodes):
            yield self

    @property
    def target(self) -> str:
        return self.targets[0] if len(self.targets) == 1 else "ipv4:" + ",".join(self.targets)

    def kill(self, index: int) -> None:
        import os

        os.killpg(self.decodes[index].pid, signal.SIGKILL)
        self.killed.add(index)

    def cache_counters(self) -> tuple[float, float]:
        """(queried, hit) prompt tokens summed over the live replicas."""
        from prometheus_client.parser import text_string_to_metric_families

        queried = hit = 0.0
        for index, url in enumerate(self.metrics):
            if index in self.killed:
                continue
            with urllib.request.urlopen(url, timeout=10) as reply:
                text = reply.read().decode()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == "tandem:prefix_cache_queries_total":
                        queried += sample.value
                    elif sample.name == "tandem:prefix_cache_hits_total":
                        hit += sample.value
        return queried, hit


async def converse(
    client: ChatClient, workload: ChatWorkload, on_turn: Callable[[], None] | None = None
) -> tuple[list[TurnResult], float, int, int]:
    """Every conversation concurrently, its turns in sequence, a failed turn sent again once; returns
    the turns, the wall seconds, the turns sent again and the conversations lost."""
    from tandem.client import TandemError

    resent = lost = 0

    async def conversation(index: int) -> list[TurnResult]:
        nonlocal resent, lost
        history, results = list(workload.system), []
        for turn, user in enumerate(workload.users[index], start=1):
            await asyncio.sleep(workload.pauses[index][turn - 1])
            history.extend(user)
            for attempt in range(2):
                start, first, reply = time.perf_counter(), None, []
                try:
                    async for token_ids in client.complete(history, workload.reply_len):
                        first = first if first is not None else time.perf_counter() - start
                        reply.extend(token_ids)
                    break
                except TandemError as exc:
                    logger.warning("conversation %d turn %d failed (%s)", index, turn, exc)
                    if attempt:
                        lost += 1
                        return results
                    resent += 1
            results.append(TurnResult(index, turn, len(history), first or 0.0, tuple(reply)))
            history.extend(reply)
            if on_turn is not None:
                on_turn()
        return results

    start = time.perf_counter()
    per_conversation = await asyncio.gather(*(conversation(i) for i in range(len(workload.users))))
    turns = [turn for results in per_conversation for turn in results]
    return turns, time.perf_counter() - start, resent, lost


def measure(name: str, args: argparse.Namespace, model: str, workload: ChatWorkload) -> dict:
    threshold = args.local_prefill_threshold if args.topology == "disaggregated" else None
    replicas = Replicas(
        model,
        1 if name == "one-replica" else 2,
        args.kv_cache_memory,
        threshold,
        shlex.split(args.decode_args),
    )
    total_turns = len(workload.users) * len(workload.users[0])

    async def session() -> dict:
        client = TandemChatClient(replicas.target, affinity=name.startswith("affinity"))
        done = 0

        def on_turn() -> None:
            nonlocal done
            done += 1
            if name == "affinity-kill" and done == int(total_turns * KILL_AFTER_SHARE):
                logger.info("killing decode replica 1 after %d turns", done)
                replicas.kill(1)

        for warm in range(len(replicas.targets)):  # one request per replica, off the workload's prefix
            async for _ in client.complete([FIRST_PLAIN_TOKEN + warm] * 8, 2):
                pass
        before = replicas.cache_counters()
        turns, wall_s, resent, lost = await converse(client, workload, on_turn)
        await client.close()
        queried, hit = (now - then for now, then in zip(replicas.cache_counters(), before, strict=True))
        return {
            "run": name,
            "decode_replicas": len(replicas.targets),
            "affinity": name.startswith("affinity"),
            "prefix_cache_hit_rate": hit / queried if queried else 0.0,
            "turns_sent_again": resent,
            "conversations_lost": lost,
            **summarize(turns, wall_s),
            "replies": [[t.conversation, t.turn, list(t.reply)] for t in turns],
        }

    with replicas.running():
        result = asyncio.run(session())
    logger.info(
        "%s: hit rate %.2f, median TTFT turns>=2 %.1f ms, lost %d",
        name,
        result["prefix_cache_hit_rate"],
        result["median_ttft_ms_turns_2_plus"] or float("nan"),
        result["conversations_lost"],
    )
    return result


def compare(runs: list[dict]) -> dict:
    """The issue's two figures: affinity's hit rate against one replica's, its TTFT against round robin's."""
    by_name = {run["run"]: run for run in runs}
    found: dict = {}
    one, rr, aff = by_name.get("one-replica"), by_name.get("round-robin"), by_name.get("affinity")
    if aff and one and one["prefix_cache_hit_rate"]:
        found["hit_rate_affinity_over_one_replica"] = (
            aff["prefix_cache_hit_rate"] / one["prefix_cache_hit_rate"]
        )
    if aff and rr and rr["median_ttft_ms_turns_2_plus"]:
        found["ttft_turns_2_plus_affinity_over_round_robin"] = (
            aff["median_ttft_ms_turns_2_plus"] / rr["median_ttft_ms_turns_2_plus"]
        )
        found["ttft_all_turns_affinity_over_round_robin"] = statistics.median(
            aff["median_ttft_ms_by_turn"].values()
        ) / statistics.median(rr["median_ttft_ms_by_turn"].values())
    if aff and rr:
        found["replies_identical_affinity_vs_round_robin"] = aff["replies"] == rr["replies"]
    return found


def run(args: argparse.Namespace) -> int:
    from bench import session

    model_dir, workload = model_and_workload(args)
    document = session.header(
        "replicas",
        model=model_dir.name,
        workload=workload.describe(),
        topology=args.topology,
        decode_args=args.decode_args,
        local_prefill_threshold=(args.local_prefill_threshold if args.topology == "disaggregated" else None),
    )
    document["runs"] = [
        measure(name.strip(), args, str(model_dir), workload) for name in args.runs.split(",")
    ]
    document["found"] = compare(document["runs"])
    session.finish(document, args.out_dir, name=f"replicas_{args.topology}")
    print(f"host: {document['host']}; {args.topology}")
    for run_ in document["runs"]:
        print(
            f"{run_['run']:<14} hit rate {run_['prefix_cache_hit_rate']:.2f}  "
            f"TTFT turns>=2 {run_['median_ttft_ms_turns_2_plus'] or float('nan'):8.1f} ms  "
            f"turn 1 {run_['median_ttft_ms_turn_1']:8.1f} ms  {run_['output_throughput']:6.1f} tok/s  "
            f"resent {run_['turns_sent_again']}  lost {run_['conversations_lost']}"
        )
    print(json.dumps(document["found"], indent=2))
    return 0
