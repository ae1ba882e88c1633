"""How tokens become messages: the stream-interval buffer (merges a request's deltas, never holds a first
token or an ending) and the edge's coalescing of deltas that are already waiting."""

from __future__ import annotations

from base.errors import InvalidRequestError
from decode_service.engine_core.request import ServedRequest, StreamDelta
from decode_service.front_door.streams import StreamIntervalBuffer, coalesce
from engine.params import SamplingParams, StoppingParams
from engine.sequence import FinishReason, Sequence


def request(request_id: str, index: int = 0) -> ServedRequest:
    seq = Sequence(request_id, [1, 2], SamplingParams(), StoppingParams(max_tokens=9), None)
    return ServedRequest(seq, index=index)


def token(req: ServedRequest, token_id: int, **kwargs) -> StreamDelta:
    """The delta of one engine step; like the engine, the sequence holds the token before delivery."""
    req.seq.token_ids.append(token_id)
    return StreamDelta(req, token_ids=[token_id], **kwargs)


def test_groups_per_request_and_flushes_endings():
    sent: list[list[StreamDelta]] = []
    buffer = StreamIntervalBuffer(3, sent.append)
    a, b = request("a"), request("b")
    buffer([token(a, 1), token(b, 1)])  # first tokens go out at once
    buffer([token(a, 2), token(b, 2)])
    buffer([token(a, 3), token(b, 3, finish_reason=FinishReason.STOP)])
    buffer([token(a, 4)])
    buffer([StreamDelta(a, error=InvalidRequestError("boom"))])
    flat = [
        (d.request.request_id, d.token_ids, d.finish_reason, d.error is not None)
        for step in sent
        for d in step
    ]
    assert flat == [
        ("a", [1], None, False),
        ("b", [1], None, False),
        ("b", [2, 3], FinishReason.STOP, False),
        ("a", [2, 3, 4], None, False),
        ("a", [], None, True),
    ]


def test_interval_one_passes_every_step_through():
    sent: list[list[StreamDelta]] = []
    buffer = StreamIntervalBuffer(1, sent.append)
    a = request("a")
    step = [token(a, 1)]
    buffer(step)
    buffer([token(a, 2)])
    assert sent[0] is step and len(sent) == 2


def test_first_tokens_go_out_at_once_when_the_sequence_holds_only_the_prompt():
    """The front door's copy of a request in the process shape: its sequence never gets the tokens."""
    sent: list[list[StreamDelta]] = []
    buffer = StreamIntervalBuffer(3, sent.append)
    a = request("a")
    buffer([StreamDelta(a, token_ids=[7])])
    buffer([StreamDelta(a, token_ids=[8])])
    assert [[d.token_ids for d in step] for step in sent] == [[[7]]]


def test_choices_sharing_an_id_are_held_apart():
    sent: list[list[StreamDelta]] = []
    buffer = StreamIntervalBuffer(2, sent.append)
    first = request("a")
    second = request("a", index=1)
    buffer([token(first, 1), token(second, 5)])
    buffer([token(first, 2), token(second, 6)])
    buffer([token(first, 3), token(second, 7)])
    flat = [(d.request.index, d.token_ids) for step in sent for d in step]
    assert flat == [(0, [1]), (1, [5]), (0, [2, 3]), (1, [6, 7])]


def summary(deltas: list[StreamDelta]) -> list[tuple]:
    return [(d.request.request_id, d.token_ids, d.finish_reason, d.error is not None) for d in deltas]


def test_coalesce_merges_each_choice_run_in_order():
    a, b = request("a"), request("b")  # two choices of one stream interleave in its queue
    waiting = [
        token(a, 1),
        token(b, 1),
        token(a, 2),
        token(b, 2, finish_reason=FinishReason.STOP),
        token(a, 3),
    ]
    assert summary(coalesce(waiting)) == [
        ("a", [1, 2, 3], None, False),
        ("b", [1, 2], FinishReason.STOP, False),
    ]


def test_coalesce_keeps_an_error_apart_and_nothing_joins_an_ended_delta():
    a, b = request("a"), request("b")
    ended = token(b, 7, finish_reason=FinishReason.LENGTH)
    waiting = [
        token(a, 1),
        token(a, 2),
        StreamDelta(a, error=InvalidRequestError("boom")),
        ended,
        token(b, 8),
    ]
    assert summary(coalesce(waiting)) == [
        ("a", [1, 2], None, False),
        ("a", [], None, True),
        ("b", [7], FinishReason.LENGTH, False),
        ("b", [8], None, False),
    ]


def test_coalesce_of_one_delta_is_that_delta():
    a = request("a")
    only = token(a, 1)
    assert coalesce([only]) == [only]
