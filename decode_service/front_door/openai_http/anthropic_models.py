"""Anthropic's Messages API bodies as types: requests as pydantic models (strict JSON types, unknown fields
refused, errors naming the parameter as `models` does for OpenAI's), answers and stream events as the
TypedDicts `anthropic_responses` builds. `GET /openapi.json` publishes both.

Content blocks tandem has no use for in a text model (images, documents, server tools) are refused
with a 400 naming the block's `type`; `cache_control` and `citations` are hints that change no answer,
so they are accepted and ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import Discriminator, Field, Tag, ValidationError, model_validator
from typing_extensions import NotRequired

from decode_service.front_door.openai_http.errors import FieldError, UnsupportedFieldError
from decode_service.front_door.openai_http.models import Int32, _Body, _Shape, _Typed, field_error

# The block types a conversation may hold, and where.
BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


class AnthropicTextBlock(_Body):
    type: Literal["text"]
    text: str
    cache_control: Any = None
    citations: Any = None


class ToolUseBlock(_Body):
    """A call an assistant turn made, sent back in the conversation."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: Any = None


def _text_or_blocks(value: object) -> str | None:
    return "string" if isinstance(value, str) else "blocks" if isinstance(value, list) else None


# A string, or text blocks (joined by newlines).
Text = Annotated[
    Annotated[str, Tag("string")] | Annotated[list[AnthropicTextBlock], Tag("blocks")],
    Discriminator(_text_or_blocks, custom_error_type="text_content", custom_error_message="text"),
]


class ToolResultBlock(_Body):
    """What a tool the assistant called returned, in the user turn after the call."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: Text = ""
    is_error: bool = False
    cache_control: Any = None


class ThinkingBlock(_Body):
    """Reasoning an earlier answer carried; the chat templates tandem renders leave it out."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Body):
    type: Literal["redacted_thinking"]
    data: str


def _block_tag(value: object) -> str | None:
    """The union's tag for a block (not the bare type: "text" is also a field name in error paths)."""
    kind = value.get("type") if isinstance(value, dict) else None
    return f"{kind}_block" if kind in BLOCK_TYPES else None


ContentBlock = Annotated[
    Annotated[AnthropicTextBlock, Tag("text_block")]
    | Annotated[ToolUseBlock, Tag("tool_use_block")]
    | Annotated[ToolResultBlock, Tag("tool_result_block")]
    | Annotated[ThinkingBlock, Tag("thinking_block")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking_block")],
    Discriminator(_block_tag, custom_error_type="content_block", custom_error_message="content block"),
]
Content = Annotated[
    Annotated[str, Tag("string")] | Annotated[list[ContentBlock], Tag("blocks")],
    Discriminator(_text_or_blocks, custom_error_type="message_content", custom_error_message="content"),
]


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: Content

    @model_validator(mode="before")
    @classmethod
    def _supported_blocks(cls, data: Any) -> Any:
        """A block of a type tandem does not take (image, document, server tool results) is refused by
        name, before its fields are checked against a type it is not."""
        content = data.get("content") if isinstance(data, dict) else None
        for index, block in enumerate(content if isinstance(content, list) else ()):
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in BLOCK_TYPES:
                detail = f"is {kind!r}; only {', '.join(BLOCK_TYPES)} blocks are supported"
                raise UnsupportedFieldError.of(f"content[{index}].type", detail)
        return data


class AnthropicTool(_Typed):
    """A client tool: a name, what it does and the JSON schema of its input."""

    SUPPORTED_TYPE: ClassVar[str] = "custom"
    type: Literal["custom"] = "custom"
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: Any = None


class AnthropicToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_for_a_named_tool(self) -> AnthropicToolChoice:
        if self.type == "tool" and self.name is None:
            raise FieldError("name", "name is required when type is 'tool'")
        if self.type != "tool" and self.name is not None:
            raise FieldError("name", f"name is only allowed when type is 'tool', not {self.type!r}")
        return self


class ThinkingConfig(_Body):
    """Whether the model thinks first: passed to the chat template as `enable_thinking` (Qwen3's switch;
    templates without one ignore it). The budget is not enforced: max_tokens bounds the whole answer.
    The reasoning is always shown (`display` "summarized"): it is the model's own, never redacted."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: Annotated[int, Field(ge=1, lt=2**31)] | None = None
    display: Literal["summarized"] | None = None

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> ThinkingConfig:
        if self.type == "enabled" and self.budget_tokens is None:
            raise FieldError("budget_tokens", "budget_tokens is required when type is 'enabled'")
        return self


class AnthropicMetadata(_Body):
    # The end user: the request's tenant, as OpenAI's `user` is.
    user_id: str | None = None


class CountTokensRequest(_Body):
    """What shapes the prompt: the conversation, the system prompt and the tools the template shows."""

    # Optional, as on the OpenAI routes (Anthropic's API requires it): the served model when absent.
    model: str | None = None
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: Text | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None


class CreateMessageRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1, lt=2**31)]
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    metadata: AnthropicMetadata | None = None
    # Which capacity pool serves the request at Anthropic; one pool here, so a no-op.
    service_tier: Literal["auto", "standard_only"] | None = None


# How this module's own kinds of error read after "<param> ".
_KINDS = {
    "text_content": "must be a string or an array of text blocks, got {value!r:.80}",
    "message_content": "must be a string or an array of content blocks, got {value!r:.80}",
    "content_block": "must be a content block object with a type, got {value!r:.80}",
}


B = TypeVar("B", bound=_Body)


def parse_anthropic(body: object, model: type[B]) -> B:
    """`body` as `model`, or the `FieldError` of its first problem."""
    if not isinstance(body, dict):
        raise FieldError("body", "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        found = field_error(error, body)
        if error["type"] in _KINDS:
            detail = _KINDS[error["type"]].format(value=error["input"])
            raise FieldError(found.param, f"{found.param} {detail}") from None
        raise found from None


# -- answers: what `anthropic_responses` builds --------------------------------------------------------


class MessageUsage(_Shape):
    # Prompt tokens the prefix cache did not serve (Anthropic's meaning: cache reads are counted apart).
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int


class TextOut(_Shape):
    type: Literal["text"]
    text: str


class ThinkingOut(_Shape):
    type: Literal["thinking"]
    thinking: str
    # Anthropic signs its reasoning; tandem's is never sent back for checking, so this stays empty.
    signature: str


class ToolUseOut(_Shape):
    type: Literal["tool_use"]
    id: str
    name: str
    # The arguments the model wrote, parsed (an object whenever a grammar held the call).
    input: Any


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageOut(_Shape):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[TextOut | ThinkingOut | ToolUseOut]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage


class TokenCount(_Shape):
    input_tokens: int


class AnthropicTextDelta(_Shape):
    type: Literal["text_delta"]
    text: str


class ThinkingDelta(_Shape):
    type: Literal["thinking_delta"]
    thinking: str


class InputJsonDelta(_Shape):
    type: Literal["input_json_delta"]
    partial_json: str


class StopDelta(_Shape):
    stop_reason: StopReason
    stop_sequence: str | None


class AnthropicErrorDetail(_Shape):
    type: str
    message: str


class MessageStreamEvent(_Shape):
    """Any of the stream's events (each server-sent event's data; its `event:` line repeats `type`)."""

    type: str
    index: NotRequired[int]
    message: NotRequired[MessageOut]
    content_block: NotRequired[TextOut | ThinkingOut | ToolUseOut]
    delta: NotRequired[AnthropicTextDelta | ThinkingDelta | InputJsonDelta | StopDelta]
    usage: NotRequired[MessageUsage]
    error: NotRequired[AnthropicErrorDetail]
