"""One request's way through the decode tier, whichever front door it came in by (gRPC or HTTP).

`Generations.start` checks a `GenerateRequest`'s cheap limits on the loop (`admission`), takes a slot,
validates it (on `ValidationPool`: it may tokenize), opens its stream and hands it to the engine core
(its process, or its thread with `--engine-in-process`); `Generation.next_responses` hands out the
stream's `GenerateResponse`s as they arrive.
Both front doors translate their request into a `GenerateRequest` and their answer from these messages,
so the rules, limits, logs and deltas are the same for both. Leaving a stream early (client gone,
deadline, disconnect) aborts the request and frees its blocks at once.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

import grpc

from base.errors import InvalidRequestError
from base.logs import bind_request_id, log_event, log_prompts_enabled, prompt_fields
from decode_service.engine_core.request import EngineClient, ServedRequest, StreamDelta
from decode_service.front_door.admission import check_limits, check_max_tokens_cap, num_choices, prompt_bytes
from decode_service.front_door.choice_text import (
    AnswerParser,
    ChoiceText,
    TextPiece,
    answer_parser_factory,
    keeps_special_tokens,
)
from decode_service.front_door.config import FrontDoorConfig
from decode_service.front_door.constraints import Constraints, may_compile
from decode_service.front_door.reasoning import ReasoningEnd
from decode_service.front_door.streams import Mailbox, StreamHub, coalesce
from decode_service.front_door.validation import ValidationPool, build_sequence, skips_special_tokens
from engine.model_facts import ModelFacts
from engine.sequence import FinishReason
from protos.tandem.v1 import generation_pb2 as pb
from serving.status import status_for

logger = logging.getLogger(__name__)

_FINISH_REASONS = {
    FinishReason.STOP: pb.STOP,
    FinishReason.LENGTH: pb.LENGTH,
    FinishReason.ABORT: pb.ABORT,
}

ParserFactory = Callable[[], AnswerParser]


def _since(start: float | None, end: float | None) -> float:
    return end - start if start is not None and end is not None else 0.0


def to_response(delta: StreamDelta, piece: TextPiece, completion_tokens: int) -> pb.GenerateResponse:
    """The stream message for one delta, whose tokens made `piece` (the client gets its first
    `piece.num_tokens` of them); the last message (the engine's, or a stop string's) carries finish
    reason, stop, usage (`completion_tokens`: the choice's tokens so far) and timings."""
    request = delta.request
    # Field by field: a quarter cheaper than keyword arguments, on the path every token takes.
    response = pb.GenerateResponse()
    response.request_id = request.request_id
    cut = piece.num_tokens < len(delta.token_ids)
    response.token_ids.extend(delta.token_ids[: piece.num_tokens] if cut else delta.token_ids)
    response.text = piece.text
    response.index = request.index
    for logprob in delta.logprobs[: piece.num_tokens] if cut else delta.logprobs:
        response.logprobs.append(
            pb.TokenLogprob(
                token_id=logprob.token_id,
                logprob=logprob.logprob,
                top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in logprob.top],
            )
        )
    finish = FinishReason.STOP if piece.stop is not None else delta.finish_reason
    if finish is None:
        return response
    seq = request.seq
    response.finish_reason = _FINISH_REASONS[finish]
    if piece.stop is not None:
        response.stop_string = piece.stop
    elif finish is FinishReason.STOP and isinstance(seq.matched_stop, int):
        if seq.matched_stop in seq.stopping.stop_token_ids:
            response.stop_token_id = seq.matched_stop
    response.usage.prompt_tokens = seq.num_prompt_tokens
    response.usage.completion_tokens = completion_tokens
    response.usage.cached_tokens = seq.num_cached_tokens
    response.timings.queue_seconds = _since(request.arrival_time, request.admitted_time)
    response.timings.prefill_seconds = _since(request.admitted_time, request.prefill_done_time)
    response.timings.first_token_seconds = _since(request.arrival_time, request.first_token_time)
    return response


def _prompt_log_fields(request: pb.GenerateRequest, served: ServedRequest) -> dict[str, object]:
    """The prompt as the client sent it, for `--log-prompts` only (empty otherwise)."""
    return prompt_fields(
        prompt=request.prompt or None,
        messages=[{"role": m.role, "content": m.content} for m in request.messages] or None,
        prompt_token_ids=served.seq.token_ids[: served.seq.num_prompt_tokens],
    )


def _finish_log_fields(request: ServedRequest, completion_tokens: int, now: float) -> dict[str, object]:
    """Counts and timings of a request that just ended, for its `request finished` line."""
    return {
        "prompt_tokens": request.seq.num_prompt_tokens,
        "completion_tokens": completion_tokens,
        "preemptions": request.num_preemptions,
        "queue_s": _since(request.arrival_time, request.admitted_time),
        "ttft_s": _since(request.arrival_time, request.first_token_time),
        "e2e_s": _since(request.arrival_time, now),
    }


def _log_refused(request_id: str, error: Exception) -> None:
    code, message = status_for(error)
    log_event(logger, logging.INFO, "request refused", request_id=request_id, code=code.name, reason=message)
    if code is grpc.StatusCode.INTERNAL:
        logger.error("request refused by a bug: %r", error, exc_info=error)


class Generations:
    """The way in for both front doors, over one engine loop and one registry of live streams; the served
    model is known by its facts (`model`), never by its engine."""

    def __init__(
        self,
        model: ModelFacts,
        engine_loop: EngineClient,
        hub: StreamHub,
        config: FrontDoorConfig,
        validation: ValidationPool,
        constraints: Constraints | None = None,
    ) -> None:
        self.model = model
        # Compiles the grammars of constrained requests; None: such requests are refused.
        self._constraints = constraints
        self.config = config
        self._engine_loop = engine_loop
        self._hub = hub
        self._validation = validation

    async def start(
        self, request: pb.GenerateRequest, arrival: float, tenant: str, priority: int
    ) -> Generation:
        """Check, register and validate `request` and submit it to the engine; raises why it was refused.

        Cheap limits come first, then a slot is reserved before any tokenization, so an oversized or
        over-capacity request costs nothing; the slot is given back if validation fails.
        """
        try:
            check_limits(request, self.config.limits, self.model.max_model_len)
        except InvalidRequestError as exc:
            _log_refused("-", exc)  # the id itself may be what is too long
            raise
        request_id = request.request_id or uuid.uuid4().hex
        bind_request_id(request_id)
        try:
            self._hub.check_accepting()
            check_max_tokens_cap(request, self.config.max_tokens_cap)
            n = num_choices(request, self.model)
            parsers = answer_parser_factory(
                request, self.config.tool_call_parser, self.config.reasoning_parser
            )
            self._hub.reserve(request_id)
        except Exception as exc:
            _log_refused(request_id, exc)
            raise
        try:
            seq, grammar = await self._validation.run(
                prompt_bytes(request),
                build_sequence,
                request,
                request_id,
                self.model,
                self.config.max_tokens_cap,
                tenant if self.config.cache_salt_by_tenant else None,
                self._constraints,
                tenant,
                constrained=may_compile(request)
                and not (self._constraints is not None and self._constraints.is_warm(request)),
            )
            served = ServedRequest(
                seq, priority=priority, tenant=tenant, arrival_time=arrival, n=n, grammar=grammar
            )
            mailbox = self._hub.open(served)
        except BaseException as exc:
            # Also when the client leaves while its prompt is tokenized (CancelledError): free the slot.
            self._hub.release(request_id)
            if isinstance(exc, Exception):
                _log_refused(request_id, exc)
            raise
        log_event(
            logger,
            logging.INFO,
            "request accepted",
            request_id=request_id,
            prompt_tokens=seq.num_prompt_tokens,
            max_tokens=seq.stopping.max_tokens,
            n=n,
            priority=priority,
            tenant=tenant or "-",
            **_prompt_log_fields(request, served),
        )
        self._engine_loop.submit(served)
        # A grammar waiting for the reasoning's end token: the reasoning parser splits where it wakes up.
        waits_for = grammar.activate_after if grammar is not None else None
        new_text = functools.partial(
            ChoiceText,
            self.model.tokenizer,
            seq.token_ids[: seq.num_prompt_tokens],
            seq.stopping,
            skips_special_tokens(request, keeps_special_tokens(request, self.config.tool_call_parser)),
            waits_for,
        )
        if parsers is not None:
            parsers = functools.partial(parsers, None if grammar is None else waits_for is not None)
        return Generation(served, mailbox, self._hub, self._engine_loop, arrival, new_text, parsers)

    def abort(self, request_id: str) -> bool:
        """Abort a live request by id (the Abort RPC); False when no such request is live."""
        if request_id not in self._hub:
            return False
        self._engine_loop.abort(request_id)
        return True


class Generation:
    """One accepted request's stream: take `next_responses()` (or iterate `responses()`) until it is
    over, or `close()` it if that never happens."""

    def __init__(
        self,
        served: ServedRequest,
        mailbox: Mailbox[StreamDelta],
        hub: StreamHub,
        engine_loop: EngineClient,
        arrival: float,
        new_text: Callable[[], ChoiceText],
        new_parser: ParserFactory | None = None,
    ) -> None:
        self.served = served
        self._mailbox = mailbox
        self._hub = hub
        self._engine_loop = engine_loop
        self._arrival = arrival
        self._finished = False
        self._closed = False
        self._choices_left = served.n
        # An engine error met after other messages of the same batch: raised by the next call.
        self._failure: Exception | None = None
        self._completion: list[str] = []  # the text so far, for `--log-prompts` only
        # Each choice's text, by index; a choice in `_ended` got its last message (the engine may still
        # send a token or two it made before a stop string reached it: they are dropped).
        self._new_text = new_text
        self._texts: dict[int, ChoiceText] = {}
        self._ended: set[int] = set()
        # Reasoning and tool-call parsing, one parser per choice index; None: text passes through as made.
        self._new_parser = new_parser
        self._parsers: dict[int, AnswerParser] = {}

    @property
    def request_id(self) -> str:
        return self.served.request_id

    @property
    def parses_answer(self) -> bool:
        """Whether messages may carry reasoning or tool calls (else their text is the answer as made)."""
        return self._new_parser is not None

    async def next_responses(self) -> list[pb.GenerateResponse]:
        """The messages of every delta waiting now, merged per choice by `coalesce` (waits for one);
        empty once every choice's last message was taken. Raises the error the engine hit, once the
        messages before it were returned.

        A writer that keeps up gets one token per message, as produced; one that fell behind — many
        streams on one event loop, a slow network — sends the tokens that piled up in one message, so
        the per-message cost (protobuf, HTTP/2 frame, the client's wake-up) is paid once per batch.
        """
        if self._failure is not None:
            raise self._failure
        responses: list[pb.GenerateResponse] = []
        while not self._finished and not responses:
            for delta in coalesce(await self._mailbox.take_all()):
                try:
                    response = self._respond(delta)
                except Exception as exc:
                    if not responses:
                        raise
                    self._failure = exc
                    break
                if response is not None:
                    responses.append(response)
                if self._finished:
                    break
        await self._hub.step_built()
        return responses

    async def responses(self) -> AsyncIterator[pb.GenerateResponse]:
        """The stream's messages one by one, as `next_responses` gives them; closes the stream after."""
        try:
            while batch := await self.next_responses():
                for response in batch:
                    yield response
        finally:
            self.close()

    def _respond(self, delta: StreamDelta) -> pb.GenerateResponse | None:
        """Account for one delta (text, choices left, logs) and build its message; None for tokens of a
        choice that already ended. Raises the delta's error."""
        index = delta.request.index
        if index in self._ended:
            return None
        text = self._texts.get(index)
        if text is None:
            text = self._texts[index] = self._new_text()
        piece = text.feed(delta.token_ids, delta.finish_reason)
        if delta.is_last or piece.stop is not None:
            self._ended.add(index)
            # An error ends the stream; a request aborted before its prompt was prefilled never forked
            # its other choices. The same rule as the hub's count of the engine's work (`streams`).
            forked = self.served.forked and delta.error is None
            self._choices_left = self._choices_left - 1 if forked else 0
            if not delta.is_last:
                self._engine_loop.stop_at_string(self.request_id, index, piece.stop)
        self._finished = self._choices_left == 0
        if delta.error is not None:
            code, _ = status_for(delta.error)
            log_event(logger, logging.WARNING, "request failed", request_id=self.request_id, code=code.name)
            raise delta.error
        if log_prompts_enabled():
            self._completion.append(piece.text)
        finish = FinishReason.STOP if piece.stop is not None else delta.finish_reason
        if self._finished and finish is not None:
            log_event(
                logger,
                logging.INFO,
                "request finished",
                request_id=self.request_id,
                finish_reason=finish.value,
                **_finish_log_fields(self.served, text.num_tokens, time.monotonic()),
                **prompt_fields(completion="".join(self._completion)),
            )
        response = to_response(delta, piece, text.num_tokens)
        if self._new_parser is not None:
            self._parse(piece.text, finish is not None, response, text.reasoning_end)
        return response

    def _parse(
        self, text: str, last: bool, response: pb.GenerateResponse, reasoning_end: ReasoningEnd | None
    ) -> None:
        """Split the message's text into answer text, reasoning and tool calls (see `choice_text`)."""
        parser = self._parsers.get(response.index)
        if parser is None:
            parser = self._parsers[response.index] = self._new_parser()
        answer, reasoning, calls = parser.feed(text, reasoning_end)
        if last:
            more_answer, more_reasoning, more_calls = parser.finish()
            answer, reasoning, calls = answer + more_answer, reasoning + more_reasoning, calls + more_calls
            if response.finish_reason == pb.STOP and parser.made_calls:
                response.finish_reason = pb.TOOL_CALLS
        response.text = answer
        response.reasoning_text = reasoning
        response.tool_calls.extend(calls)

    def close(self) -> None:
        """Leave the stream; a request not finished yet is aborted and its blocks freed at once."""
        if self._closed:
            return
        self._closed = True
        self._hub.close(self.served)
        if not self._finished:
            self._engine_loop.abort(self.request_id)
            log_event(
                logger,
                logging.INFO,
                "request cancelled",
                request_id=self.request_id,
                completion_tokens=sum(text.num_tokens for text in self._texts.values()),
                after_s=time.monotonic() - self._arrival,
            )
