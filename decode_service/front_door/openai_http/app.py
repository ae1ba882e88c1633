"""The OpenAI-compatible routes: GET /v1/models, POST /v1/completions and /v1/chat/completions, the
Responses API (`responses_routes`), GET /health, and GET /metrics (the server's Prometheus registry, where
gateways scrape a vLLM server).

Each request is translated (`protocol`), run through the same `Generations` as a gRPC call, and answered
from its `GenerateResponse`s (`responses`), as one JSON body or as server-sent events ending with
`data: [DONE]`. A client that disconnects, mid-stream or while waiting for a whole answer, aborts its
request at once. The bearer token and body size limit are the gRPC port's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import lru_cache
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import TypeAdapter
from starlette.background import BackgroundTask

from base.auth import BearerTokens
from base.errors import InvalidRequestError
from decode_service.front_door import json_text
from decode_service.front_door.admission import RequestLimits, tenant_and_priority
from decode_service.front_door.generation import Generation, Generations
from decode_service.front_door.openai_http.errors import (
    BodyTooLargeError,
    FieldError,
    ModelNotServedError,
    UnauthorizedError,
    http_error,
)
from decode_service.front_door.openai_http.models import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChunk,
    CompletionRequest,
)
from decode_service.front_door.openai_http.protocol import Endpoint, OpenAIRequest, translate
from decode_service.front_door.openai_http.response_store import ResponseStore
from decode_service.front_door.openai_http.responses import ResponseBuilder, sse_event
from decode_service.front_door.openai_http.responses_api_models import (
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
)
from decode_service.front_door.openai_http.responses_routes import ResponsesRoutes
from protos.tandem.v1 import generation_pb2 as pb

logger = logging.getLogger(__name__)

T = TypeVar("T")

REQUEST_ID_HEADER = "x-request-id"


async def _read_json(request: Request, max_bytes: int, limits: RequestLimits) -> object:
    """The body as JSON, refusing one larger than `max_bytes` before reading it all, and one with more
    objects than `limits` allow as soon as the parser has built that many."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLargeError(
            f"the request body has {declared} bytes; this server takes at most {max_bytes}"
        )
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > max_bytes:
            raise BodyTooLargeError(f"the request body exceeds this server's limit of {max_bytes} bytes")
    # Braces inside strings count here too, so only then are the parsed objects counted, one by one.
    counted = _counted_objects(limits) if body.count(b"{") > limits.max_json_objects else None
    try:
        return json_text.loads(body, parse_constant=_refuse_constant, object_pairs_hook=counted)
    except _TooManyObjects as exc:
        raise FieldError("body", str(exc.__cause__)) from None
    except json_text.LoneSurrogateError as exc:  # valid JSON but no text: it could never be encoded
        where = exc.path or "body"
        raise FieldError(where, f"{where} holds a lone UTF-16 surrogate") from None
    except json_text.JsonTextError as exc:
        raise FieldError("body", f"the request body {exc}") from None


class _TooManyObjects(Exception):
    """Raised out of the parser (which would wrap a ValueError as bad JSON); the refusal is its cause."""


def _counted_objects(limits: RequestLimits) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    count = 0

    def build(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal count
        count += 1
        try:
            limits.check_json_objects(count)
        except InvalidRequestError as refused:
            raise _TooManyObjects from refused
        return dict(pairs)

    return build


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


async def _wait_for_disconnect(request: Request) -> None:
    """Return once the client has gone (the body is already read, so only a disconnect can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> asyncio.Future[T] | None:
    """`work` run to its end, as a done future (its result or its error), or None when the client left
    first (`work` is then cancelled)."""
    task = asyncio.ensure_future(work)
    disconnected = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait((task, disconnected), return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnected.cancel()
        if not task.done():
            task.cancel()
    return None if task.cancelled() else task


# Each generation route's request body, whole answer and stream chunk (each server-sent event's data).
_BODIES: dict[str, tuple[type, type, type]] = {
    "/v1/completions": (CompletionRequest, Completion, CompletionChunk),
    "/v1/chat/completions": (ChatCompletionRequest, ChatCompletion, ChatCompletionChunk),
    "/v1/responses": (ResponsesRequest, ResponseObject, ResponseStreamEvent),
}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema of the routes, with the typed bodies of `models`. The handlers read their bodies
    themselves (size, nesting and object limits first), so FastAPI does not see the types on its own."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})

        def ref(body: type) -> dict[str, Any]:
            body_schema = TypeAdapter(body).json_schema(ref_template="#/components/schemas/{model}")
            components.update(body_schema.pop("$defs", {}))
            components[body.__name__] = body_schema
            return {"schema": {"$ref": f"#/components/schemas/{body.__name__}"}}

        for path, (request, answer, chunk) in _BODIES.items():
            post = schema["paths"][path]["post"]
            post["requestBody"] = {"required": True, "content": {"application/json": ref(request)}}
            post["responses"]["200"]["content"] = {
                "application/json": ref(answer),
                "text/event-stream": ref(chunk),
            }
        app.openapi_schema = schema
    return app.openapi_schema


class OpenAIRoutes:
    """The handlers, bound to one decode server's `Generations`."""

    def __init__(
        self,
        generations: Generations,
        served_model_name: str,
        auth_token: str | None,
        max_body_bytes: int,
        is_serving: Callable[[], bool],
        metrics: CollectorRegistry | None = None,
        response_store: ResponseStore | None = None,
    ) -> None:
        """`metrics`: the registry `GET /metrics` serves (None: no such route); `response_store`: where
        the Responses API keeps responses (None: it keeps none)."""
        self._generations = generations
        self._response_store = response_store
        self._metrics = metrics
        self.model = served_model_name
        self._tokens = BearerTokens(auth_token) if auth_token else None
        self._max_body_bytes = max_body_bytes
        self._is_serving = is_serving
        self._created = int(time.time())
        tokenizer = generations.model.tokenizer
        decode = tokenizer.decode if tokenizer is not None else None
        # Logprob entries name their tokens; a small cache keeps repeated tokens from re-decoding.
        self._token_text = lru_cache(maxsize=65536)(
            lambda token_id: decode([token_id], skip_special_tokens=False) if decode else str(token_id)
        )
        self._token_bytes = tokenizer.token_bytes if tokenizer is not None else None

    def app(self) -> FastAPI:
        app = FastAPI(title="tandem", redoc_url=None)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        ResponsesRoutes(
            self._generations,
            self.model,
            self._response_store,
            lambda request: _read_json(request, self._max_body_bytes, self._generations.config.limits),
            self._authorize,
            _unless_disconnected,
            self._error,
            REQUEST_ID_HEADER,
        ).register(app)
        app.openapi = lambda: _openapi(app)
        if self._metrics is not None:
            app.add_api_route("/metrics", self.metrics, methods=["GET"])
        return app

    async def metrics(self) -> Response:
        """The server's Prometheus registry, as vLLM serves it on its API port: without the bearer token,
        like /health, so the gateway's endpoint picker and Prometheus scrape it as they scrape vLLM."""
        return Response(generate_latest(self._metrics), media_type=CONTENT_TYPE_LATEST)

    async def health(self) -> Response:
        """200 once warmed up and until draining: what a load balancer's readiness check wants."""
        return Response(status_code=200 if self._is_serving() else 503)

    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except UnauthorizedError as exc:
            return self._error(exc)
        model = self._generations.model
        card = {
            "id": self.model,
            "object": "model",
            "created": self._created,
            "owned_by": "tandem",
            "root": model.model_name,
            "max_model_len": model.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, Endpoint.COMPLETION)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, Endpoint.CHAT)

    async def _generate(self, request: Request, endpoint: Endpoint) -> Response:
        arrival = time.monotonic()
        openai_request: OpenAIRequest | None = None
        try:
            self._authorize(request)
            limits = self._generations.config.limits
            body = await _read_json(request, self._max_body_bytes, limits)
            openai_request = translate(body, endpoint, limits)
            if openai_request.model is not None and openai_request.model != self.model:
                raise ModelNotServedError(
                    f"the model {openai_request.model!r} does not exist; this server serves {self.model!r}"
                )
            generate = openai_request.generate
            if not openai_request.stream:
                self._check_unstreamed(openai_request)
            generate.request_id = request.headers.get(REQUEST_ID_HEADER, generate.request_id)
            config = self._generations.config
            tenant, priority = tenant_and_priority(
                generate, request.headers.items(), config.tenant_header, config.priority_header
            )
            generation = await self._generations.start(generate, arrival, tenant, priority)
        except Exception as exc:
            return self._error(exc, openai_request.param_for if openai_request is not None else None)
        builder = ResponseBuilder(
            openai_request,
            generation.request_id,
            self.model,
            self._token_text,
            prompt_tokens=generation.num_prompt_tokens,
            parsed=generation.parses_answer,
            token_bytes=self._token_bytes,
        )
        if openai_request.stream:
            # The first messages before the status: a request the engine core refuses before its first
            # token (a constraint that does not compile in time) gets an error status, as a whole
            # answer does, rather than a 200 and an error event.
            first = await _unless_disconnected(request, generation.next_responses())
            if first is None or first.exception() is not None:
                generation.close()
                if first is None:
                    return Response(status_code=499)  # nobody is listening; the request was aborted
                return self._error(first.exception(), openai_request.param_for)
            return StreamingResponse(
                self._events(generation, builder, openai_request, first.result()),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                # Closes the stream even if the client left before the first chunk was asked for.
                background=BackgroundTask(generation.close),
            )
        return await self._whole_answer(request, generation, builder, openai_request)

    def _check_unstreamed(self, request: OpenAIRequest) -> None:
        """A whole answer is built in memory: refuse one whose worst case is past the server's bound."""
        config = self._generations.config
        stopping = request.generate.stopping
        config.limits.check_unstreamed(
            max(request.generate.n, 1),
            stopping.max_tokens if stopping.HasField("max_tokens") else config.max_tokens_cap,
            max(request.generate.sampling.logprobs, 0),
        )

    async def _events(
        self,
        generation: Generation,
        builder: ResponseBuilder,
        request: OpenAIRequest,
        messages: list[pb.GenerateResponse],
    ) -> AsyncIterator[bytes]:
        """SSE chunks from the stream's first `messages` on, then the usage chunk if asked, then [DONE];
        an engine error becomes an error event. Starlette cancels this generator when the client
        disconnects, which aborts the request.

        The events of the messages waiting together go out in one body part: one trip through the ASGI
        stack and one socket write for a writer that fell behind (one message when it keeps up)."""
        try:
            while messages:
                yield b"".join([builder.events(message) for message in messages])
                messages = await generation.next_responses()
            if request.include_usage:
                yield sse_event(builder.usage_chunk())
        except Exception as exc:
            yield sse_event(http_error(exc)[1])
        finally:
            generation.close()
        yield b"data: [DONE]\n\n"

    async def _whole_answer(
        self,
        request: Request,
        generation: Generation,
        builder: ResponseBuilder,
        openai_request: OpenAIRequest,
    ) -> Response:
        async def collect() -> None:
            async for message in generation.responses():
                builder.add(message)

        try:
            collected = await _unless_disconnected(request, collect())
        finally:
            generation.close()
        if collected is None:
            return Response(status_code=499)  # nobody is listening; the request was aborted
        if collected.exception() is not None:
            return self._error(collected.exception(), openai_request.param_for)
        return JSONResponse(builder.body())

    def _authorize(self, request: Request) -> None:
        if self._tokens is None:
            return
        reason = self._tokens.rejection(request.headers.items())
        if reason is not None:
            raise UnauthorizedError(reason)

    @staticmethod
    def _error(error: BaseException, param_for: Callable[[str], str] | None = None) -> JSONResponse:
        status, body = http_error(error, param_for)
        return JSONResponse(body, status_code=status)
