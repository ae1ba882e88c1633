"""vLLM's tokenizer routes: `POST /tokenize` (a prompt or a chat → the token ids the server would serve)
and `POST /detokenize` (token ids → text), with the OpenAI routes' key, body limits and error shape.

A chat is translated by the chat route's own `translate`, so its messages, tools and template variables
are checked, and rendered, exactly as a chat completion's are; counting goes through the same
validation lanes as generating (`Generations.prompt_token_ids`).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from decode_service.front_door.generation import Generations
from decode_service.front_door.openai_http.errors import http_error
from decode_service.front_door.openai_http.models import parse
from decode_service.front_door.openai_http.protocol import Endpoint, OpenAIRequest, translate
from decode_service.front_door.openai_http.request_io import ApiKeys, check_model, read_json
from decode_service.front_door.openai_http.tokenize_models import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from protos.tandem.v1 import generation_pb2 as pb


class TokenizeRoutes:
    """The two handlers, bound to one decode server's `Generations`."""

    def __init__(
        self, generations: Generations, served_model_name: str, keys: ApiKeys, max_body_bytes: int
    ) -> None:
        self._generations = generations
        self._model = served_model_name
        self._keys = keys
        self._max_body_bytes = max_body_bytes

    def register(self, app: FastAPI) -> None:
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])

    async def tokenize(self, request: Request) -> JSONResponse:
        chat: OpenAIRequest | None = None
        try:
            body = await self._body(request)
            parsed = parse(body, TokenizeRequest)
            check_model(parsed.model, self._model)
            if parsed.messages is None:
                generate = pb.GenerateRequest(prompt=parsed.prompt)
            else:
                chat_fields = ("messages", "tools", "chat_template_kwargs")
                chat_body = {name: body[name] for name in chat_fields if name in body}
                chat = translate(chat_body, Endpoint.CHAT, self._generations.config.limits)
                generate = chat.generate
            tokens = await self._generations.prompt_token_ids(generate)
        except Exception as exc:
            return _error(exc, chat)
        answer: TokenizeResponse = {
            "count": len(tokens),
            "max_model_len": self._generations.model.max_model_len,
            "tokens": tokens,
        }
        return JSONResponse(answer)

    async def detokenize(self, request: Request) -> JSONResponse:
        try:
            parsed = parse(await self._body(request), DetokenizeRequest)
            check_model(parsed.model, self._model)
            text = await self._generations.detokenize(parsed.tokens)
        except Exception as exc:
            return _error(exc)
        answer: DetokenizeResponse = {"prompt": text}
        return JSONResponse(answer)

    async def _body(self, request: Request) -> object:
        self._keys.authorize(request)
        return await read_json(request, self._max_body_bytes, self._generations.config.limits)


def _error(error: Exception, chat: OpenAIRequest | None = None) -> JSONResponse:
    status, body = http_error(error, chat.param_for if chat is not None else None)
    return JSONResponse(body, status_code=status)
