"""OpenAI's Responses API over the chat path: a `POST /v1/responses` body → the public `GenerateRequest`
(`translate_responses`), and the stream's `GenerateResponse`s → the response object and its stream
events (`ResponsesAnswer`).

A request is a chat request underneath: `instructions` become the system turn, input items become turns
(a `function_call` joins the assistant turn before it as a tool call, a `function_call_output` is a tool
turn, a `reasoning` item is dropped as the chat route drops `reasoning_content`), `text.format` is the
chat route's structured output, and function tools and `tool_choice` are its tools, held to their
schemas by the same grammars. A stored earlier response (`previous_response_id`) puts its conversation and
its output first; its instructions are not inherited, as OpenAI documents.

The answer's output items come in the order the model writes them: a `reasoning` item (what
`--reasoning-parser` splits off), a `message` with one `output_text`, and one `function_call` per call.
Streamed, each item is opened (`response.output_item.added`, and its `content_part.added`), grows by
deltas and is closed (`...done`) before the next one opens; every event has its `sequence_number`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from decode_service.front_door.admission import RequestLimits
from decode_service.front_door.openai_http.errors import FieldError, ResponseNotFoundError
from decode_service.front_door.openai_http.response_store import StoredResponse
from decode_service.front_door.openai_http.responses_api_models import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningItem,
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
    ResponseUsage,
    TextContent,
    parse_responses_request,
)
from engine.sampler import SEED_MASK
from protos.tandem.v1 import generation_pb2 as pb

_TOOL_CHOICE_MODES = {
    "none": pb.TOOL_CHOICE_NONE,
    "auto": pb.TOOL_CHOICE_AUTO,
    "required": pb.TOOL_CHOICE_REQUIRED,
}
# The store lookup a request is translated with: None when this server keeps no responses.
PreviousLookup = Callable[[str], StoredResponse | None] | None


@dataclass(frozen=True)
class ResponsesCall:
    """A translated Responses request: what to generate, and what its answer echoes and stores."""

    request: ResponsesRequest
    generate: pb.GenerateRequest
    # The turns before the answer, instructions excepted: what a stored response keeps for continuations.
    conversation: list[pb.ChatMessage]
    # The parameter that set `generate.structured_output` (e.g. "text.format.schema"), for error messages.
    constraint_param: str | None = None

    def param_for(self, field: str) -> str:
        """The Responses parameter a gRPC field path stands for (tools[1].parameters_json →
        tools[1].parameters), so a 400 names what the client sent."""
        if field.startswith("structured_output") and self.constraint_param is not None:
            return self.constraint_param
        if field.startswith("tool_choice"):
            return "tool_choice"
        if field.startswith("messages"):
            return "input"
        if field.startswith("tools[") and field.endswith(".parameters_json"):
            return field.removesuffix("_json")
        return field


def _text(content: str | list[TextContent]) -> str:
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


def _add_input_item(
    item: MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem, turns: list[pb.ChatMessage]
) -> None:
    """Append what `item` adds to the conversation `turns`."""
    if isinstance(item, MessageItem):
        role = "system" if item.role == "developer" else item.role
        turns.append(pb.ChatMessage(role=role, content=_text(item.content)))
    elif isinstance(item, FunctionCallItem):
        if not turns or turns[-1].role != "assistant":
            turns.append(pb.ChatMessage(role="assistant", content=""))
        turns[-1].tool_calls.add(id=item.call_id, name=item.name, arguments=item.arguments)
    elif isinstance(item, FunctionCallOutputItem):
        turn = pb.ChatMessage(role="tool", content=_text(item.output), tool_call_id=item.call_id)
        name = _called_name(turns, item.call_id)
        if name is not None:
            turn.name = name
        turns.append(turn)
    # A reasoning item adds nothing: the chat templates drop earlier reasoning.


def _called_name(turns: list[pb.ChatMessage], call_id: str) -> str | None:
    for turn in reversed(turns):
        for call in turn.tool_calls:
            if call.id == call_id:
                return call.name
    return None


def output_turns(output: list[dict[str, Any]]) -> list[pb.ChatMessage]:
    """A response's output items as the assistant turns a continuation's prompt shows."""
    turns: list[pb.ChatMessage] = []
    for item in output:
        if item["type"] == "message":
            text = "".join(part["text"] for part in item["content"])
            turns.append(pb.ChatMessage(role="assistant", content=text))
        elif item["type"] == "function_call":
            if not turns or turns[-1].role != "assistant":
                turns.append(pb.ChatMessage(role="assistant", content=""))
            turns[-1].tool_calls.add(id=item["call_id"], name=item["name"], arguments=item["arguments"])
    return turns


def _check_input_count(body: object, limits: RequestLimits) -> None:
    """Refuse more input items than chat turns `limits` allow, before any is parsed."""
    items = body.get("input") if isinstance(body, dict) else None
    if isinstance(items, list) and len(items) > limits.max_chat_messages:
        raise FieldError(
            "input",
            f"input has {len(items)} items, above this server's limit of {limits.max_chat_messages} "
            "(--max-chat-messages)",
        )


def _previous_turns(request: ResponsesRequest, previous: PreviousLookup) -> list[pb.ChatMessage]:
    response_id = request.previous_response_id
    if response_id is None:
        return []
    if previous is None:
        raise FieldError(
            "previous_response_id",
            "previous_response_id needs stored responses, which this server does not keep "
            "(start it with --enable-responses-store)",
        )
    stored = previous(response_id)
    if stored is None:
        raise ResponseNotFoundError(
            "previous_response_id", f"previous_response_id {response_id!r}: no such response is stored"
        )
    return [*stored.conversation, *output_turns(stored.body["output"])]


def _structured_output(request: ResponsesRequest) -> tuple[pb.StructuredOutput | None, str | None]:
    text_format = request.text.format if request.text is not None else None
    if text_format is None or text_format.type == "text":
        return None, None
    if text_format.type == "json_object":
        return pb.StructuredOutput(json_object=True), "text.format"
    param = "text.format.schema"
    schema = text_format.schema_
    if schema is None:
        raise FieldError(param, f"{param} is required")
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise FieldError(param, f"{param} is not JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise FieldError(param, f"{param} must be a JSON schema (an object), got {schema!r}")
    return pb.StructuredOutput(json_schema=json.dumps(schema)), param


def _tools(request: ResponsesRequest, generate: pb.GenerateRequest, constraint_param: str | None) -> None:
    for tool in request.tools or ():
        converted = generate.tools.add(name=tool.name, description=tool.description or "")
        if tool.parameters is not None:
            converted.parameters_json = json.dumps(tool.parameters)
    choice = request.tool_choice
    if choice is None:
        return
    if not generate.tools and choice != "none":
        shown = choice if isinstance(choice, str) else choice.model_dump()
        raise FieldError("tool_choice", f"tool_choice {shown!r} needs tools")
    if not generate.tools:
        return
    if isinstance(choice, str):
        generate.tool_choice.mode = _TOOL_CHOICE_MODES[choice]
    else:
        generate.tool_choice.function_name = choice.name
    if choice not in ("none", "auto") and constraint_param is not None:
        raise FieldError(
            "tool_choice",
            f"tool_choice and {constraint_param} are both set; a request may use one output constraint",
        )


def translate_responses(
    body: object, limits: RequestLimits, previous: PreviousLookup = None
) -> ResponsesCall:
    """Check a Responses body and build the `GenerateRequest` it stands for; `previous` looks up a
    stored response by id (for the caller's tenant), None when this server stores none."""
    _check_input_count(body, limits)
    request = parse_responses_request(body)
    conversation = _previous_turns(request, previous)
    if isinstance(request.input, str):
        conversation.append(pb.ChatMessage(role="user", content=request.input))
    else:
        for item in request.input:
            _add_input_item(item, conversation)
    if len(conversation) > limits.max_chat_messages:
        raise FieldError(
            "input",
            f"the conversation has {len(conversation)} turns with the previous response's, above this "
            f"server's limit of {limits.max_chat_messages} (--max-chat-messages)",
        )
    generate = pb.GenerateRequest()
    if request.instructions:
        generate.messages.add(role="system", content=request.instructions)
    generate.messages.extend(conversation)
    sampling = generate.sampling
    for name in ("temperature", "top_p", "top_k"):
        if getattr(request, name) is not None:
            setattr(sampling, name, getattr(request, name))
    if request.seed is not None:
        sampling.seed = request.seed & SEED_MASK
    if request.max_output_tokens is not None:
        generate.stopping.max_tokens = request.max_output_tokens
    generate.n = 1
    generate.priority = request.priority or 0
    generate.tenant = request.user or ""
    if request.request_id:
        generate.request_id = request.request_id
    constraint, constraint_param = _structured_output(request)
    if constraint is not None:
        generate.structured_output.CopyFrom(constraint)
    _tools(request, generate, constraint_param)
    if request.parallel_tool_calls is not None:
        generate.parallel_tool_calls = request.parallel_tool_calls
    return ResponsesCall(request, generate, conversation, constraint_param)


# -- answers ----------------------------------------------------------------------------------------------

_DONE_STATUS = {
    pb.STOP: "completed",
    pb.TOOL_CALLS: "completed",
    pb.LENGTH: "incomplete",
    pb.ABORT: "cancelled",
}


def new_response_id() -> str:
    """A fresh, unguessable id: never the client's request_id, so no client can choose another's id."""
    return f"resp_{uuid.uuid4().hex}"


@dataclass
class _Item:
    """One output item being written: its shape, and the text or arguments so far."""

    kind: str  # "reasoning", "message" or "function_call"
    id: str
    pieces: list[str] = field(default_factory=list)
    call_id: str = ""
    name: str = ""

    def shape(self, status: str) -> dict[str, Any]:
        text = "".join(self.pieces)
        if self.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
            return {"id": self.id, "type": "reasoning", "summary": [], "content": content, "status": status}
        if self.kind == "message":
            content = [_output_text(text)] if status != "in_progress" else []
            return {
                "id": self.id,
                "type": "message",
                "role": "assistant",
                "status": status,
                "content": content,
            }
        arguments = text if status != "in_progress" else ""
        return {"id": self.id, "type": "function_call", "call_id": self.call_id, "name": self.name,
                "arguments": arguments, "status": status}  # fmt: skip


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponsesAnswer:
    """One request's response object, built from its stream's messages: `feed` each message (its events,
    for a stream), then `finish` (the closing events); `body()` is the response object at any point."""

    def __init__(self, call: ResponsesCall, response_id: str, model: str, stored: bool) -> None:
        self._call = call
        self.id = response_id
        self._model = model
        self._stored = stored
        self._created_at = int(time.time())
        self._items: list[_Item] = []
        self._open: _Item | None = None
        self._calls: dict[int, int] = {}  # tool call index -> output index
        self._sequence = 0
        self._status = "in_progress"
        self._usage: ResponseUsage | None = None
        self._reasoning_tokens = 0

    # -- stream ----------------------------------------------------------------------------------------

    def start(self) -> list[ResponseStreamEvent]:
        """The events a stream opens with: response.created, then response.in_progress."""
        return [
            self._event("response.created", response=self.body()),
            self._event("response.in_progress", response=self.body()),
        ]

    def feed(self, message: pb.GenerateResponse) -> list[ResponseStreamEvent]:
        """Take one stream message; returns its events."""
        events: list[ResponseStreamEvent] = []
        if message.reasoning_text:
            item = self._item("reasoning", events)
            events.append(self._delta("response.reasoning_text.delta", item, message.reasoning_text))
            if not message.text and not message.tool_calls:
                # The tokens of a message that only reasons (a message can straddle the reasoning's end).
                self._reasoning_tokens += len(message.token_ids)
        if message.text:
            item = self._item("message", events)
            events.append(self._delta("response.output_text.delta", item, message.text, logprobs=[]))
        for delta in message.tool_calls:
            if delta.index not in self._calls:
                self._close(events)
                self._calls[delta.index] = len(self._items)
                self._open_item(
                    _Item("function_call", f"fc_{uuid.uuid4().hex}", [], delta.id, delta.name), events
                )
            item = self._items[self._calls[delta.index]]
            if delta.arguments:
                item.pieces.append(delta.arguments)
                events.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=item.id,
                        output_index=self._calls[delta.index],
                        delta=delta.arguments,
                    )  # fmt: skip
                )
        if message.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self._status = _DONE_STATUS.get(message.finish_reason, "completed")
            usage = message.usage
            self._usage = {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens},
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            }
        return events

    def finish(self) -> list[ResponseStreamEvent]:
        """The closing events: the open item's `...done` events, then response.completed (whatever the
        status, as vLLM sends it: the SDKs' `get_final_response` waits for that event)."""
        events: list[ResponseStreamEvent] = []
        self._close(events)
        events.append(self._event("response.completed", response=self.body()))
        return events

    def error_event(self, status_body: dict[str, Any]) -> ResponseStreamEvent:
        """The `error` event that ends a stream an engine error broke (`status_body`: the error body)."""
        error = status_body["error"]
        return self._event("error", code=error["code"], message=error["message"], param=error["param"])

    def _item(self, kind: str, events: list[ResponseStreamEvent]) -> _Item:
        """The open item if it is of `kind`, else a new one (the open one closed first)."""
        if self._open is not None and self._open.kind == kind:
            return self._open
        self._close(events)
        prefix = "rs" if kind == "reasoning" else "msg"
        item = _Item(kind, f"{prefix}_{uuid.uuid4().hex}")
        self._open_item(item, events)
        return item

    def _open_item(self, item: _Item, events: list[ResponseStreamEvent]) -> None:
        index = len(self._items)
        self._items.append(item)
        self._open = item
        events.append(
            self._event("response.output_item.added", output_index=index, item=item.shape("in_progress"))
        )
        if item.kind != "function_call":
            part = _output_text("") if item.kind == "message" else {"type": "reasoning_text", "text": ""}
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    part=part,
                )  # fmt: skip
            )

    def _close(self, events: list[ResponseStreamEvent]) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        index = self._items.index(item)
        text = "".join(item.pieces)
        where = {"item_id": item.id, "output_index": index}
        if item.kind == "function_call":
            events.append(
                self._event("response.function_call_arguments.done", **where, arguments=text, name=item.name)
            )
        else:
            if item.kind == "message":
                events.append(self._event("response.output_text.done", **where, content_index=0, text=text,
                                          logprobs=[]))  # fmt: skip
                part = _output_text(text)
            else:
                events.append(
                    self._event("response.reasoning_text.done", **where, content_index=0, text=text)
                )
                part = {"type": "reasoning_text", "text": text}
            events.append(self._event("response.content_part.done", **where, content_index=0, part=part))
        events.append(
            self._event("response.output_item.done", output_index=index, item=item.shape(self._item_status()))
        )

    def _delta(self, kind: str, item: _Item, text: str, **extra: Any) -> ResponseStreamEvent:
        item.pieces.append(text)
        return self._event(kind, item_id=item.id, output_index=self._items.index(item), content_index=0,
                           delta=text, **extra)  # fmt: skip

    def _event(self, kind: str, **fields: Any) -> ResponseStreamEvent:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event  # type: ignore[return-value]

    def _item_status(self) -> str:
        return "completed" if self._status in ("completed", "in_progress") else "incomplete"

    # -- the response object ---------------------------------------------------------------------------

    def body(self) -> ResponseObject:
        request = self._call.request
        item_status = self._item_status() if self._status != "in_progress" else "in_progress"
        text_options = request.text.model_dump(by_alias=True, exclude_none=True) if request.text else {}
        text_options.setdefault("format", {"type": "text"})
        choice = request.tool_choice
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self._created_at,
            "model": self._model,
            "status": self._status,
            "incomplete_details": {"reason": "max_output_tokens"} if self._status == "incomplete" else None,
            "error": None,
            "instructions": request.instructions,
            "output": [item.shape(item_status) for item in self._items]
            if self._status != "in_progress"
            else [],
            "usage": self._usage,
            "previous_response_id": request.previous_response_id,
            "store": self._stored,
            "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or ()],
            "tool_choice": (choice if isinstance(choice, str) else choice.model_dump()) if choice else "auto",
            "parallel_tool_calls": True
            if request.parallel_tool_calls is None
            else request.parallel_tool_calls,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "max_output_tokens": request.max_output_tokens,
            "text": text_options,
            "reasoning": request.reasoning.model_dump(exclude_none=True) if request.reasoning else None,
            "metadata": request.metadata or {},
        }
        if request.user is not None:
            body["user"] = request.user
        return body  # type: ignore[return-value]

    def stored(self) -> StoredResponse:
        """This finished response, as the store keeps it."""
        body = self.body()
        return StoredResponse.of(body, self._call.conversation, len(json.dumps(body)))


def stream_event(event: ResponseStreamEvent) -> bytes:
    """One server-sent event, named by its type as OpenAI names them."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()
