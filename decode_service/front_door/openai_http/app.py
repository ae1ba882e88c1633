"""The OpenAI-compatible routes: GET /v1/models, POST /v1/completions and /v1/chat/completions, the
Responses API (`responses_routes`), GET /health, and GET /metrics (the server's Prometheus registry, where
gateways scrape a vLLM server); beside them Anthropic's Messages API (`anthropic_routes`) and vLLM's
/tokenize and /detokenize (`tokenize_routes`).

Each request is translated (`protocol`), run through the same `Generations` as a gRPC call, and answered
from its `GenerateResponse`s (`responses`), as one JSON body or as server-sent events ending with
`data: [DONE]`. A client that disconnects, mid-stream or while waiting for a whole answer, aborts its
request at once. The bearer token and body size limit are the gRPC port's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from functools import lru_cache
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import TypeAdapter
from starlette.background import BackgroundTask

from decode_service.front_door.admission import tenant_and_priority
from decode_service.front_door.generation import Generation, Generations
from decode_service.front_door.openai_http.anthropic_models import (
    CountTokensRequest,
    CreateMessageRequest,
    MessageOut,
    MessageStreamEvent,
    TokenCount,
)
from decode_service.front_door.openai_http.anthropic_routes import MessagesRoutes
from decode_service.front_door.openai_http.errors import UnauthorizedError, http_error
from decode_service.front_door.openai_http.models import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChunk,
    CompletionRequest,
)
from decode_service.front_door.openai_http.protocol import Endpoint, OpenAIRequest, translate
from decode_service.front_door.openai_http.request_io import (
    REQUEST_ID_HEADER,
    ApiKeys,
    check_model,
    read_json,
    unless_disconnected,
)
from decode_service.front_door.openai_http.response_store import ResponseStore
from decode_service.front_door.openai_http.responses import ResponseBuilder, sse_event
from decode_service.front_door.openai_http.responses_api_models import (
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
)
from decode_service.front_door.openai_http.responses_routes import ResponsesRoutes
from decode_service.front_door.openai_http.tokenize_models import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from decode_service.front_door.openai_http.tokenize_routes import TokenizeRoutes
from protos.tandem.v1 import generation_pb2 as pb
from serving import tracing

logger = logging.getLogger(__name__)

# Each route's request body, answer and stream chunk (each server-sent event's data; None: no stream).
_BODIES: dict[str, tuple[type, type, type | None]] = {
    "/v1/completions": (CompletionRequest, Completion, CompletionChunk),
    "/v1/chat/completions": (ChatCompletionRequest, ChatCompletion, ChatCompletionChunk),
    "/v1/responses": (ResponsesRequest, ResponseObject, ResponseStreamEvent),
    "/v1/messages": (CreateMessageRequest, MessageOut, MessageStreamEvent),
    "/v1/messages/count_tokens": (CountTokensRequest, TokenCount, None),
    "/tokenize": (TokenizeRequest, TokenizeResponse, None),
    "/detokenize": (DetokenizeRequest, DetokenizeResponse, None),
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
            content = {"application/json": ref(answer)}
            if chunk is not None:
                content["text/event-stream"] = ref(chunk)
            post["responses"]["200"]["content"] = content
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
        self._keys = ApiKeys(auth_token)
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
            lambda request: read_json(request, self._max_body_bytes, self._generations.config.limits),
            self._keys.authorize,
            unless_disconnected,
            self._error,
            REQUEST_ID_HEADER,
        ).register(app)
        for routes in (MessagesRoutes, TokenizeRoutes):
            routes(self._generations, self.model, self._keys, self._max_body_bytes).register(app)
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
            self._keys.authorize(request)
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
            self._keys.authorize(request)
            limits = self._generations.config.limits
            body = await read_json(request, self._max_body_bytes, limits)
            openai_request = translate(body, endpoint, limits)
            check_model(openai_request.model, self.model)
            generate = openai_request.generate
            if not openai_request.stream:
                self._check_unstreamed(openai_request)
            generate.request_id = request.headers.get(REQUEST_ID_HEADER, generate.request_id)
            config = self._generations.config
            tenant, priority = tenant_and_priority(
                generate, request.headers.items(), config.tenant_header, config.priority_header
            )
            traceparent = tracing.traceparent_from(request.headers.items())
            generation = await self._generations.start(generate, arrival, tenant, priority, traceparent)
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
            first = await unless_disconnected(request, generation.next_responses())
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
            collected = await unless_disconnected(request, collect())
        finally:
            generation.close()
        if collected is None:
            return Response(status_code=499)  # nobody is listening; the request was aborted
        if collected.exception() is not None:
            return self._error(collected.exception(), openai_request.param_for)
        return JSONResponse(builder.body())

    @staticmethod
    def _error(error: BaseException, param_for: Callable[[str], str] | None = None) -> JSONResponse:
        status, body = http_error(error, param_for)
        return JSONResponse(body, status_code=status)
