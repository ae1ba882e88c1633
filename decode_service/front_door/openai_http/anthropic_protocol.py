"""Anthropic Messages bodies → the public `GenerateRequest`, so they share the chat route's validation,
chat template, tool grammars and parsers.

The conversation becomes chat turns: the system prompt a system turn, each `tool_result` block a tool
turn (before the text of its user turn), each assistant `tool_use` block a tool call of its turn;
earlier thinking is left out, as the chat templates do with reasoning. `tool_choice` maps onto the chat
route's modes: auto → auto (the server's `--tool-call-parser`), any → required, tool → the named
function, none → none. Errors raised past translation name a chat field (`messages[3].tool_calls[0]
.arguments`); `AnthropicRequest.param_for` names the block the client sent instead.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from decode_service.front_door.admission import RequestLimits
from decode_service.front_door.openai_http.anthropic_models import (
    AnthropicMessage,
    AnthropicTextBlock,
    CountTokensRequest,
    CreateMessageRequest,
    ToolResultBlock,
    ToolUseBlock,
    parse_anthropic,
)
from decode_service.front_door.openai_http.errors import FieldError
from protos.tandem.v1 import generation_pb2 as pb

_TOOL_CHOICE_MODES = {
    "auto": pb.TOOL_CHOICE_AUTO,
    "any": pb.TOOL_CHOICE_REQUIRED,
    "none": pb.TOOL_CHOICE_NONE,
}
# A chat field's path: the turn, then what follows it.
_MESSAGE_FIELD = re.compile(r"^(messages\[\d+\](?:\.tool_calls\[\d+\])?)(.*)$")
_TOOL_FIELD = re.compile(r"^tools\[(\d+)\]\.parameters_json")


@dataclass(frozen=True)
class AnthropicRequest:
    """What a handler needs: the translated request and how to shape the answer."""

    generate: pb.GenerateRequest
    model: str | None
    stream: bool = False
    # Each chat turn's (and tool call's) path in the body the client sent, e.g. "messages[2]" for
    # "messages[3]" after a system prompt, "messages[2].content[1]" for "messages[3].tool_calls[0]".
    origins: dict[str, str] = field(default_factory=dict)

    def param_for(self, chat_field: str) -> str:
        """The body's path for a chat field named by an error (see the module's docstring)."""
        if chat_field.startswith("tool_choice"):
            return "tool_choice"
        if chat_field == "chat_template_kwargs_json":
            return "thinking"
        tool = _TOOL_FIELD.match(chat_field)
        if tool is not None:
            return f"tools[{tool.group(1)}].input_schema"
        match = _MESSAGE_FIELD.match(chat_field)
        if match is None or match.group(1) not in self.origins:
            return chat_field
        rest = match.group(2)
        if ".tool_calls[" in match.group(1) and rest == ".arguments":
            rest = ".input"
        return self.origins[match.group(1)] + rest


def _text(content: str | list[AnthropicTextBlock]) -> str:
    return content if isinstance(content, str) else "\n".join(block.text for block in content)


class _Conversation:
    """Chat turns for a `GenerateRequest`, each remembered with the body path it came from."""

    def __init__(self, request: pb.GenerateRequest) -> None:
        self._request = request
        self.origins: dict[str, str] = {}

    def turn(self, origin: str, role: str, content: str) -> pb.ChatMessage:
        self.origins[f"messages[{len(self._request.messages)}]"] = origin
        return self._request.messages.add(role=role, content=content)

    def add(self, index: int, message: AnthropicMessage) -> None:
        where = f"messages[{index}]"
        if isinstance(message.content, str):
            self.turn(where, message.role, message.content)
            return
        texts: list[str] = []
        calls: list[tuple[int, ToolUseBlock]] = []
        for number, block in enumerate(message.content):
            at = f"{where}.content[{number}]"
            if isinstance(block, ToolResultBlock):
                if message.role != "user":
                    raise FieldError(at, f"{at} is a tool_result block; those belong in a user turn")
                turn = self.turn(at, "tool", _text(block.content))
                turn.tool_call_id = block.tool_use_id
            elif isinstance(block, ToolUseBlock):
                if message.role != "assistant":
                    raise FieldError(at, f"{at} is a tool_use block; those belong in an assistant turn")
                calls.append((number, block))
            elif isinstance(block, AnthropicTextBlock):
                texts.append(block.text)
        if not texts and not calls:
            return  # tool results only (or thinking only): no turn of its own
        turn_field = f"messages[{len(self._request.messages)}]"
        turn = self.turn(where, message.role, "\n".join(texts))
        for number, block in calls:
            self.origins[f"{turn_field}.tool_calls[{len(turn.tool_calls)}]"] = f"{where}.content[{number}]"
            turn.tool_calls.add(id=block.id, name=block.name, arguments=json.dumps(block.input))


def _check_turns(body: object, limits: RequestLimits) -> None:
    """Refuse more turns than `limits` allow before any is parsed."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if isinstance(messages, list) and len(messages) > limits.max_chat_messages:
        raise FieldError(
            "messages",
            f"messages has {len(messages)} turns, above this server's limit of {limits.max_chat_messages} "
            "(--max-chat-messages)",
        )


def _prompt(parsed: CountTokensRequest, request: pb.GenerateRequest) -> dict[str, str]:
    """The chat turns, tools, tool choice and thinking switch of `parsed` into `request`; the origins."""
    conversation = _Conversation(request)
    if parsed.system is not None and _text(parsed.system):
        conversation.turn("system", "system", _text(parsed.system))
    for index, message in enumerate(parsed.messages):
        conversation.add(index, message)
    if not request.messages:
        raise FieldError("messages", "messages hold no text, tool_use or tool_result block")
    for tool in parsed.tools or ():
        request.tools.add(
            name=tool.name, description=tool.description or "", parameters_json=json.dumps(tool.input_schema)
        )
    choice = parsed.tool_choice
    if choice is not None and not request.tools and choice.type != "none":
        raise FieldError("tool_choice", f"tool_choice {choice.type!r} needs tools")
    if choice is not None and request.tools:
        if choice.type == "tool":
            request.tool_choice.function_name = choice.name
        else:
            request.tool_choice.mode = _TOOL_CHOICE_MODES[choice.type]
        if choice.disable_parallel_tool_use is not None:
            request.parallel_tool_calls = not choice.disable_parallel_tool_use
    if parsed.thinking is not None:
        request.chat_template_kwargs_json = json.dumps(
            {"enable_thinking": parsed.thinking.type != "disabled"}
        )
    return conversation.origins


def translate_message(body: object, limits: RequestLimits) -> AnthropicRequest:
    """Check a `POST /v1/messages` body's shape and build the `GenerateRequest` it stands for."""
    _check_turns(body, limits)
    parsed = parse_anthropic(body, CreateMessageRequest)
    request = pb.GenerateRequest()
    origins = _prompt(parsed, request)
    for name in ("temperature", "top_p", "top_k"):
        if getattr(parsed, name) is not None:
            setattr(request.sampling, name, getattr(parsed, name))
    request.stopping.max_tokens = parsed.max_tokens
    request.stopping.stop.extend(parsed.stop_sequences or ())
    if parsed.metadata is not None and parsed.metadata.user_id:
        request.tenant = parsed.metadata.user_id
    return AnthropicRequest(generate=request, model=parsed.model, stream=parsed.stream, origins=origins)


def translate_count(body: object, limits: RequestLimits) -> AnthropicRequest:
    """Check a `POST /v1/messages/count_tokens` body and build the request whose prompt it counts."""
    _check_turns(body, limits)
    parsed = parse_anthropic(body, CountTokensRequest)
    request = pb.GenerateRequest()
    origins = _prompt(parsed, request)
    return AnthropicRequest(generate=request, model=parsed.model, origins=origins)
