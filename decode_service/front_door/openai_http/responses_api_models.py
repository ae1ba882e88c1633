"""OpenAI's Responses API bodies as types: the request of `POST /v1/responses` as pydantic models (the same
strict rules as `models`: JSON types, null as absent, an unknown field refused with a 400 naming it), and
the response object and stream events `responses_api` builds, as TypedDicts `GET /openapi.json` publishes.

Only what tandem can serve is accepted: text and function calls. An input item, content part or tool of
another type (images, files, web search) is refused with a 400 naming its `type`, never ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Discriminator, Field, Tag, model_validator
from typing_extensions import NotRequired, TypedDict

from decode_service.front_door.openai_http.errors import UnsupportedFieldError
from decode_service.front_door.openai_http.models import (
    NEUTRAL_VALUES,
    Int32,
    Schema,
    Seed,
    _Body,
    _Shape,
    parse,
)

# Accepted only with the value that means "feature off" (as `NEUTRAL_VALUES` of the chat route).
RESPONSES_NEUTRAL_VALUES: dict[str, tuple[object, ...]] = {
    "truncation": ("disabled",),
    "background": (False,),
    "include": ([],),
    "service_tier": NEUTRAL_VALUES["service_tier"],
}


class _OneOfTypes(_Body):
    """An object whose `type` must be one of `TYPES` (`DEFAULT_TYPE` when absent); another is refused
    before its fields are read, naming the type."""

    TYPES: ClassVar[tuple[str, ...]] = ()
    DEFAULT_TYPE: ClassVar[str | None] = None

    @model_validator(mode="before")
    @classmethod
    def _known_type(cls, data: Any) -> Any:
        if isinstance(data, dict):
            kind = data.get("type", cls.DEFAULT_TYPE)
            if kind not in cls.TYPES:
                supported = ", ".join(cls.TYPES)
                raise UnsupportedFieldError.of("type", f"is {kind!r}; this server supports {supported}")
        return data


class TextContent(_OneOfTypes):
    """A message's text part: input_text (the client's) or output_text (an earlier answer sent back)."""

    TYPES: ClassVar[tuple[str, ...]] = ("input_text", "output_text")
    type: Literal["input_text", "output_text"]
    text: str
    # Sent back with earlier answers; the chat template does not render them.
    annotations: Any = None
    logprobs: Any = None


def _string_or_list(value: object) -> str | None:
    """A string-or-array field's tag (tags are named apart from every field, so no error path holds one
    as if it were a key)."""
    return "as_string" if isinstance(value, str) else "as_list" if isinstance(value, list) else None


MessageContent = Annotated[
    Annotated[str, Tag("as_string")] | Annotated[list[TextContent], Tag("as_list")],
    Discriminator(_string_or_list, custom_error_type="content", custom_error_message="content"),
]

# The input item types tandem serves.
_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class MessageItem(_OneOfTypes):
    """A conversation turn; `developer` is the system turn of newer models."""

    # An item of an unknown type is validated here (see `_item_kind`), so its error lists every item type.
    TYPES: ClassVar[tuple[str, ...]] = _ITEM_TYPES
    DEFAULT_TYPE: ClassVar[str | None] = "message"
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: MessageContent
    # An earlier answer's id and status, as the SDKs send output items back.
    id: str | None = None
    status: str | None = None
    phase: Any = None


class FunctionCallItem(_OneOfTypes):
    """A call the model made earlier, sent back so the conversation shows it before its output."""

    TYPES: ClassVar[tuple[str, ...]] = ("function_call",)
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_OneOfTypes):
    """What the client's function returned for `call_id`: a tool turn of the conversation."""

    TYPES: ClassVar[tuple[str, ...]] = ("function_call_output",)
    type: Literal["function_call_output"]
    call_id: str
    output: MessageContent
    id: str | None = None
    status: str | None = None


class ReasoningItem(_OneOfTypes):
    """An earlier answer's reasoning, sent back whole; chat templates drop it, as the chat route drops
    `reasoning_content`."""

    TYPES: ClassVar[tuple[str, ...]] = ("reasoning",)
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: Any = None
    status: str | None = None


def _item_kind(value: object) -> str:
    """The input item's tag: its type (message when it has none); an unknown one is refused by the
    message model, which names the type."""
    kind = value.get("type", "message") if isinstance(value, dict) else "message"
    return f"item_{kind if kind in _ITEM_TYPES else 'message'}"


InputItem = Annotated[
    Annotated[MessageItem, Tag("item_message")]
    | Annotated[FunctionCallItem, Tag("item_function_call")]
    | Annotated[FunctionCallOutputItem, Tag("item_function_call_output")]
    | Annotated[ReasoningItem, Tag("item_reasoning")],
    Discriminator(_item_kind),
]

Input = Annotated[
    Annotated[Annotated[str, Field(min_length=1)], Tag("as_string")]
    | Annotated[Annotated[list[InputItem], Field(min_length=1)], Tag("as_list")],
    Discriminator(_string_or_list, custom_error_type="responses_input", custom_error_message="input"),
]


class FunctionTool(_OneOfTypes):
    TYPES: ClassVar[tuple[str, ...]] = ("function",)
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # Accepted whatever its value, as on the chat route: required and named choices always follow the
    # schema (a grammar holds them to it).
    strict: bool | None = None


class FunctionToolChoice(_OneOfTypes):
    TYPES: ClassVar[tuple[str, ...]] = ("function",)
    type: Literal["function"]
    name: str


ResponsesToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("mode")] | Annotated[FunctionToolChoice, Tag("named")],
    Discriminator(
        lambda value: "mode" if isinstance(value, str) else "named" if isinstance(value, dict) else None,
        custom_error_type="responses_tool_choice",
        custom_error_message="tool_choice",
    ),
]


class TextFormat(_OneOfTypes):
    """`text.format`: plain text, any JSON object, or JSON that follows `schema` (held to it by a grammar)."""

    TYPES: ClassVar[tuple[str, ...]] = ("text", "json_object", "json_schema")
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: Schema | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(_Body):
    format: TextFormat | None = None
    # A hint to models trained for it; it changes nothing here.
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningOptions(_Body):
    """Accepted as hints: with `--reasoning-parser` the model's reasoning is always split off and returned
    as a reasoning item; the effort a model spends is its chat template's business."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Body):
    """The body of `POST /v1/responses`."""

    model: str | None = None
    input: Input
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: Annotated[int, Field(ge=1, lt=2**31)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    # vLLM's and tandem's extras, as on the chat route.
    seed: Seed | None = None
    top_k: Int32 | None = None
    priority: Int32 | None = None
    request_id: str | None = None
    # Hints that change no answer.
    prompt_cache_key: Any = None
    safety_identifier: Any = None

    @model_validator(mode="before")
    @classmethod
    def _neutral_values_are_absent(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {
            k: v
            for k, v in data.items()
            if k not in RESPONSES_NEUTRAL_VALUES or v not in RESPONSES_NEUTRAL_VALUES[k]
        }


def parse_responses_request(body: object) -> ResponsesRequest:
    """`body` as a `ResponsesRequest`, or the `FieldError` of its first problem."""
    return parse(body, ResponsesRequest)  # type: ignore[arg-type]


# -- answers: what `responses_api` builds ----------------------------------------------------------------


class OutputText(_Shape):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class ReasoningText(_Shape):
    type: Literal["reasoning_text"]
    text: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(_Shape):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: ItemStatus
    content: list[OutputText]


class OutputFunctionCall(_Shape):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class OutputReasoning(_Shape):
    id: str
    type: Literal["reasoning"]
    summary: list[Any]
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class InputTokensDetails(_Shape):
    cached_tokens: int


class OutputTokensDetails(_Shape):
    reasoning_tokens: int


class ResponseUsage(_Shape):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(_Shape):
    reason: Literal["max_output_tokens"]


class ResponseObject(_Shape):
    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete", "cancelled"]
    incomplete_details: IncompleteDetails | None
    error: None
    instructions: str | None
    output: list[OutputItem]
    usage: ResponseUsage | None
    previous_response_id: str | None
    store: bool
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    temperature: float | None
    top_p: float | None
    max_output_tokens: int | None
    text: dict[str, Any]
    reasoning: dict[str, Any] | None
    metadata: dict[str, str]
    user: NotRequired[str]


class ResponseStreamEvent(TypedDict):
    """One server-sent event's data: its `type` (also the SSE `event:` name) says which other fields it
    has (`response`, `item`, `part`, `delta`, `text`, `arguments`, with `output_index`, `content_index`
    and `item_id` where they apply; `code`, `message` and `param` for `error`)."""

    type: str
    sequence_number: int
    response: NotRequired[ResponseObject]
    output_index: NotRequired[int]
    content_index: NotRequired[int]
    item_id: NotRequired[str]
    item: NotRequired[OutputItem]
    part: NotRequired[OutputText | ReasoningText]
    delta: NotRequired[str]
    text: NotRequired[str]
    arguments: NotRequired[str]
    name: NotRequired[str]
    logprobs: NotRequired[list[Any]]
    # The `error` event's: what broke the stream, as an error body says it.
    code: NotRequired[str]
    message: NotRequired[str]
    param: NotRequired[str | None]


class DeletedResponse(_Shape):
    id: str
    object: Literal["response"]
    deleted: bool
