"""A stream's way from the engine step to its writer: the mailbox (order, wake-up, cancelled reader), the
hub's routing into it (past --max-stream-buffer the request is aborted and its stream fails), and
`Generation.next_responses` (merged batches; an engine error after the tokens before it; a stop string
ending one choice in the front door)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from decode_service.engine_core.messages import ChoiceState, Delta, Failure, Submit
from decode_service.front_door.choice_text import ChoiceText
from decode_service.front_door.generation import Generation
from decode_service.front_door.streams import Mailbox, StreamHub
from engine.params import SamplingParams, StoppingParams
from serving.errors import RelayedStatusError


def test_take_all_hands_over_everything_waiting_in_order():
    async def scenario() -> None:
        mailbox: Mailbox[int] = Mailbox()
        for item in (1, 2, 3):
            mailbox.put(item)
        assert len(mailbox) == 3
        assert await mailbox.take_all() == [1, 2, 3]
        assert len(mailbox) == 0
        mailbox.put(4)
        assert await mailbox.take_all() == [4]

    asyncio.run(scenario())


def test_a_waiting_reader_wakes_with_what_arrived_before_it_ran():
    async def scenario() -> None:
        mailbox: Mailbox[str] = Mailbox()
        reader = asyncio.ensure_future(mailbox.take_all())
        await asyncio.sleep(0)
        assert not reader.done()
        mailbox.put("a")
        mailbox.put("b")  # the reader was woken by "a" but has not run yet
        assert await reader == ["a", "b"]

    asyncio.run(scenario())


def test_a_reader_cancelled_while_waiting_loses_nothing():
    async def scenario() -> None:
        mailbox: Mailbox[str] = Mailbox()
        reader = asyncio.ensure_future(mailbox.take_all())
        await asyncio.sleep(0)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        mailbox.put("kept")  # must not try to wake the cancelled reader
        assert await mailbox.take_all() == ["kept"]

    asyncio.run(scenario())


_SUBMISSIONS = iter(range(1, 1_000_000))
# The state the core sends on a choice's first delta once it forked the request's other choices.
FORKED = ChoiceState(0, None, None, None, None, 0, True)


def served(request_id: str, n: int = 1, stop: tuple[str, ...] = ()) -> Submit:
    return Submit(
        next(_SUBMISSIONS),
        request_id,
        [1, 2],
        SamplingParams(),
        StoppingParams(max_tokens=50, stop=stop),
        "",
        None,
        0,
        "",
        None,
        n,
    )


def delta(
    request: Submit,
    token_ids: list[int] | None = None,
    index: int = 0,
    finish: str | None = None,
    error: Failure | None = None,
    state: ChoiceState | None = None,
) -> Delta:
    return Delta(request.submission, index, token_ids or [], [], finish, error, state)


def token(request: Submit, token_id: int, **kwargs) -> Delta:
    return delta(request, [token_id], **kwargs)


class _TagTokenizer:
    """Token i reads "<i>": the text shows which tokens made it."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{token_id}>" for token_id in token_ids)

    def decode_stream(self, context: list[int], skip_special_tokens: bool = True) -> None:
        return None  # no Rust stream: the detokenizer's window decodes


class _EngineLoop:
    """Records the aborts and stops a stream sends to the engine."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.stopped: list[tuple[str, int, str]] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stop_at_string(self, request_id: str, index: int, stop: str) -> None:
        self.stopped.append((request_id, index, stop))


def open_stream(hub: StreamHub, request: Submit, engine_loop: _EngineLoop) -> Generation:
    hub.reserve(request.request_id)
    return Generation(
        request,
        hub.open(request),
        hub,
        engine_loop,  # type: ignore[arg-type]
        arrival=0.0,
        new_text=lambda: ChoiceText(_TagTokenizer(), request.prompt_token_ids, request.stopping, True),  # type: ignore[arg-type]
    )


def test_a_stream_past_its_buffer_is_aborted_and_fails_after_what_it_holds():
    async def scenario() -> None:
        engine_loop = _EngineLoop()
        hub = StreamHub(asyncio.get_running_loop(), capacity=4, max_buffer=2, abort=engine_loop.abort)
        slow, other = served("slow"), served("other")
        generation = open_stream(hub, slow, engine_loop)
        open_stream(hub, other, engine_loop)
        hub._dispatch([token(slow, 1), token(other, 1)])
        hub._dispatch([token(slow, 2)])
        hub._dispatch([token(slow, 3), token(other, 2)])  # the third undelivered message: over the limit
        hub._dispatch([token(slow, 4)])  # dropped: the stream no longer takes deltas
        assert engine_loop.aborted == ["slow"] and hub.num_overflowed == 1
        assert hub.num_working == 1  # the overflowed stream gave its slot back
        first = await generation.next_responses()
        assert [list(message.token_ids) for message in first] == [[1, 2]]
        with pytest.raises(RelayedStatusError, match="--max-stream-buffer") as failed:
            await generation.next_responses()
        assert failed.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        generation.close()
        assert "slow" not in hub and "other" in hub

    asyncio.run(scenario())


def test_the_writers_one_step_woke_all_build_their_messages_before_any_returns_them():
    """So that the step's writes leave together, not spaced by each writer's building time."""

    async def scenario() -> None:
        engine_loop = _EngineLoop()
        hub = StreamHub(asyncio.get_running_loop(), capacity=4, max_buffer=16)
        requests = [served("a"), served("b"), served("c")]
        generations = [open_stream(hub, request, engine_loop) for request in requests]
        order: list[tuple[str, str]] = []

        async def writer(generation: Generation) -> None:
            responses = await generation.next_responses()
            order.append(("write", responses[0].request_id))

        writers = [asyncio.ensure_future(writer(generation)) for generation in generations]
        await asyncio.sleep(0)  # every writer waits on its mailbox
        built = Generation._respond

        def respond(self: Generation, delta: Delta):
            order.append(("build", self.request_id))
            return built(self, delta)

        Generation._respond = respond  # type: ignore[method-assign]
        try:
            hub._dispatch([token(request, 7) for request in requests])
            await asyncio.gather(*writers)
        finally:
            Generation._respond = built  # type: ignore[method-assign]
        assert order == [
            ("build", "a"),
            ("build", "b"),
            ("build", "c"),
            ("write", "a"),
            ("write", "b"),
            ("write", "c"),
        ]
        # A writer that finds its messages after the step's writers were released does not wait.
        hub._dispatch([token(requests[0], 8)])
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert [list(m.token_ids) for m in await generations[0].next_responses()] == [[8]]
        for generation in generations:
            generation.close()

    asyncio.run(scenario())


def test_next_responses_merges_what_waits_and_ends_after_every_choice():
    async def scenario() -> None:
        engine_loop = _EngineLoop()
        hub = StreamHub(asyncio.get_running_loop(), capacity=4, max_buffer=16)
        parent = served("req", n=2)
        generation = open_stream(hub, parent, engine_loop)
        hub._dispatch([token(parent, 5, state=FORKED), token(parent, 6, index=1, state=FORKED)])
        hub._dispatch([token(parent, 7, finish="length")])
        batch = await generation.next_responses()
        merged = [(m.index, list(m.token_ids), m.text) for m in batch]
        assert merged == [(0, [5, 7], "<5><7>"), (1, [6], "<6>")]
        assert batch[0].finish_reason != 0 and batch[1].finish_reason == 0
        hub._dispatch([delta(parent, index=1, finish="length")])
        assert [m.index for m in await generation.next_responses()] == [1]
        assert await generation.next_responses() == []
        generation.close()
        assert engine_loop.aborted == []  # it finished: nothing to abort

    asyncio.run(scenario())


def test_an_engine_error_comes_after_the_tokens_before_it():
    async def scenario() -> None:
        engine_loop = _EngineLoop()
        hub = StreamHub(asyncio.get_running_loop(), capacity=4, max_buffer=16)
        request = served("req")
        generation = open_stream(hub, request, engine_loop)
        hub._dispatch([token(request, 1)])
        hub._dispatch([delta(request, error=Failure("INVALID_ARGUMENT", "boom"))])
        assert [list(m.token_ids) for m in await generation.next_responses()] == [[1]]
        with pytest.raises(RelayedStatusError, match="boom") as failed:
            await generation.next_responses()
        assert failed.value.code is grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(scenario())


def test_closing_a_waiting_stream_aborts_its_request():
    async def scenario() -> None:
        engine_loop = _EngineLoop()
        hub = StreamHub(asyncio.get_running_loop(), capacity=4, max_buffer=16)
        generation = open_stream(hub, served("req"), engine_loop)
        reader = asyncio.ensure_future(generation.next_responses())
        await asyncio.sleep(0)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        generation.close()
        assert engine_loop.aborted == ["req"] and "req" not in hub and hub.num_working == 0

    asyncio.run(scenario())


def test_a_stop_string_ends_its_choice_for_the_client_and_the_engine_drops_it():
    async def scenario() -> None:
        engine_loop = _EngineLoop()
        hub = StreamHub(asyncio.get_running_loop(), capacity=4, max_buffer=16)
        parent = served("req", n=2, stop=("<8>",))
        generation = open_stream(hub, parent, engine_loop)
        # Choice 0 reaches the stop string at its second token, inside a merged batch of three.
        hub._dispatch([token(parent, 5, state=FORKED), token(parent, 6, index=1, state=FORKED)])
        hub._dispatch([delta(parent, [8, 9])])
        batch = await generation.next_responses()
        assert [(m.index, list(m.token_ids), m.text) for m in batch] == [(0, [5, 8], "<5>"), (1, [6], "<6>")]
        assert batch[0].stop_string == "<8>" and batch[0].usage.completion_tokens == 2
        assert engine_loop.stopped == [("req", 0, "<8>")]
        # What the engine made before the stop reached it, and its final STOP delta: dropped.
        hub._dispatch([delta(parent, [10]), delta(parent, [7], index=1)])
        hub._dispatch([delta(parent, finish="stop", state=FORKED)])
        assert [(m.index, list(m.token_ids)) for m in await generation.next_responses()] == [(1, [7])]
        hub._dispatch([delta(parent, [11], index=1, finish="length", state=FORKED)])
        assert [m.index for m in await generation.next_responses()] == [1]
        assert await generation.next_responses() == []
        generation.close()
        assert engine_loop.aborted == []

    asyncio.run(scenario())


def test_a_closed_stream_is_known_until_the_cores_last_delta_for_it():
    """Metrics still count what the core ends a cancelled request with; then the submission is forgotten."""

    async def scenario() -> None:
        engine_loop = _EngineLoop()
        hub = StreamHub(asyncio.get_running_loop(), capacity=4, max_buffer=16)
        request = served("req")
        generation = open_stream(hub, request, engine_loop)
        generation.close()
        assert engine_loop.aborted == ["req"] and "req" not in hub and hub.num_working == 0
        assert hub.request_of(request.submission) is request
        hub._dispatch([delta(request, [3])])  # made before the abort reached the core: dropped
        hub._dispatch([delta(request, finish="abort")])
        assert hub.request_of(request.submission) is None

    asyncio.run(scenario())


def test_a_lost_core_ends_every_stream_it_owed_with_its_failure():
    async def scenario() -> None:
        engine_loop = _EngineLoop()
        hub = StreamHub(asyncio.get_running_loop(), capacity=4, max_buffer=16)
        live, cancelled = served("live", n=2), served("cancelled")
        generation = open_stream(hub, live, engine_loop)
        open_stream(hub, cancelled, engine_loop).close()
        hub._dispatch([token(live, 5, state=FORKED)])
        hub.fail_all(
            Failure("UNAVAILABLE", "the engine core process exited (code -9); retry on another replica")
        )
        assert [list(m.token_ids) for m in await generation.next_responses()] == [[5]]
        with pytest.raises(RelayedStatusError, match="exited") as failed:
            await generation.next_responses()
        assert failed.value.code is grpc.StatusCode.UNAVAILABLE
        assert hub.request_of(live.submission) is None and hub.request_of(cancelled.submission) is None
        assert hub.num_working == 0

    asyncio.run(scenario())
