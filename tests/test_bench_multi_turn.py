"""The multi-turn chat benchmark's pieces without servers: the workload, the conversation driver (history
resent with the server's own replies), the summary and the cache on/off comparison."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from bench.multi_turn import FIRST_PLAIN_TOKEN, ChatWorkload, compare_runs, run_conversations, summarize


class EchoClient:
    """Replies with the prompt's length repeated, and records every prompt it was sent."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    async def complete(self, prompt: Sequence[int], max_tokens: int) -> AsyncIterator[list[int]]:
        self.prompts.append(list(prompt))
        for _ in range(max_tokens):
            yield [len(prompt)]

    async def close(self) -> None:
        return


def test_workload_shares_one_system_prompt_and_avoids_special_tokens():
    workload = ChatWorkload.synthetic(
        500, conversations=3, turns=2, system_len=40, user_len=5, reply_len=3, seed=1
    )
    assert workload.describe() == {
        "conversations": 3,
        "turns": 2,
        "system_len": 40,
        "user_len": 5,
        "reply_len": 3,
        "mean_think_time_s": 0.0,
    }
    tokens = [*workload.system, *(t for c in workload.users for m in c for t in m)]
    assert all(FIRST_PLAIN_TOKEN <= t < 500 for t in tokens)
    assert workload == ChatWorkload.synthetic(500, 3, 2, 40, 5, 3, seed=1)


def test_think_time_pauses_later_turns_only_and_leaves_the_tokens_alone():
    plain = ChatWorkload.synthetic(500, 40, 3, 10, 4, 2, seed=3)
    thinking = ChatWorkload.synthetic(500, 40, 3, 10, 4, 2, seed=3, think_time=2.0)
    assert (thinking.system, thinking.users) == (plain.system, plain.users)
    assert all(row[0] == 0.0 for row in thinking.pauses) and all(
        p == 0.0 for row in plain.pauses for p in row
    )
    later = [p for row in thinking.pauses for p in row[1:]]
    assert all(p > 0 for p in later) and len(set(later)) == len(later)
    assert 1.0 < thinking.describe()["mean_think_time_s"] < 3.0  # 80 draws of an exponential, mean 2


def test_each_turn_resends_the_history_with_the_servers_replies():
    workload = ChatWorkload.synthetic(
        500, conversations=2, turns=3, system_len=10, user_len=4, reply_len=2, seed=2
    )
    client = EchoClient()
    turns, wall_s = asyncio.run(run_conversations(client, workload))
    assert len(turns) == 6 and wall_s > 0
    for result in turns:
        users = workload.users[result.conversation][: result.turn]
        assert result.prompt_len == 10 + 4 * result.turn + 2 * (result.turn - 1)
        assert result.reply == (result.prompt_len, result.prompt_len)
        sent = next(p for p in client.prompts if len(p) == result.prompt_len and p[10:14] == list(users[0]))
        assert sent[: len(workload.system)] == list(workload.system)
    summary = summarize(turns, wall_s)
    assert summary["num_requests"] == 6 and summary["output_tokens"] == 12
    assert set(summary["median_ttft_ms_by_turn"]) == {"1", "2", "3"}


def test_cache_on_vs_off_ratios_and_reply_equality():
    def run(caching: bool, ttft: float, kv: float, replies: list) -> dict:
        return {
            "system": "tandem-disaggregated",
            "prefix_caching": caching,
            "median_ttft_ms_turns_2_plus": ttft,
            "kv_bytes_per_request": kv,
            "replies": replies,
        }

    rows = compare_runs([run(False, 200.0, 4e6, [[0, 1, [5]]]), run(True, 50.0, 1e6, [[0, 1, [5]]])])
    assert rows == [
        {
            "system": "tandem-disaggregated",
            "ttft_turns_2_plus_on_over_off": 0.25,
            "replies_identical": True,
            "kv_bytes_on_over_off": 0.25,
        }
    ]
    assert compare_runs([run(True, 50.0, 1e6, [])]) == [], "a system measured one way only has no ratio"
