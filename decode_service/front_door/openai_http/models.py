"""The OpenAI bodies as types: requests as pydantic models (strict JSON types) whose validation errors
become `FieldError`s naming the parameter at fault, answers as the TypedDicts `responses` builds.
`GET /openapi.json` publishes both.

Request types are strict (no "2" for 2, no true for 1), numbers must be finite, and a field set to null
counts as absent, as the OpenAI API treats it. A field tandem does not implement is refused with a 400
that names it (`UnsupportedFieldError`), never ignored, except the fields in `NEUTRAL_VALUES` sent with
the value that means "feature off". What one field's value means for another (one output constraint per
request, `tool_choice` needs tools) is checked where the request is translated (`protocol`); ranges and
limits by the validation gRPC requests go through.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator
from pydantic_core import ErrorDetails
from typing_extensions import NotRequired, TypedDict

from decode_service.front_door.openai_http.errors import FieldError, UnsupportedFieldError

# The wire's integer fields are int32, so larger values cannot be meant.
INT32 = range(-(2**31), 2**31)
Int32 = Annotated[int, Field(ge=INT32.start, lt=INT32.stop)]
Seed = Annotated[int, Field(ge=-(2**63), lt=2**64)]

# Fields tandem accepts only with the value that means "feature off" (or its default).
NEUTRAL_VALUES: dict[str, tuple[object, ...]] = {
    "modalities": (["text"],),
    "store": (False,),
    "service_tier": ("auto", "default"),
    "echo": (False,),
    "suffix": ("",),
    "best_of": (1,),
    "use_beam_search": (False,),
    "length_penalty": (1,),
    "spaces_between_special_tokens": (True,),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "add_special_tokens": (False,),
    "documents": ([],),
    "guided_decoding_backend": ("xgrammar", "auto"),
}


class _Body(BaseModel):
    """A JSON object of a request: strict types, finite numbers, null as absent, no unknown field."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_absent(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Body):
    include_usage: bool = False
    # vLLM's: usage in every chunk (with include_usage).
    continuous_usage_stats: bool = False
    # OpenAI's; a no-op, tandem never pads chunks.
    include_obfuscation: bool = False


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # Accepted whatever its value: a required or named tool choice always follows the schema (a grammar
    # enforces it) and auto never can (the model writes the calls freely).
    strict: bool | None = None


class _Typed(_Body):
    """An object whose `type` tandem supports one value of; another value is refused before its fields."""

    SUPPORTED_TYPE: ClassVar[str] = "function"
    WHAT: ClassVar[str] = "tools"

    @model_validator(mode="before")
    @classmethod
    def _supported_type(cls, data: Any) -> Any:
        kind = data.get("type", cls.SUPPORTED_TYPE) if isinstance(data, dict) else cls.SUPPORTED_TYPE
        if kind != cls.SUPPORTED_TYPE:
            detail = f"is {kind!r}; only {cls.SUPPORTED_TYPE} {cls.WHAT} are supported"
            raise UnsupportedFieldError.of("type", detail)
        return data


class Tool(_Typed):
    type: Literal["function"]
    function: FunctionDefinition


class CalledFunction(_Body):
    name: str
    arguments: str


class ToolCall(_Typed):
    """An earlier call an assistant turn made, sent back in the conversation."""

    WHAT: ClassVar[str] = "calls"
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class TextPart(_Typed):
    SUPPORTED_TYPE: ClassVar[str] = "text"
    WHAT: ClassVar[str] = "parts"
    type: Literal["text"]
    text: str


def _json_kind(value: object) -> str | None:
    return "text" if isinstance(value, str) else "parts" if isinstance(value, list) else None


# A message's text: a string, or an array of text parts (joined by newlines).
Content = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[TextPart], Tag("parts")],
    Discriminator(_json_kind, custom_error_type="content", custom_error_message="content"),
]


class ChatMessage(_Body):
    role: str
    # Null only in an assistant turn that just called tools, as OpenAI sends it.
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # Sent back by clients that replay earlier answers whole; the chat templates tandem renders drop them.
    refusal: Any = None
    reasoning_content: Any = None
    reasoning: Any = None
    annotations: Any = None

    @model_validator(mode="after")
    def _content_unless_calls(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise FieldError("content", "content must be a string or an array of text parts, got None")
        return self


# A JSON schema, as an object (or true/false) or as JSON text.
Schema = dict[str, Any] | bool | str


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: Schema | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs`: exactly one of its fields."""

    json_: Schema | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Typed):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("mode")] | Annotated[NamedToolChoice, Tag("named")],
    Discriminator(
        lambda value: "mode" if isinstance(value, str) else "named" if isinstance(value, dict) else None,
        custom_error_type="tool_choice",
        custom_error_message="tool_choice",
    ),
]


class _Request(_Body):
    """The fields both endpoints share: sampling, stopping, output constraints, vLLM's extras."""

    model: str | None = None
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Int32 | None = None
    stop: str | list[str] | None = None
    # OpenAI seeds are signed; the wire's are uint64 (the mapping is one-to-one, so still reproducible).
    seed: Seed | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # JSON keys are strings: {"50256": -100} means token 50256.
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older way to constrain the output, which its users still send.
    guided_json: Schema | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's extras
    top_k: Int32 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int32 | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Int32] | None = None
    cache_salt: str | None = None
    priority: Int32 | None = None
    include_stop_str_in_output: bool = False
    request_id: str | None = None
    skip_special_tokens: bool | None = None
    # tandem's: this request is decoded without speculation.
    disable_speculation: bool = False
    # Accepted no-ops: metadata goes with `store` (false only); the rest are hints that change no answer.
    metadata: Any = None
    prediction: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None

    @model_validator(mode="before")
    @classmethod
    def _neutral_values_are_absent(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if k not in NEUTRAL_VALUES or v not in NEUTRAL_VALUES[k]}


class ChatCompletionRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# A completion prompt: text or token ids; a batch holding one prompt is that prompt.
Prompt = str | list[Int32] | list[str] | list[list[Int32]]


class CompletionRequest(_Request):
    prompt: Prompt
    # How many alternatives to report per token (None: no logprobs).
    logprobs: Int32 | None = None


# -- answers: what `responses` builds (plain dicts on the hot path, so TypedDicts, not models) --------


class _Shape(TypedDict):
    """An answer's object; no key beyond the declared ones (the published schema says so)."""

    __pydantic_config__ = ConfigDict(extra="forbid")


class PromptTokensDetails(_Shape):
    # Prompt tokens the prefix cache served, as OpenAI reports its own prompt caching.
    cached_tokens: int


class Usage(_Shape):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TokenLogprob(_Shape):
    token: str
    # -inf goes out as -9999.0 (vLLM's value), NaN as null.
    logprob: float | None
    bytes: list[int]


class ChatTokenLogprob(TokenLogprob):
    top_logprobs: list[TokenLogprob]


class ChatLogprobs(_Shape):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(_Shape):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float | None]]
    text_offset: list[int]


class CalledFunctionOut(_Shape):
    name: str
    arguments: str


class ToolCallOut(_Shape):
    id: str
    type: Literal["function"]
    function: CalledFunctionOut


class AssistantMessage(_Shape):
    role: Literal["assistant"]
    # Null when the answer is tool calls only.
    content: str | None
    reasoning_content: NotRequired[str]
    tool_calls: NotRequired[list[ToolCallOut]]


class _Choice(_Shape):
    index: int
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None
    # The stop string or token id that ended the choice (vLLM's), null otherwise.
    stop_reason: NotRequired[str | int | None]


class ChatChoice(_Choice):
    message: AssistantMessage
    logprobs: ChatLogprobs | None


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None


class _Answer(_Shape):
    id: str
    created: int
    model: str


class ChatCompletion(_Answer):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage


class Completion(_Answer):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage


class FunctionDelta(_Shape):
    name: NotRequired[str]
    arguments: str


class ToolCallDelta(_Shape):
    """A call's first delta has its id, type and name; later ones only more of its arguments."""

    index: int
    id: NotRequired[str]
    type: NotRequired[Literal["function"]]
    function: FunctionDelta


class ChatDelta(_Shape):
    role: NotRequired[Literal["assistant"]]
    content: NotRequired[str]
    reasoning_content: NotRequired[str]
    tool_calls: NotRequired[list[ToolCallDelta]]


class ChatChunkChoice(_Choice):
    delta: ChatDelta
    logprobs: ChatLogprobs | None


class _Chunk(_Answer):
    # With stream_options.include_usage: null, the choice's usage so far (continuous_usage_stats), or
    # in the last chunk, which has no choices, the request's.
    usage: NotRequired[Usage | None]


class ChatCompletionChunk(_Chunk):
    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]


class CompletionChunk(_Chunk):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]


# How each kind of error reads after "<param> "; `{value}` is the value sent.
_KINDS = {
    "int_type": "must be an integer, got {value!r}",
    "float_type": "must be a number, got {value!r}",
    "finite_number": "must be a finite number, got {value}",
    "bool_type": "must be a boolean, got {value!r}",
    "string_type": "must be a string, got {value!r}",
    "list_type": "must be an array, got {value!r}",
    "dict_type": "must be an object, got {value!r}",
    "model_type": "must be an object, got {value!r}",
    "missing": "is required",
    "too_short": "must not be empty, got {value!r}",
    "string_too_short": "must not be empty, got {value!r}",
    "content": "must be a string or an array of text parts, got {value!r}",
    "tool_choice": 'must be "none", "auto", "required" or {{"type": "function", "function": '
    '{{"name": ...}}}}, got {value!r}',
    "responses_input": "must be a non-empty string or a non-empty array of input items, got {value!r}",
    "responses_tool_choice": 'must be "none", "auto", "required" or {{"type": "function", "name": ...}}, '
    "got {value!r}",
}
# Fields whose every error, at the field or inside it, reads as one message about the whole field
# (`{value}`: the field's value, `{element}`: the part at fault).
_WHOLE = {
    "stop": "must be a string or a list of strings, got {value!r}",
    "stop_token_ids": "must be a list of integers, got {value!r}",
    "seed": "must be a 64-bit integer, got {value!r}",
    "prompt": "must be a non-empty string or array of token ids, got {value!r}",
    "logit_bias": "values must be a finite number, got {element:.40}",
    "guided_choice": "must be a non-empty array of strings, got {value!r}",
    "choice": "must be a non-empty array of strings, got {value!r}",
}
_RANGE_ERRORS = ("less_than", "less_than_equal", "greater_than", "greater_than_equal")


def _models(base: type[_Body]) -> list[type[_Body]]:
    return [base, *(model for sub in base.__subclasses__() for model in _models(sub))]


def _field_names() -> frozenset[str]:
    """Every key any request object declares, as the client spells it: what a validation error's path is
    made of. Read on the error path, so request models of other modules (other APIs) count as well."""
    return frozenset(
        field.alias or name for model in _models(_Body) for name, field in model.model_fields.items()
    )


def _at(param: str, child: str | int) -> str:
    if isinstance(child, int):
        return f"{param}[{child}]"
    return f"{param}.{child}" if param else child


def field_error(error: ErrorDetails, body: Mapping[str, Any]) -> FieldError:
    """One pydantic error as the `FieldError` a client reads: the parameter's path as the client wrote it
    (`messages[2].content`, `tools[0].function.name`) and a message starting with it."""
    param, value = "", body
    whole: str | None = None
    field_names = _field_names()
    for step in error["loc"]:
        if (
            isinstance(step, str)
            and step not in field_names
            and not (isinstance(value, dict) and step in value)
        ):
            continue  # a union's tag, not a key of the body
        param = _at(param, step)
        value = (
            value.get(step) if isinstance(value, dict) else value[step] if isinstance(value, list) else None
        )
        if step in _WHOLE:
            whole = step
            break
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        return cause.under(param)
    kind = error["type"]
    if kind == "extra_forbidden":
        return UnsupportedFieldError.of(param)
    if param == "messages":
        return FieldError(param, "messages must be a non-empty array of {role, content} objects")
    if whole is not None:
        return FieldError(param, f"{param} {_WHOLE[whole].format(value=value, element=str(error['input']))}")
    if kind in _RANGE_ERRORS:
        return FieldError(param, f"{param} is out of range, got {value!r}")
    if kind == "literal_error":
        return FieldError(param, f"{param} must be {error['ctx']['expected']}, got {value!r}")
    if kind == "float_type" and isinstance(value, int) and not isinstance(value, bool):
        return FieldError(param, f"{param} must be a finite number, got {str(value)[:40]}")
    return FieldError(param, f"{param} {_KINDS.get(kind, 'is not valid, got {value!r}').format(value=value)}")


def parse(body: object, model: type[_Request]) -> _Request:
    """`body` as `model`, or the `FieldError` of its first problem."""
    if not isinstance(body, dict):
        raise FieldError("body", "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise field_error(exc.errors()[0], body) from None
