"""OpenAI request bodies → the public `GenerateRequest`, so HTTP and gRPC share one validation path.

The bodies are parsed as the typed models of `models` (JSON types, fields tandem implements); this
module checks what one field means for another (one output constraint per request, `tool_choice` needs
tools) and, before parsing, that chat turns and logit-bias entries stay within `RequestLimits`. Every
other range and limit is checked later, by the same code that checks gRPC requests, and those errors
name the gRPC field (`structured_output.json_schema`, `tools[1].parameters_json`);
`OpenAIRequest.param_for` names the HTTP parameter the client used instead.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass

from decode_service.front_door import json_text
from decode_service.front_door.admission import RequestLimits
from decode_service.front_door.openai_http.errors import FieldError, UnsupportedFieldError
from decode_service.front_door.openai_http.models import (
    INT32,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    Schema,
    parse,
)
from engine.sampler import SEED_MASK
from protos.tandem.v1 import generation_pb2 as pb

# OpenAI's completions API defaults max_tokens to 16 (vLLM follows it); chat runs to the context's end.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_TOOL_CHOICE_MODES = {
    "none": pb.TOOL_CHOICE_NONE,
    "auto": pb.TOOL_CHOICE_AUTO,
    "required": pb.TOOL_CHOICE_REQUIRED,
}
# vLLM's older output constraints and what each is in `structured_outputs`.
_GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


class Endpoint(enum.Enum):
    CHAT = "chat.completion"
    COMPLETION = "text_completion"


@dataclass(frozen=True)
class OpenAIRequest:
    """What a handler needs: the translated request and how to shape the answer."""

    endpoint: Endpoint
    generate: pb.GenerateRequest
    model: str | None
    stream: bool
    include_usage: bool
    # None: no logprobs in the answer; else how many alternatives per token to report.
    top_logprobs: int | None
    # Usage in every stream chunk (vLLM's stream_options.continuous_usage_stats, with include_usage).
    continuous_usage: bool = False
    # The matched stop string stays at the end of the text (vLLM's include_stop_str_in_output).
    include_stop: bool = False
    # The HTTP parameter that set `generate.structured_output` (e.g. "guided_json"), for error messages.
    constraint_param: str | None = None

    def param_for(self, field: str) -> str:
        """The HTTP parameter a gRPC field path stands for in this request (e.g. tools[1].parameters_json
        → tools[1].function.parameters), so a 400 names what the client actually sent."""
        if field.startswith("structured_output") and self.constraint_param is not None:
            return self.constraint_param
        if field.startswith("tool_choice"):
            return "tool_choice"
        if field == "chat_template_kwargs_json":
            return "chat_template_kwargs"
        return _FUNCTION_FIELD.sub(_function_param, field)


# tools[i].name / .description / .parameters_json and messages[i].tool_calls[j].name / .arguments sit
# under "function" in OpenAI's shapes.
_FUNCTION_FIELD = re.compile(
    r"^((?:tools|messages\[\d+\]\.tool_calls)\[\d+\])\.(name|description|parameters_json|arguments)"
)


def _function_param(match: re.Match[str]) -> str:
    name = "parameters" if match.group(2) == "parameters_json" else match.group(2)
    return f"{match.group(1)}.function.{name}"


DEFAULT_LIMITS = RequestLimits()


def _check_counts(body: object, limits: RequestLimits) -> None:
    """Refuse more chat turns or logit-bias entries than `limits` allow, before any is parsed."""
    if not isinstance(body, dict):
        return
    messages, bias = body.get("messages"), body.get("logit_bias")
    if isinstance(messages, list) and len(messages) > limits.max_chat_messages:
        raise FieldError(
            "messages",
            f"messages has {len(messages)} turns, above this server's limit of {limits.max_chat_messages} "
            "(--max-chat-messages)",
        )
    if isinstance(bias, dict) and len(bias) > limits.max_logit_bias:
        raise FieldError(
            "logit_bias",
            f"logit_bias has {len(bias)} entries, above this server's limit of {limits.max_logit_bias} "
            "(--max-logit-bias)",
        )


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    converted = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            token_id = None
        if token_id is None or token_id not in INT32:
            raise FieldError("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
        converted[token_id] = value
    return converted


def _message(message: ChatMessage) -> pb.ChatMessage:
    content = message.content
    text = "\n".join(part.text for part in content) if isinstance(content, list) else content or ""
    converted = pb.ChatMessage(role=message.role, content=text)
    for call in message.tool_calls or ():
        converted.tool_calls.add(id=call.id, name=call.function.name, arguments=call.function.arguments)
    if message.tool_call_id is not None:
        converted.tool_call_id = message.tool_call_id
    if message.name is not None:
        converted.name = message.name
    return converted


def _prompt(prompt: str | list, request: pb.GenerateRequest) -> None:
    """A string or token ids; a batch of several prompts is refused (send one request per prompt)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        request.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        request.token_ids.extend(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise UnsupportedFieldError.of("prompt", "holds several prompts; send one request per prompt")
    else:
        raise FieldError("prompt", f"prompt must be a non-empty string or array of token ids, got {prompt!r}")


def _schema_text(schema: Schema, param: str) -> str:
    """A JSON schema given as an object or as JSON text, as JSON text."""
    if isinstance(schema, str):
        try:
            schema = json_text.loads(schema)
        except json_text.JsonTextError as exc:
            raise FieldError(param, f"{param} {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise FieldError(param, f"{param} must be a JSON schema (an object), got {schema!r}")
    return json.dumps(schema)


def _constraint(kind: str, value: object, param: str) -> pb.StructuredOutput:
    """One structured-output kind (json, regex, choice, grammar, json_object) as a StructuredOutput."""
    if kind == "json":
        return pb.StructuredOutput(json_schema=_schema_text(value, param))
    if kind == "json_object":
        if value is not True:
            raise FieldError(param, f"{param} must be true, got {value!r}")
        return pb.StructuredOutput(json_object=True)
    if not value:
        raise FieldError(param, f"{param} must not be empty")
    if kind == "choice":
        return pb.StructuredOutput(choice=pb.ChoiceList(choices=value))
    return pb.StructuredOutput(**{kind: value})


def _structured_output(
    request: CompletionRequest | ChatCompletionRequest,
) -> tuple[pb.StructuredOutput | None, str | None]:
    """The one output constraint the request asks for, and the parameter that asked; a 400 when several.
    It may come as response_format, vLLM's structured_outputs or its older guided_* fields."""
    given: dict[str, tuple[str, object]] = {}
    response_format = request.response_format
    if response_format is not None and response_format.type != "text":
        given["response_format"] = (response_format.type, response_format.json_schema)
    for name, kind in _GUIDED_FIELDS.items():
        if getattr(request, name) is not None:
            given[name] = (kind, getattr(request, name))
    if request.structured_outputs is not None:
        options = request.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        given.update({f"structured_outputs.{kind}": (kind, value) for kind, value in options.items()})
    if len(given) > 1:
        # The second constraint named is the one at fault; the message begins with it, as every
        # FieldError begins with its parameter.
        first, second, *rest = given
        names = " and ".join([second, first, *rest])
        raise FieldError(second, f"{names} are all set; a request may use one output constraint")
    if not given:
        return None, None
    ((param, (kind, value)),) = given.items()
    if param != "response_format":
        return _constraint(kind, value, param), param
    if kind == "json_object":
        return pb.StructuredOutput(json_object=True), param
    if value is None:
        raise FieldError(
            "response_format.json_schema", "response_format.json_schema must be an object, got None"
        )
    param = "response_format.json_schema.schema"
    if value.schema_ is None:
        raise FieldError(param, f"{param} is required")
    return pb.StructuredOutput(json_schema=_schema_text(value.schema_, param)), param


def _chat_tools(
    chat: ChatCompletionRequest, request: pb.GenerateRequest, constraint_param: str | None
) -> None:
    """tools, tool_choice and parallel_tool_calls; a required or named choice is a grammar of its own, so
    it cannot be combined with an output constraint."""
    for tool in chat.tools or ():
        function = tool.function
        converted = request.tools.add(name=function.name, description=function.description or "")
        if function.parameters is not None:
            converted.parameters_json = json.dumps(function.parameters)
    choice = chat.tool_choice
    if choice is not None and not request.tools and choice != "none":
        raise FieldError(
            "tool_choice",
            f"tool_choice {choice if isinstance(choice, str) else choice.model_dump()!r} needs tools",
        )
    if choice is not None and request.tools:
        if isinstance(choice, str):
            request.tool_choice.mode = _TOOL_CHOICE_MODES[choice]
        else:
            request.tool_choice.function_name = choice.function.name
        if choice not in ("none", "auto") and constraint_param is not None:
            raise FieldError(
                "tool_choice",
                f"tool_choice and {constraint_param} are both set; a request may use one output constraint",
            )
    if chat.parallel_tool_calls is not None:
        request.parallel_tool_calls = chat.parallel_tool_calls


def _top_logprobs(request: CompletionRequest | ChatCompletionRequest) -> int | None:
    """How many alternatives to report per token; None when logprobs were not asked for."""
    if isinstance(request, CompletionRequest):
        return request.logprobs
    if not request.logprobs:
        if request.top_logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs set to true")
        return None
    return request.top_logprobs or 0


def translate(body: object, endpoint: Endpoint, limits: RequestLimits = DEFAULT_LIMITS) -> OpenAIRequest:
    """Check an OpenAI request body's shape and build the `GenerateRequest` it stands for; `logit_bias`
    entries and chat turns past `limits` are refused before any is parsed."""
    _check_counts(body, limits)
    parsed = parse(body, ChatCompletionRequest if endpoint is Endpoint.CHAT else CompletionRequest)
    request = pb.GenerateRequest()
    if isinstance(parsed, ChatCompletionRequest):
        request.messages.extend(_message(message) for message in parsed.messages)
    else:
        _prompt(parsed.prompt, request)
    sampling = request.sampling
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "top_k",
    ):
        if getattr(parsed, name) is not None:
            setattr(sampling, name, getattr(parsed, name))
    sampling.disable_speculation = parsed.disable_speculation
    if parsed.seed is not None:
        sampling.seed = parsed.seed & SEED_MASK
    sampling.logit_bias.update(_logit_bias(parsed.logit_bias or {}))
    top_logprobs = _top_logprobs(parsed)
    if top_logprobs is not None:
        # The engine returns the chosen token's logprob only alongside >= 1 alternative; extra ones are cut.
        sampling.logprobs = max(top_logprobs, 1) if top_logprobs >= 0 else top_logprobs
    max_tokens = parsed.max_completion_tokens if isinstance(parsed, ChatCompletionRequest) else None
    if max_tokens is None:
        max_tokens = parsed.max_tokens
    if max_tokens is None and endpoint is Endpoint.COMPLETION:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    if max_tokens is not None:
        request.stopping.max_tokens = max_tokens
    stop = parsed.stop
    request.stopping.stop.extend([stop] if isinstance(stop, str) else stop or [])
    request.stopping.stop_token_ids.extend(parsed.stop_token_ids or [])
    request.stopping.ignore_eos = parsed.ignore_eos
    request.stopping.min_tokens = parsed.min_tokens or 0
    if parsed.n == 0:
        # The wire's n = 0 means "unset" (one choice); an explicit 0 here is a mistake to report, not 1.
        raise FieldError("n", "n must be >= 1, got 0")
    request.n = 1 if parsed.n is None else parsed.n
    request.priority = parsed.priority or 0
    request.tenant = parsed.user or ""
    if parsed.cache_salt:
        request.cache_salt = parsed.cache_salt
    constraint, constraint_param = _structured_output(parsed)
    if constraint is not None:
        request.structured_output.CopyFrom(constraint)
    if isinstance(parsed, ChatCompletionRequest):
        _chat_tools(parsed, request, constraint_param)
        if parsed.chat_template_kwargs:
            request.chat_template_kwargs_json = json.dumps(parsed.chat_template_kwargs)
    if parsed.request_id:
        request.request_id = parsed.request_id
    if parsed.skip_special_tokens is not None:
        request.skip_special_tokens = parsed.skip_special_tokens
    options = parsed.stream_options
    if options is not None and not parsed.stream:
        raise FieldError("stream_options", "stream_options is only allowed when stream is true")
    include_usage = options is not None and options.include_usage
    return OpenAIRequest(
        endpoint=endpoint,
        generate=request,
        model=parsed.model,
        stream=parsed.stream,
        include_usage=include_usage,
        top_logprobs=top_logprobs,
        # As in vLLM, usage in every chunk needs include_usage.
        continuous_usage=include_usage and options.continuous_usage_stats,
        include_stop=parsed.include_stop_str_in_output,
        constraint_param=constraint_param,
    )
