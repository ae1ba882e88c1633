"""The front door's heartbeat on the engine core (`engine_core.core_client.CoreHeartbeat`), on a real
event loop with a stand-in core: an answering core is never called silent, a silent one is called silent
once, and an answer that waited in the pipe counts."""

from __future__ import annotations

import asyncio

from decode_service.engine_core.core_client import CoreHeartbeat

TIMEOUT_S = 0.2


def run(
    answer_pings: bool, answer_when_read: bool = False, pings_to_see: int = 6
) -> tuple[list[int], list[float]]:
    """Run a heartbeat over a core that answers at once, never, or only when its pipe is read; returns
    the pings sent and the silences reported."""
    pings: list[int] = []
    silences: list[float] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        waiting: list[int] = []

        def ping(number: int) -> None:
            pings.append(number)
            if answer_pings:
                loop.call_soon(heartbeat.answered, number)
            elif answer_when_read:
                waiting.append(number)

        def read_answers() -> None:
            while waiting:
                heartbeat.answered(waiting.pop())

        heartbeat = CoreHeartbeat(loop, TIMEOUT_S, ping, read_answers, silences.append)
        heartbeat.start()
        while len(pings) < pings_to_see and not silences:
            await asyncio.sleep(0.01)
        if silences:
            # Once called silent, the heartbeat stays quiet: no more pings, no second verdict.
            seen = len(pings)
            await asyncio.sleep(3 * TIMEOUT_S)
            assert len(pings) == seen
        heartbeat.stop()

    asyncio.run(main())
    return pings, silences


def test_an_answering_core_is_pinged_again_and_never_called_silent():
    pings, silences = run(answer_pings=True)
    assert pings == [1, 2, 3, 4, 5, 6] and silences == []


def test_a_silent_core_is_called_silent_once_after_the_timeout():
    pings, silences = run(answer_pings=False)
    assert pings == [1]
    assert len(silences) == 1 and silences[0] >= TIMEOUT_S


def test_an_answer_waiting_in_the_pipe_counts():
    """When the event loop itself was late, the answer may wait unread: it is read before any verdict."""
    pings, silences = run(answer_pings=False, answer_when_read=True, pings_to_see=3)
    assert pings == [1, 2, 3] and silences == []
