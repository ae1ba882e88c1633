"""How tokens become messages: the stream-interval buffer (merges a choice's deltas, never holds a first
token or an ending) and the edge's coalescing of deltas that are already waiting."""

from __future__ import annotations

from dataclasses import dataclass

from decode_service.engine_core.messages import ChoiceState, Delta, Failure
from decode_service.front_door.streams import StreamIntervalBuffer, coalesce

STATE = ChoiceState(3, None, 1.0, 2.0, 3.0, 0, False)
BOOM = Failure("INVALID_ARGUMENT", "boom")


@dataclass(frozen=True)
class Choice:
    """One choice of one submission, as deltas name it."""

    submission: int
    index: int = 0


def token(
    choice: Choice, token_id: int, finish: str | None = None, state: ChoiceState | None = None
) -> Delta:
    """The delta of one engine step for `choice`."""
    return Delta(choice.submission, choice.index, [token_id], [], finish, None, state)


def failed(choice: Choice) -> Delta:
    return Delta(choice.submission, choice.index, [], [], None, BOOM, None)


def summary(deltas: list[Delta]) -> list[tuple]:
    return [(d.submission, d.index, d.token_ids, d.finish_reason, d.error is not None) for d in deltas]


def test_groups_per_request_and_flushes_endings():
    sent: list[list[Delta]] = []
    buffer = StreamIntervalBuffer(3, sent.append)
    a, b = Choice(1), Choice(2)
    buffer([token(a, 1), token(b, 1)])  # first tokens go out at once
    buffer([token(a, 2), token(b, 2)])
    buffer([token(a, 3), token(b, 3, finish="stop")])
    buffer([token(a, 4)])
    buffer([failed(a)])
    assert [entry for step in sent for entry in summary(step)] == [
        (1, 0, [1], None, False),
        (2, 0, [1], None, False),
        (2, 0, [2, 3], "stop", False),
        (1, 0, [2, 3, 4], None, False),
        (1, 0, [], None, True),
    ]


def test_interval_one_passes_every_step_through():
    sent: list[list[Delta]] = []
    buffer = StreamIntervalBuffer(1, sent.append)
    a = Choice(1)
    step = [token(a, 1)]
    buffer(step)
    buffer([token(a, 2)])
    assert sent[0] is step and len(sent) == 2


def test_choices_sharing_a_submission_are_held_apart():
    sent: list[list[Delta]] = []
    buffer = StreamIntervalBuffer(2, sent.append)
    first, second = Choice(1), Choice(1, index=1)
    buffer([token(first, 1), token(second, 5)])
    buffer([token(first, 2), token(second, 6)])
    buffer([token(first, 3), token(second, 7)])
    flat = [(d.index, d.token_ids) for step in sent for d in step]
    assert flat == [(0, [1]), (1, [5]), (0, [2, 3]), (1, [6, 7])]


def test_coalesce_merges_each_choice_run_in_order():
    a, b = Choice(1), Choice(1, index=1)  # two choices of one stream interleave in its queue
    waiting = [token(a, 1, state=STATE), token(b, 1), token(a, 2), token(b, 2, finish="stop"), token(a, 3)]
    merged = coalesce(waiting)
    assert summary(merged) == [(1, 0, [1, 2, 3], None, False), (1, 1, [1, 2], "stop", False)]
    assert merged[0].state == STATE, (
        "the core sends a choice's state on its first delta only: merging keeps it"
    )


def test_coalesce_keeps_an_error_apart_and_nothing_joins_an_ended_delta():
    a, b = Choice(1), Choice(2)
    waiting = [token(a, 1), token(a, 2), failed(a), token(b, 7, finish="length"), token(b, 8)]
    assert summary(coalesce(waiting)) == [
        (1, 0, [1, 2], None, False),
        (1, 0, [], None, True),
        (2, 0, [7], "length", False),
        (2, 0, [8], None, False),
    ]


def test_coalesce_of_one_delta_is_that_delta():
    only = token(Choice(1), 1)
    assert coalesce([only]) == [only]
