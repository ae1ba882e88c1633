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
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from base.errors import InvalidRequestError
from base.logs import bind_request_id, log_event, log_prompts_enabled, prompt_fields
from decode_service.engine_core.messages import ChoiceState, CoreClient, Delta, Submit
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
from decode_service.front_door.streams import Mailbox, StreamHub, choices_left_after, coalesce, is_last
from decode_service.front_door.validation import (
    ValidationPool,
    build_request,
    served_prompt_ids,
    skips_special_tokens,
    uses_agent_fields,
)
from engine.model_facts import ModelFacts
from protos.tandem.v1 import generation_pb2 as pb
from serving import tracing
from serving.errors import RelayedStatusError
from serving.status import status_for

logger = logging.getLogger(__name__)

_FINISH_REASONS = {"stop": pb.STOP, "length": pb.LENGTH, "abort": pb.ABORT}

ParserFactory = Callable[[], AnswerParser]


def _since(start: float | None, end: float | None) -> float:
    return end - start if start is not None and end is not None else 0.0


def to_response(
    delta: Delta, piece: TextPiece, completion_tokens: int, request: Submit, state: ChoiceState | None
) -> pb.GenerateResponse:
    """The stream message for one delta of `request`, whose tokens made `piece` (the client gets its first
    `piece.num_tokens` of them); the last message (the engine's, or a stop string's) carries finish
    reason, stop, usage (`completion_tokens`: the choice's tokens so far) and timings, from `state`, the
    choice's latest as the core reported it."""
    # Field by field: a quarter cheaper than keyword arguments, on the path every token takes.
    response = pb.GenerateResponse()
    response.request_id = request.request_id
    cut = piece.num_tokens < len(delta.token_ids)
    response.token_ids.extend(delta.token_ids[: piece.num_tokens] if cut else delta.token_ids)
    response.text = piece.text
    response.index = delta.index
    for token_id, logprob, top in delta.logprobs[: piece.num_tokens] if cut else delta.logprobs:
        response.logprobs.append(
            pb.TokenLogprob(
                token_id=token_id,
                logprob=logprob,
                top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in top],
            )
        )
    finish = "stop" if piece.stop is not None else delta.finish_reason
    if finish is None:
        return response
    response.finish_reason = _FINISH_REASONS[finish]
    if piece.stop is not None:
        response.stop_string = piece.stop
    elif finish == "stop" and state is not None and isinstance(state.matched_stop, int):
        if state.matched_stop in request.stopping.stop_token_ids:
            response.stop_token_id = state.matched_stop
    response.usage.prompt_tokens = len(request.prompt_token_ids)
    response.usage.completion_tokens = completion_tokens
    if state is not None:
        response.usage.cached_tokens = state.num_cached_tokens
        response.timings.queue_seconds = _since(request.arrival_time, state.admitted_time)
        response.timings.prefill_seconds = _since(state.admitted_time, state.prefill_done_time)
        response.timings.first_token_seconds = _since(request.arrival_time, state.first_token_time)
    return response


def _prompt_log_fields(request: pb.GenerateRequest, submitted: Submit) -> dict[str, object]:
    """The prompt as the client sent it, for `--log-prompts` only (empty otherwise)."""
    return prompt_fields(
        prompt=request.prompt or None,
        messages=[{"role": m.role, "content": m.content} for m in request.messages] or None,
        prompt_token_ids=submitted.prompt_token_ids,
    )


def _finish_log_fields(
    request: Submit, state: ChoiceState | None, completion_tokens: int, now: float
) -> dict[str, object]:
    """Counts and timings of a request that just ended, for its `request finished` line."""
    admitted = state.admitted_time if state is not None else None
    first_token = state.first_token_time if state is not None else None
    return {
        "prompt_tokens": len(request.prompt_token_ids),
        "completion_tokens": completion_tokens,
        "preemptions": state.num_preemptions if state is not None else 0,
        "queue_s": _since(request.arrival_time, admitted),
        "ttft_s": _since(request.arrival_time, first_token),
        "e2e_s": _since(request.arrival_time, now),
    }


def _log_refused(request_id: str, error: Exception) -> None:
    code, message = status_for(error)
    log_event(logger, logging.INFO, "request refused", request_id=request_id, code=code.name, reason=message)
    if code is grpc.StatusCode.INTERNAL:
        logger.error("request refused by a bug: %r", error, exc_info=error)


@dataclass
class RequestTrace:
    """A traced request's root span (`serving.tracing`), when it was handed to the engine core (its
    queue span starts there), and each choice's finish reason so far."""

    span: Any
    queued_at: float
    finish_reasons: list[str] = field(default_factory=list)


class Generations:
    """The way in for both front doors, over one engine loop and one registry of live streams; the served
    model is known by its facts (`model`), never by its engine."""

    def __init__(
        self,
        model: ModelFacts,
        engine_loop: CoreClient,
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
        # Each submission's number, echoed in its deltas: a delta never reaches a newer request that
        # reused the id.
        self._submissions = itertools.count(1)

    async def start(
        self,
        request: pb.GenerateRequest,
        arrival: float,
        tenant: str,
        priority: int,
        traceparent: str | None = None,
    ) -> Generation:
        """Check, register and validate `request` and submit it to the engine; raises why it was refused.

        Cheap limits come first, then a slot is reserved before any tokenization, so an oversized or
        over-capacity request costs nothing; the slot is given back if validation fails. With tracing on,
        the request's root span starts at `arrival`, a child of the caller's `traceparent` if it sent one.
        """
        span = self._start_span(request, arrival, traceparent) if tracing.enabled() else None
        try:
            check_limits(request, self.config.limits, self.model.max_model_len)
        except InvalidRequestError as exc:
            _log_refused("-", exc)  # the id itself may be what is too long
            tracing.end_span(span, error=str(exc))
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
            tracing.end_span(span, error=str(exc))
            raise
        validated = time.monotonic() if span is not None else 0.0
        try:
            submitted = await self._validation.run(
                prompt_bytes(request),
                build_request,
                request,
                request_id,
                self.model,
                self.config.max_tokens_cap,
                tenant if self.config.cache_salt_by_tenant else None,
                self._constraints,
                constrained=uses_agent_fields(request) and may_compile(request),
            )
            submitted.submission = next(self._submissions)
            submitted.priority = priority
            submitted.tenant = tenant
            submitted.arrival_time = arrival
            submitted.n = n
            mailbox = self._hub.open(submitted)
        except BaseException as exc:
            # Also when the client leaves while its prompt is tokenized (CancelledError): free the slot.
            self._hub.release(request_id)
            if isinstance(exc, Exception):
                _log_refused(request_id, exc)
            tracing.end_span(span, error=str(exc) or type(exc).__name__)
            raise
        trace = None
        if span is not None:
            trace = RequestTrace(span, time.monotonic())
            tracing.record_span("validate", span, arrival, validated)
            tracing.record_span("tokenize", span, validated, trace.queued_at)
            span.set_attributes(
                {
                    "gen_ai.request.max_tokens": submitted.stopping.max_tokens,
                    "gen_ai.usage.input_tokens": len(submitted.prompt_token_ids),
                }
            )
            submitted.traceparent = tracing.traceparent_of(span)
        log_event(
            logger,
            logging.INFO,
            "request accepted",
            request_id=request_id,
            prompt_tokens=len(submitted.prompt_token_ids),
            max_tokens=submitted.stopping.max_tokens,
            n=n,
            priority=priority,
            tenant=tenant or "-",
            **_prompt_log_fields(request, submitted),
        )
        self._engine_loop.submit(submitted)
        # A grammar waiting for the reasoning's end token: the reasoning parser splits where it wakes up.
        grammar = submitted.grammar
        waits_for = grammar.activate_after if grammar is not None else None
        new_text = functools.partial(
            ChoiceText,
            self.model.tokenizer,
            submitted.prompt_token_ids,
            submitted.stopping,
            skips_special_tokens(request, keeps_special_tokens(request, self.config.tool_call_parser)),
            waits_for,
        )
        if parsers is not None:
            parsers = functools.partial(parsers, None if grammar is None else waits_for is not None)
        return Generation(submitted, mailbox, self._hub, self._engine_loop, arrival, new_text, parsers, trace)

    def _start_span(self, request: pb.GenerateRequest, arrival: float, traceparent: str | None) -> object:
        """The request's root span, named and described as the GenAI semantic conventions say."""
        operation = "chat" if request.messages else "text_completion"
        model = self.config.served_model_name or self.model.model_name
        attributes = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": "tandem",
            "gen_ai.request.model": model,
        }
        return tracing.start_span(f"{operation} {model}", traceparent, attributes, arrival, kind="SERVER")

    async def prompt_token_ids(self, request: pb.GenerateRequest) -> list[int]:
        """The token ids `request`'s prompt would be served with, checked and tokenized as `start` does it
        (the same limits, on the same validation lanes), without generating: what a client counts."""
        check_limits(request, self.config.limits, self.model.max_model_len)
        return await self._validation.run(
            prompt_bytes(request),
            served_prompt_ids,
            request,
            self.model,
            constrained=uses_agent_fields(request),
        )

    async def detokenize(self, token_ids: list[int]) -> str:
        """The text of `token_ids`, special tokens included, decoded off the event loop (a long list is
        costly); ids outside the vocabulary are refused."""
        tokenizer = self.model.tokenizer
        if tokenizer is None:
            raise InvalidRequestError("this server has no tokenizer to decode with")
        vocab_size = self.model.vocab_size
        for token_id in token_ids:
            if not 0 <= token_id < vocab_size:
                raise InvalidRequestError(f"tokens holds {token_id}, outside the vocabulary of {vocab_size}")
        # Four bytes of text per token at most on average: long lists go to the long-prompt lane.
        return await self._validation.run(4 * len(token_ids), tokenizer.decode, token_ids, False)

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
        request: Submit,
        mailbox: Mailbox[Delta],
        hub: StreamHub,
        engine_loop: CoreClient,
        arrival: float,
        new_text: Callable[[], ChoiceText],
        new_parser: ParserFactory | None = None,
        trace: RequestTrace | None = None,
    ) -> None:
        self.request = request
        # The request's root span, ended with the request; None when tracing is off.
        self._trace = trace
        self._mailbox = mailbox
        self._hub = hub
        self._engine_loop = engine_loop
        self._arrival = arrival
        self._finished = False
        self._closed = False
        self._choices_left = request.n
        # Whether the core forked choices 1..n-1, and each choice's latest state, as its deltas said.
        self._forked = False
        self._states: dict[int, ChoiceState] = {}
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
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

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

    def _respond(self, delta: Delta) -> pb.GenerateResponse | None:
        """Account for one delta (text, choices left, logs) and build its message; None for tokens of a
        choice that already ended. Raises the delta's error."""
        index = delta.index
        if index in self._ended:
            return None
        if delta.state is not None:
            if self._trace is not None and not self._states:
                trace = self._trace
                tracing.record_span("queue", trace.span, trace.queued_at, delta.state.admitted_time)
            self._states[index] = delta.state
            self._forked = self._forked or delta.state.forked
        text = self._texts.get(index)
        if text is None:
            text = self._texts[index] = self._new_text()
        last = is_last(delta)
        piece = text.feed(delta.token_ids, delta.finish_reason)
        if last or piece.stop is not None:
            self._ended.add(index)
            # The same rule as the hub's count of the engine's work (`streams`).
            self._choices_left = choices_left_after(self._choices_left, delta, self._forked)
            if not last:
                self._engine_loop.stop_at_string(self.request_id, index, piece.stop)
        self._finished = self._choices_left == 0
        if delta.error is not None:
            code = grpc.StatusCode[delta.error.code]
            log_event(logger, logging.WARNING, "request failed", request_id=self.request_id, code=code.name)
            self._end_span(f"{code.name}: {delta.error.message}")
            raise RelayedStatusError(code, delta.error.message, delta.error.field)
        if log_prompts_enabled():
            self._completion.append(piece.text)
        finish = "stop" if piece.stop is not None else delta.finish_reason
        state = self._states.get(index)
        if self._trace is not None and finish is not None:
            self._trace.finish_reasons.append(finish)
            if self._finished:
                self._end_span(None)
        if self._finished and finish is not None:
            log_event(
                logger,
                logging.INFO,
                "request finished",
                request_id=self.request_id,
                finish_reason=finish,
                **_finish_log_fields(self.request, state, text.num_tokens, time.monotonic()),
                **prompt_fields(completion="".join(self._completion)),
            )
        response = to_response(delta, piece, text.num_tokens, self.request, state)
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

    def _end_span(self, error: str | None) -> None:
        """End the root span with the request's usage and outcome (once; nothing when tracing is off)."""
        trace, self._trace = self._trace, None
        if trace is None:
            return
        attributes = {
            "gen_ai.response.id": self.request_id,
            "gen_ai.usage.output_tokens": sum(text.num_tokens for text in self._texts.values()),
            "gen_ai.response.finish_reasons": trace.finish_reasons,
        }
        tracing.end_span(trace.span, attributes, error)

    def close(self) -> None:
        """Leave the stream; a request not finished yet is aborted and its blocks freed at once."""
        if self._closed:
            return
        self._closed = True
        self._hub.close(self.request)
        self._end_span(None if self._finished else "cancelled")
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
