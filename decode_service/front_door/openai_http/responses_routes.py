"""The Responses API routes: `POST /v1/responses`, and `GET`/`DELETE /v1/responses/{id}` of a stored one.

They run as the chat route runs (the same body limits, bearer token, tenant and priority headers,
`Generations.start`, abort on disconnect); `responses_api` translates the request and shapes the answer,
`response_store` keeps finished responses when the server has a store (`--enable-responses-store`).
Without one, `store: true` is accepted and nothing is kept (as vLLM does without its store), and
`previous_response_id` is refused naming the field.

A stored response belongs to the tenant the trusted gateway's tenant header names (`--tenant-header`);
without that header every client of the bearer token is one tenant, since the body's `user` is the
client's own claim. Another tenant's id reads as one that does not exist (404).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from decode_service.front_door.admission import tenant_and_priority
from decode_service.front_door.generation import Generation, Generations
from decode_service.front_door.openai_http.errors import (
    ModelNotServedError,
    ResponseNotFoundError,
    http_error,
)
from decode_service.front_door.openai_http.response_store import ResponseStore
from decode_service.front_door.openai_http.responses_api import (
    ResponsesAnswer,
    ResponsesCall,
    new_response_id,
    stream_event,
    translate_responses,
)
from protos.tandem.v1 import generation_pb2 as pb
from serving import tracing

ReadBody = Callable[[Request], Awaitable[object]]
UntilDisconnect = Callable[[Request, Awaitable[Any]], Awaitable[Any]]
ErrorResponse = Callable[..., JSONResponse]


class ResponsesRoutes:
    """The handlers, bound to the server's `Generations` and the door's shared steps: `read_body` (size,
    nesting and object limits), `authorize` (the bearer token), `unless_disconnected` (work cancelled
    when the client leaves: None), `error` (an exception as the OpenAI error response) and
    `check_unstreamed` (the bound on a whole answer held in memory)."""

    def __init__(
        self,
        generations: Generations,
        model: str,
        store: ResponseStore | None,
        read_body: ReadBody,
        authorize: Callable[[Request], None],
        unless_disconnected: UntilDisconnect,
        error: ErrorResponse,
        request_id_header: str,
    ) -> None:
        self._generations = generations
        self._model = model
        self._store = store
        self._read_body = read_body
        self._authorize = authorize
        self._unless_disconnected = unless_disconnected
        self._error = error
        self._request_id_header = request_id_header

    def register(self, app: FastAPI) -> None:
        app.add_api_route("/v1/responses", self.create, methods=["POST"])
        app.add_api_route("/v1/responses/{response_id}", self.retrieve, methods=["GET"])
        app.add_api_route("/v1/responses/{response_id}", self.delete, methods=["DELETE"])

    def _store_tenant(self, request: Request) -> str:
        """Whose stored responses this request may read and write: the trusted tenant header's value."""
        config = self._generations.config
        tenant, _ = tenant_and_priority(
            pb.GenerateRequest(), request.headers.items(), config.tenant_header, ""
        )
        return tenant

    async def create(self, request: Request) -> Response:
        arrival = time.monotonic()
        call: ResponsesCall | None = None
        try:
            self._authorize(request)
            body = await self._read_body(request)
            owner = self._store_tenant(request)
            store = self._store
            lookup = (lambda response_id: store.get(owner, response_id)) if store is not None else None
            config = self._generations.config
            call = translate_responses(body, config.limits, lookup)
            if call.request.model is not None and call.request.model != self._model:
                raise ModelNotServedError(
                    f"the model {call.request.model!r} does not exist; this server serves {self._model!r}"
                )
            generate = call.generate
            if not call.request.stream:
                stopping = generate.stopping
                config.limits.check_unstreamed(
                    1, stopping.max_tokens if stopping.HasField("max_tokens") else config.max_tokens_cap, 0
                )
            generate.request_id = request.headers.get(self._request_id_header, generate.request_id)
            tenant, priority = tenant_and_priority(
                generate, request.headers.items(), config.tenant_header, config.priority_header
            )
            traceparent = tracing.traceparent_from(request.headers.items())
            generation = await self._generations.start(generate, arrival, tenant, priority, traceparent)
        except Exception as exc:
            return self._error(exc, call.param_for if call is not None else None)
        stored = store is not None and call.request.store
        answer = ResponsesAnswer(call, new_response_id(), self._model, stored)

        def keep() -> None:
            if stored:
                store.put(owner, answer.id, answer.stored())

        if call.request.stream:
            first = await self._unless_disconnected(request, generation.next_responses())
            if first is None or first.exception() is not None:
                generation.close()
                if first is None:
                    return Response(status_code=499)  # nobody is listening; the request was aborted
                return self._error(first.exception(), call.param_for)
            return StreamingResponse(
                self._events(generation, answer, first.result(), keep),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                background=BackgroundTask(generation.close),
            )

        async def collect() -> None:
            async for message in generation.responses():
                answer.feed(message)

        try:
            collected = await self._unless_disconnected(request, collect())
        finally:
            generation.close()
        if collected is None:
            return Response(status_code=499)
        if collected.exception() is not None:
            return self._error(collected.exception(), call.param_for)
        answer.finish()
        keep()
        return JSONResponse(answer.body())

    @staticmethod
    async def _events(
        generation: Generation,
        answer: ResponsesAnswer,
        messages: list[pb.GenerateResponse],
        keep: Callable[[], None],
    ) -> AsyncIterator[bytes]:
        """The stream's events from its first `messages` on; an engine error ends it with an `error`
        event. The response is stored once complete (a client that left mid-stream stores nothing).
        Starlette cancels this generator when the client disconnects, which aborts the request."""
        try:
            events = answer.start()
            while messages:
                for message in messages:
                    events += answer.feed(message)
                yield b"".join(stream_event(event) for event in events)
                events = []
                messages = await generation.next_responses()
            closing = answer.finish()
            keep()  # before the last write: a client that reads it may ask for the response at once
            yield b"".join(stream_event(event) for event in closing)
        except Exception as exc:
            yield stream_event(answer.error_event(http_error(exc)[1]))
        finally:
            generation.close()

    async def retrieve(self, request: Request, response_id: str) -> Response:
        try:
            self._authorize(request)
            stored = self._store.get(self._store_tenant(request), response_id) if self._store else None
            if stored is None:
                raise ResponseNotFoundError(None, f"no response {response_id!r} is stored")
        except Exception as exc:
            return self._error(exc)
        return JSONResponse(stored.body)

    async def delete(self, request: Request, response_id: str) -> Response:
        try:
            self._authorize(request)
            deleted = self._store is not None and self._store.delete(self._store_tenant(request), response_id)
            if not deleted:
                raise ResponseNotFoundError(None, f"no response {response_id!r} is stored")
        except Exception as exc:
            return self._error(exc)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})
