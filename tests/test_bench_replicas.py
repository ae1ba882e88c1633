"""`tandem bench replicas`' own decisions, without servers: a failed turn is sent again once and a turn
that fails twice loses its conversation (and only it); the figures it reports are the right ratios."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from bench.multi_turn import ChatWorkload
from bench.replicas import compare, converse
from tandem.client import Unavailable

WORKLOAD = ChatWorkload(
    system=(1, 2, 3),
    users=(((10,), (11,), (12,)), ((20,), (21,), (22,))),
    reply_len=2,
    pauses=((0.0, 0.0, 0.0), (0.0, 0.0, 0.0)),
)


class FlakyClient:
    """Replies two tokens per turn; fails the calls whose (first user token, attempt) is listed."""

    def __init__(self, failures: set[tuple[int, int]]) -> None:
        self.failures = failures
        self.attempts: dict[int, int] = {}

    async def complete(self, prompt: Sequence[int], max_tokens: int) -> AsyncIterator[list[int]]:
        user = prompt[-1]
        attempt = self.attempts[user] = self.attempts.get(user, 0) + 1
        yield [user + 100]
        if (user, attempt) in self.failures:
            raise Unavailable("Stream removed (Socket closed)")
        yield [user + 200]

    async def close(self) -> None:
        """Nothing to close."""


def test_a_turn_cut_off_once_is_sent_again_whole_and_nothing_is_lost():
    client = FlakyClient({(11, 1)})
    turns, _, resent, lost = asyncio.run(converse(client, WORKLOAD))
    assert (resent, lost) == (1, 0) and len(turns) == 6
    second = next(t for t in turns if t.conversation == 0 and t.turn == 2)
    assert second.reply == (111, 211)  # the resent turn's own reply, not the cut-off one glued on
    third = next(t for t in turns if t.conversation == 0 and t.turn == 3)
    assert third.prompt_len == 3 + 1 + 2 + 1 + 2 + 1  # the history holds each reply once


def test_a_turn_failing_twice_loses_its_conversation_only():
    client = FlakyClient({(21, 1), (21, 2)})
    turns, _, resent, lost = asyncio.run(converse(client, WORKLOAD))
    assert (resent, lost) == (1, 1)
    assert sorted((t.conversation, t.turn) for t in turns) == [(0, 1), (0, 2), (0, 3), (1, 1)]


def _run(name: str, hit_rate: float, ttft_later: float, by_turn: dict[str, float]) -> dict:
    return {
        "run": name,
        "prefix_cache_hit_rate": hit_rate,
        "median_ttft_ms_turns_2_plus": ttft_later,
        "median_ttft_ms_by_turn": by_turn,
        "replies": [[0, 1, [5, 6]]],
    }


def test_compare_reports_affinity_against_one_replica_and_round_robin():
    found = compare(
        [
            _run("one-replica", 0.8, 900.0, {"1": 1000.0, "2": 900.0}),
            _run("round-robin", 0.6, 1000.0, {"1": 1200.0, "2": 1000.0, "3": 800.0}),
            _run("affinity", 0.76, 500.0, {"1": 1100.0, "2": 500.0, "3": 400.0}),
        ]
    )
    assert found["hit_rate_affinity_over_one_replica"] == 0.76 / 0.8
    assert found["ttft_turns_2_plus_affinity_over_round_robin"] == 0.5
    assert found["ttft_all_turns_affinity_over_round_robin"] == 500.0 / 1000.0
    assert found["replies_identical_affinity_vs_round_robin"] is True
    assert compare([_run("affinity", 0.7, 1.0, {"1": 1.0})]) == {}
