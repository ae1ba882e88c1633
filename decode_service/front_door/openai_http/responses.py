"""The stream's `GenerateResponse`s → OpenAI response bodies and SSE chunks, shaped as the TypedDicts
of `models`.

It reads the very messages the gRPC API sends, so both front doors report the same text, reasoning,
tool calls, tokens, finish reasons and usage. One builder serves one request: `events()` (or `chunks()`,
the same as dicts) per message when streaming, `add()` per message then `body()` otherwise. Reasoning goes
out as `reasoning_content` (vLLM's name) and tool calls as OpenAI's `tool_calls`, in deltas as OpenAI
streams them: a call's first entry has its id, type and name, later ones more of its arguments.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from decode_service.front_door.openai_http.models import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    ChatTokenLogprob,
    Completion,
    CompletionChunk,
    CompletionLogprobs,
    TokenLogprob,
    ToolCallDelta,
    Usage,
)
from decode_service.front_door.openai_http.protocol import Endpoint, OpenAIRequest
from protos.tandem.v1 import generation_pb2 as pb

# "abort" is vLLM's word for a request the server ended (drain, shutdown); OpenAI has none.
_FINISH_REASONS = {pb.STOP: "stop", pb.LENGTH: "length", pb.ABORT: "abort", pb.TOOL_CALLS: "tool_calls"}

TokenText = Callable[[int], str]
TokenBytes = Callable[[int], bytes]

# Made once: `json.dumps` with these options builds a new encoder per call, a third of an event's cost.
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
# What a logprob of -inf (a token the sampler could never pick) is reported as: vLLM's value.
LOGPROB_FLOOR = -9999.0
# Stands for the text in a choice's text-event template; only its JSON form is searched for.
_TEXT_PLACEHOLDER = "\ue000text\ue000"


def json_logprob(logprob: float) -> float | None:
    """`logprob` as JSON can carry it. JSON has no NaN or infinity, and a strict encoder refuses them
    (the whole answer becomes a bare 500): -inf is sent as vLLM sends it, -9999.0; NaN (numbers that
    broke; no sound model makes one) as null."""
    if math.isfinite(logprob):
        return logprob
    return LOGPROB_FLOOR if logprob < 0 else None


def sse_event(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying `payload` as compact JSON."""
    return b"data: " + _JSON.encode(payload).encode() + b"\n\n"


@dataclass
class _Choice:
    texts: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    # Per call index: {"id", "type", "function": {"name", "arguments"}}, arguments joined at the end.
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    text_offset: int = 0
    completion_tokens: int = 0  # counted from token_ids, for continuous usage only
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ResponseBuilder:
    """Shapes one request's answer for its endpoint (chat or text completion)."""

    def __init__(
        self,
        request: OpenAIRequest,
        request_id: str,
        model: str,
        token_text: TokenText,
        created: int | None = None,
        prompt_tokens: int = 0,
        parsed: bool = False,
        token_bytes: TokenBytes | None = None,
    ) -> None:
        self._request = request
        self._chat = request.endpoint is Endpoint.CHAT
        self.id = f"{'chatcmpl' if self._chat else 'cmpl'}-{request_id}"
        self._model = model
        self._token_text = token_text
        # Each token's own bytes: its text alone may be U+FFFD, for a token holding part of a character.
        self._token_bytes = token_bytes or (lambda token_id: token_text(token_id).encode())
        self._created = int(time.time()) if created is None else created
        self._choices: dict[int, _Choice] = {}
        # Known at the start (the prompt is tokenized before the stream opens): continuous usage needs it.
        self._prompt_tokens = prompt_tokens
        self._cached_tokens = 0
        self._completion_tokens = 0
        # Per choice index: the bytes before and after the text of a plain text event (see `events`).
        self._text_templates: dict[int, tuple[bytes, bytes]] = {}
        # Plain text events share a template unless every chunk carries its own usage, or the answer is
        # parsed (`parsed`: its messages may carry reasoning or tool calls beside the text).
        self._templated = not request.continuous_usage and not parsed

    # -- streaming -----------------------------------------------------------------------------------

    def chunks(self, message: pb.GenerateResponse) -> list[ChatCompletionChunk | CompletionChunk]:
        """The SSE chunks for one stream message (a chat choice's first one is preceded by its role)."""
        first = message.index not in self._choices
        choice = self._choice(message)
        logprobs = self._logprobs(message, choice)
        out = []
        if self._chat and first:
            out.append(self._chunk({"index": message.index, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}, choice))  # fmt: skip
        choice.completion_tokens += len(message.token_ids)
        text = self._text(message, choice)
        if not (text or logprobs or choice.finish_reason or message.reasoning_text or message.tool_calls):
            return out
        entry = self._entry(message.index, text, logprobs, choice)
        if self._chat:
            if message.reasoning_text:
                entry["delta"]["reasoning_content"] = message.reasoning_text
            if message.tool_calls:
                entry["delta"]["tool_calls"] = [_tool_call_delta(call) for call in message.tool_calls]
        out.append(self._chunk(entry, choice))
        return out

    def events(self, message: pb.GenerateResponse) -> bytes:
        """`chunks(message)` as server-sent events.

        The event almost every token gets — text only, in a choice that has started and not finished —
        is its text's JSON spliced into the choice's template, the same bytes for a sixth of the cost.
        """
        choice = self._choices.get(message.index)
        if (
            message.text
            and not message.logprobs
            and not message.finish_reason
            and self._templated
            and choice is not None
            and choice.finish_reason is None
        ):
            head, tail = self._text_templates.get(message.index) or self._text_template(message.index)
            return head + _JSON.encode(message.text).encode() + tail
        return b"".join(sse_event(chunk) for chunk in self.chunks(message))

    def _text_template(self, index: int) -> tuple[bytes, bytes]:
        """The bytes around the text of choice `index`'s plain text event, made from the chunk itself."""
        event = sse_event(self._chunk(self._entry(index, _TEXT_PLACEHOLDER, None, _Choice()), _Choice()))
        head, tail = event.split(_JSON.encode(_TEXT_PLACEHOLDER).encode())
        self._text_templates[index] = head, tail
        return head, tail

    def usage_chunk(self) -> ChatCompletionChunk | CompletionChunk:
        """The last chunk when stream_options.include_usage is set: no choices, the whole usage."""
        return {**self._envelope(chunk=True), "choices": [], "usage": self.usage()}

    def _entry(
        self, index: int, text: str, logprobs: dict[str, Any] | None, choice: _Choice
    ) -> dict[str, Any]:
        """One choice's part of a stream chunk."""
        entry: dict[str, Any] = {"index": index}
        if self._chat:
            entry["delta"] = {"content": text} if text else {}
        else:
            entry["text"] = text
        entry["logprobs"] = logprobs
        entry["finish_reason"] = choice.finish_reason
        if choice.finish_reason is not None:
            entry["stop_reason"] = choice.stop_reason
        return entry

    def _chunk(self, entry: dict[str, Any], choice: _Choice) -> ChatCompletionChunk | CompletionChunk:
        chunk = {**self._envelope(chunk=True), "choices": [entry]}
        if self._request.include_usage:
            # vLLM's continuous usage counts the choice's own tokens so far.
            chunk["usage"] = self._usage(choice.completion_tokens) if self._request.continuous_usage else None
        return chunk

    def _text(self, message: pb.GenerateResponse, choice: _Choice) -> str:
        """The message's text, with the matched stop string after the last text when the client asked."""
        if self._request.include_stop and message.finish_reason and isinstance(choice.stop_reason, str):
            return message.text + choice.stop_reason
        return message.text

    # -- whole answer --------------------------------------------------------------------------------

    def add(self, message: pb.GenerateResponse) -> None:
        choice = self._choice(message)
        choice.texts.append(self._text(message, choice))
        if message.reasoning_text:
            choice.reasoning.append(message.reasoning_text)
        for delta in message.tool_calls:
            call = choice.tool_calls.get(delta.index)
            if call is None:
                choice.tool_calls[delta.index] = call = {
                    "id": delta.id, "type": "function", "function": {"name": delta.name, "arguments": []}
                }  # fmt: skip
            call["function"]["arguments"].append(delta.arguments)
        logprobs = self._logprobs(message, choice)
        if logprobs is not None:
            choice.logprobs.append(logprobs)

    def body(self) -> ChatCompletion | Completion:
        choices = []
        for index in sorted(self._choices):
            choice = self._choices[index]
            text = "".join(choice.texts)
            entry: dict[str, Any] = {"index": index}
            if self._chat:
                entry["message"] = self._message(text, choice)
            else:
                entry["text"] = text
            entry["logprobs"] = self._merged_logprobs(choice.logprobs)
            entry["finish_reason"] = choice.finish_reason
            entry["stop_reason"] = choice.stop_reason
            choices.append(entry)
        return {**self._envelope(chunk=False), "choices": choices, "usage": self.usage()}

    @staticmethod
    def _message(text: str, choice: _Choice) -> AssistantMessage:
        """A chat choice's message: content null when the answer is tool calls only, as OpenAI sends it."""
        message: AssistantMessage = {
            "role": "assistant",
            "content": text or (None if choice.tool_calls else ""),
        }
        if choice.reasoning:
            message["reasoning_content"] = "".join(choice.reasoning)
        if choice.tool_calls:
            message["tool_calls"] = [
                {
                    **call,
                    "function": {**call["function"], "arguments": "".join(call["function"]["arguments"])},
                }
                for call in (choice.tool_calls[index] for index in sorted(choice.tool_calls))
            ]
        return message

    def usage(self) -> Usage:
        """OpenAI's usage object; `prompt_tokens_details.cached_tokens` counts the prompt tokens the prefix
        cache served (not recomputed), as OpenAI reports its own prompt caching."""
        return self._usage(self._completion_tokens)

    def _usage(self, completion: int) -> Usage:
        prompt = self._prompt_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self._cached_tokens},
        }

    # -- shared --------------------------------------------------------------------------------------

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        kind = self._request.endpoint.value
        if chunk and self._chat:
            kind += ".chunk"
        return {"id": self.id, "object": kind, "created": self._created, "model": self._model}

    def _choice(self, message: pb.GenerateResponse) -> _Choice:
        """The choice `message` belongs to, with its finish and the request's usage recorded."""
        choice = self._choices.setdefault(message.index, _Choice())
        if message.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            choice.finish_reason = _FINISH_REASONS[message.finish_reason]
            stop = message.WhichOneof("matched_stop")
            choice.stop_reason = getattr(message, stop) if stop else None
            self._prompt_tokens = message.usage.prompt_tokens
            self._cached_tokens = message.usage.cached_tokens
            self._completion_tokens += message.usage.completion_tokens
        return choice

    def _logprobs(
        self, message: pb.GenerateResponse, choice: _Choice
    ) -> ChatLogprobs | CompletionLogprobs | None:
        """This message's logprobs in the endpoint's format; None when they were not asked for."""
        top = self._request.top_logprobs
        if top is None or not message.logprobs:
            return None
        if self._chat:
            return {
                "content": [
                    self._chat_entry(lp.token_id, lp.logprob, lp.top[:top]) for lp in message.logprobs
                ]
            }
        tokens = [self._token_text(lp.token_id) for lp in message.logprobs]
        offsets = []
        for token in tokens:
            offsets.append(choice.text_offset)
            choice.text_offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [json_logprob(lp.logprob) for lp in message.logprobs],
            "top_logprobs": [
                {self._token_text(t.token_id): json_logprob(t.logprob) for t in lp.top[:top]}
                for lp in message.logprobs
            ],
            "text_offset": offsets,
        }

    def _chat_entry(self, token_id: int, logprob: float, top: Any) -> ChatTokenLogprob:
        return {
            **self._chat_token(token_id, json_logprob(logprob)),
            "top_logprobs": [self._chat_token(t.token_id, json_logprob(t.logprob)) for t in top],
        }

    def _chat_token(self, token_id: int, logprob: float | None) -> TokenLogprob:
        token = self._token_text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(self._token_bytes(token_id))}

    def _merged_logprobs(self, parts: list[dict[str, Any]]) -> dict[str, Any] | None:
        if self._request.top_logprobs is None:
            return None
        merged: dict[str, list[Any]] = {}
        for part in parts:
            for key, values in part.items():
                merged.setdefault(key, []).extend(values)
        if merged:
            return merged
        keys = ("content",) if self._chat else ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        return {key: [] for key in keys}


def _tool_call_delta(delta: pb.ToolCallDelta) -> ToolCallDelta:
    """A stream chunk's tool_calls entry: the call's first one has id, type and name, later ones only
    more of its arguments (the SDKs concatenate them by index)."""
    if delta.id:
        return {"index": delta.index, "id": delta.id, "type": "function",
                "function": {"name": delta.name, "arguments": delta.arguments}}  # fmt: skip
    return {"index": delta.index, "function": {"arguments": delta.arguments}}
