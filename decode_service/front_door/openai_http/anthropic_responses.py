"""A request's `GenerateResponse`s → Anthropic's message: one JSON body, or its stream of events.

The answer is a list of content blocks in the order the model wrote them: thinking (the reasoning
parser's split), text, then one tool_use block per call. The stream opens a block when the kind of
content changes and closes the one before (`content_block_start` / `_delta` / `_stop`), between
`message_start` and the closing `message_delta` (stop reason and usage) and `message_stop`. Both come
from the same state, so a streamed answer put together is the whole answer.

MessageUsage follows Anthropic's meaning: `input_tokens` are the prompt tokens computed for this request,
`cache_read_input_tokens` those the prefix cache served (known at the end: `message_start` counts the
whole prompt as input, `message_delta` has the final split).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from decode_service.front_door import json_text
from decode_service.front_door.openai_http.anthropic_models import (
    MessageOut,
    MessageStreamEvent,
    MessageUsage,
    StopReason,
)
from protos.tandem.v1 import generation_pb2 as pb

# "abort" (a request the server ended: drain, shutdown) has no Anthropic reason; as vLLM, end_turn.
_STOP_REASONS: dict[int, StopReason] = {
    pb.STOP: "end_turn",
    pb.LENGTH: "max_tokens",
    pb.TOOL_CALLS: "tool_use",
    pb.ABORT: "end_turn",
}
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def sse_event(payload: dict[str, Any]) -> bytes:
    """One server-sent event named by its payload's type, as Anthropic's stream sends them."""
    return b"event: " + payload["type"].encode() + b"\ndata: " + _JSON.encode(payload).encode() + b"\n\n"


def tool_input(arguments: str) -> Any:
    """A call's arguments as the `input` value: the JSON the model wrote, parsed (the text itself when
    it is not JSON, which only an unconstrained call can write)."""
    try:
        return json_text.loads(arguments or "{}")
    except json_text.JsonTextError:
        return arguments


@dataclass
class _Block:
    """One content block: its kind, its start (id and name for a call) and the pieces of its content."""

    kind: str
    start: dict[str, Any]
    pieces: list[str] = field(default_factory=list)

    def whole(self) -> dict[str, Any]:
        content = "".join(self.pieces)
        if self.kind == "tool_use":
            return {**self.start, "input": tool_input(content)}
        return {**self.start, self.kind: content}


_DELTAS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking"),
           "tool_use": ("input_json_delta", "partial_json")}  # fmt: skip


class MessageBuilder:
    """Shapes one request's answer as an Anthropic message (a request has one choice)."""

    def __init__(self, request_id: str, model: str, prompt_tokens: int) -> None:
        self.id = f"msg_{request_id}"
        self._model = model
        self._blocks: list[_Block] = []
        self._open: _Block | None = None
        self._stop_reason: StopReason | None = None
        self._stop_sequence: str | None = None
        self._prompt_tokens = prompt_tokens
        self._cached_tokens = 0
        self._output_tokens = 0

    def start_event(self) -> bytes:
        """`message_start`: the message with no content yet."""
        return sse_event({"type": "message_start", "message": self.body()})

    def events(self, message: pb.GenerateResponse) -> bytes:
        """The events of one stream message; the last one's end with `message_delta` and `message_stop`."""
        return b"".join(sse_event(event) for event in self._feed(message))

    def add(self, message: pb.GenerateResponse) -> None:
        """Take one message into the whole answer."""
        self._feed(message)

    def body(self) -> MessageOut:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [block.whole() for block in self._blocks],
            "stop_reason": self._stop_reason,
            "stop_sequence": self._stop_sequence,
            "usage": self.usage(),
        }

    def usage(self) -> MessageUsage:
        return {
            "input_tokens": self._prompt_tokens - self._cached_tokens,
            "output_tokens": self._output_tokens,
            "cache_read_input_tokens": self._cached_tokens,
            "cache_creation_input_tokens": 0,
        }

    def _feed(self, message: pb.GenerateResponse) -> list[MessageStreamEvent]:
        events: list[MessageStreamEvent] = []
        if message.reasoning_text:
            events += self._content("thinking", message.reasoning_text, {"type": "thinking", "signature": ""})
        if message.text:
            events += self._content("text", message.text, {"type": "text"})
        for call in message.tool_calls:
            if call.id:
                start = {"type": "tool_use", "id": call.id, "name": call.name}
                events += self._content("tool_use", call.arguments, start, always_open=True)
            elif call.arguments:
                events += self._content("tool_use", call.arguments, {})
        if message.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            events += self._close()
            events += self._finish(message)
        return events

    def _content(
        self, kind: str, piece: str, start: dict[str, Any], always_open: bool = False
    ) -> list[MessageStreamEvent]:
        """`piece` of a `kind` block: into the open one if it is of that kind, else a new one (`start`)."""
        events: list[MessageStreamEvent] = []
        if always_open or self._open is None or self._open.kind != kind:
            events += self._close()
            self._open = _Block(kind, start)
            self._blocks.append(self._open)
            empty = {**start, "input": {}} if kind == "tool_use" else {**start, kind: ""}
            events.append({"type": "content_block_start", "index": len(self._blocks) - 1,
                           "content_block": empty})  # fmt: skip
        if piece:
            self._open.pieces.append(piece)
            delta_type, key = _DELTAS[kind]
            events.append({"type": "content_block_delta", "index": len(self._blocks) - 1,
                           "delta": {"type": delta_type, key: piece}})  # fmt: skip
        return events

    def _close(self) -> list[MessageStreamEvent]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self._blocks) - 1}]

    def _finish(self, message: pb.GenerateResponse) -> list[MessageStreamEvent]:
        self._stop_reason = _STOP_REASONS[message.finish_reason]
        if message.WhichOneof("matched_stop") == "stop_string":
            self._stop_reason = "stop_sequence"
            self._stop_sequence = message.stop_string
        self._prompt_tokens = message.usage.prompt_tokens
        self._cached_tokens = message.usage.cached_tokens
        self._output_tokens = message.usage.completion_tokens
        delta = {"stop_reason": self._stop_reason, "stop_sequence": self._stop_sequence}
        return [
            {"type": "message_delta", "delta": delta, "usage": self.usage()},
            {"type": "message_stop"},
        ]
