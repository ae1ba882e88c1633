"""Anthropic's Messages API: `POST /v1/messages` (a whole message, or its event stream) and
`POST /v1/messages/count_tokens`, run through the same `Generations` as the OpenAI routes and gRPC.

The key may come as `x-api-key` (Anthropic's SDKs) or `Authorization: Bearer`; the body limits, the
tenant and priority headers and `X-Request-Id` are the OpenAI routes'. Errors have Anthropic's shape
and the statuses the OpenAI routes give. A client that disconnects aborts its request at once.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from decode_service.front_door.admission import tenant_and_priority
from decode_service.front_door.generation import Generation, Generations
from decode_service.front_door.openai_http.anthropic_models import TokenCount
from decode_service.front_door.openai_http.anthropic_protocol import (
    AnthropicRequest,
    translate_count,
    translate_message,
)
from decode_service.front_door.openai_http.anthropic_responses import MessageBuilder, sse_event
from decode_service.front_door.openai_http.errors import anthropic_error
from decode_service.front_door.openai_http.request_io import (
    REQUEST_ID_HEADER,
    ApiKeys,
    check_model,
    read_json,
    unless_disconnected,
)
from protos.tandem.v1 import generation_pb2 as pb
from serving import tracing


class MessagesRoutes:
    """The handlers, bound to one decode server's `Generations`."""

    def __init__(
        self, generations: Generations, served_model_name: str, keys: ApiKeys, max_body_bytes: int
    ) -> None:
        self._generations = generations
        self._model = served_model_name
        self._keys = keys
        self._max_body_bytes = max_body_bytes

    def register(self, app: FastAPI) -> None:
        app.add_api_route("/v1/messages", self.messages, methods=["POST"])
        app.add_api_route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"])

    async def count_tokens(self, request: Request) -> JSONResponse:
        counted: AnthropicRequest | None = None
        try:
            counted = translate_count(await self._body(request), self._generations.config.limits)
            check_model(counted.model, self._model)
            tokens = await self._generations.prompt_token_ids(counted.generate)
        except Exception as exc:
            return _error(exc, counted)
        answer: TokenCount = {"input_tokens": len(tokens)}
        return JSONResponse(answer)

    async def messages(self, request: Request) -> Response:
        arrival = time.monotonic()
        asked: AnthropicRequest | None = None
        try:
            asked = translate_message(await self._body(request), self._generations.config.limits)
            check_model(asked.model, self._model)
            generate = asked.generate
            config = self._generations.config
            if not asked.stream:
                config.limits.check_unstreamed(1, generate.stopping.max_tokens, 0)
            generate.request_id = request.headers.get(REQUEST_ID_HEADER, generate.request_id)
            tenant, priority = tenant_and_priority(
                generate, request.headers.items(), config.tenant_header, config.priority_header
            )
            traceparent = tracing.traceparent_from(request.headers.items())
            generation = await self._generations.start(generate, arrival, tenant, priority, traceparent)
        except Exception as exc:
            return _error(exc, asked)
        builder = MessageBuilder(generation.request_id, self._model, generation.num_prompt_tokens)
        if asked.stream:
            return await self._stream(request, generation, builder, asked)
        return await self._whole_message(request, generation, builder, asked)

    async def _body(self, request: Request) -> object:
        self._keys.authorize(request)
        return await read_json(request, self._max_body_bytes, self._generations.config.limits)

    async def _stream(
        self, request: Request, generation: Generation, builder: MessageBuilder, asked: AnthropicRequest
    ) -> Response:
        # The first messages before the status, as the OpenAI routes do: a request refused before its
        # first token gets an error status rather than a 200 and an error event.
        first = await unless_disconnected(request, generation.next_responses())
        if first is None or first.exception() is not None:
            generation.close()
            if first is None:
                return Response(status_code=499)  # nobody is listening; the request was aborted
            return _error(first.exception(), asked)
        return StreamingResponse(
            self._events(generation, builder, first.result()),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            background=BackgroundTask(generation.close),
        )

    @staticmethod
    async def _events(
        generation: Generation, builder: MessageBuilder, messages: list[pb.GenerateResponse]
    ) -> AsyncIterator[bytes]:
        """`message_start`, the events of the stream's messages from its first ones on; an engine error
        becomes an `error` event. Starlette cancels this generator when the client leaves (an abort)."""
        yield builder.start_event()
        try:
            while messages:
                yield b"".join([builder.events(message) for message in messages])
                messages = await generation.next_responses()
        except Exception as exc:
            yield sse_event(anthropic_error(exc)[1])
        finally:
            generation.close()

    @staticmethod
    async def _whole_message(
        request: Request, generation: Generation, builder: MessageBuilder, asked: AnthropicRequest
    ) -> Response:
        async def collect() -> None:
            async for message in generation.responses():
                builder.add(message)

        try:
            collected = await unless_disconnected(request, collect())
        finally:
            generation.close()
        if collected is None:
            return Response(status_code=499)  # nobody is listening; the request was aborted
        if collected.exception() is not None:
            return _error(collected.exception(), asked)
        return JSONResponse(builder.body())


def _error(error: BaseException, asked: AnthropicRequest | None) -> JSONResponse:
    status, body = anthropic_error(error, asked.param_for if asked is not None else None)
    return JSONResponse(body, status_code=status)
