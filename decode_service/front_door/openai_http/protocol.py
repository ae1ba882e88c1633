"""OpenAI request bodies → the public `GenerateRequest`, so HTTP and gRPC share one validation path.

This module only checks what JSON can get wrong and protobuf cannot hold (a string where a number
belongs, a field tandem does not implement) and, before converting any, that chat turns and logit-bias
entries stay within `RequestLimits`; every other range and limit is checked later, by the same code that
checks gRPC requests. Fields set to null count as absent, as the OpenAI API treats them. A field
whose meaning tandem would change is refused with a 400 that names it, never ignored; fields that only
shape the answer, or that vLLM accepts as no-ops, are accepted (the README lists every field).

Output constraints and tools are read by `agent_fields`, JSON types by `fields`. Validation errors
raised later name the gRPC field (`structured_output.json_schema`,
`tools[1].parameters_json`); `OpenAIRequest.param_for` names the HTTP parameter the client used instead.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from decode_service.front_door.admission import RequestLimits
from decode_service.front_door.openai_http.agent_fields import (
    CONSTRAINT_FIELDS,
    chat_tools,
    structured_output,
    tool_calls,
)
from decode_service.front_door.openai_http.fields import (
    INT32,
    FieldError,
    UnsupportedFieldError,
    boolean,
    finite_number,
    integer,
    is_int,
    json_object,
    number,
    string,
)
from engine.sampler import SEED_MASK
from protos.tandem.v1 import generation_pb2 as pb

# OpenAI's completions API defaults max_tokens to 16 (vLLM follows it); chat runs to the context's end.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


_COMMON_FIELDS = frozenset(
    {
        "model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "presence_penalty",
        "frequency_penalty", "logit_bias", "logprobs", "user", "stream", "stream_options",
        *CONSTRAINT_FIELDS,
        # vLLM's extras
        "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "cache_salt",
        "priority", "include_stop_str_in_output", "request_id", "skip_special_tokens",
        # tandem's
        "disable_speculation",
        # accepted no-ops: metadata goes with `store` (false only); the rest are hints that change no answer
        "metadata", "prediction", "prompt_cache_key", "safety_identifier",
    }
)  # fmt: skip
_CHAT_FIELDS = _COMMON_FIELDS | {
    "chat_template_kwargs",
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
}  # fmt: skip
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt"}

# Fields tandem accepts only with the value that means "feature off" (or its default).
_NEUTRAL_VALUES: dict[str, tuple[object, ...]] = {
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
_MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})
# Sent back by clients that replay earlier answers whole; the chat templates tandem renders drop them.
_DROPPED_MESSAGE_FIELDS = frozenset({"refusal", "reasoning_content", "reasoning", "annotations"})


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


def _check_fields(body: Mapping[str, Any], allowed: frozenset[str]) -> None:
    """Refuse every field that would change the answer in a way tandem does not implement."""
    for name, value in body.items():
        if value is None or name in allowed:
            continue
        if name in _NEUTRAL_VALUES and value in _NEUTRAL_VALUES[name]:
            continue
        raise UnsupportedFieldError(name)


def _stop(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise FieldError("stop", f"stop must be a string or a list of strings, got {stop!r}")


def _int_list(body: Mapping[str, Any], name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(is_int(v) and v in INT32 for v in value):
        raise FieldError(name, f"{name} must be a list of integers, got {value!r}")
    return value


def _logit_bias(body: Mapping[str, Any], max_entries: int) -> dict[int, float]:
    """JSON object keys are strings: {"50256": -100} means token 50256. At most `max_entries`, counted
    before any is converted."""
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise FieldError("logit_bias", f"logit_bias must map token ids to numbers, got {bias!r}")
    if len(bias) > max_entries:
        raise FieldError(
            "logit_bias",
            f"logit_bias has {len(bias)} entries, above this server's limit of {max_entries} "
            "(--max-logit-bias)",
        )
    converted = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except (TypeError, ValueError):
            token_id = None
        if token_id is None or token_id not in INT32:
            raise FieldError("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
        converted[token_id] = finite_number(value, "logit_bias", "logit_bias values")
    return converted


def _stream_options(body: Mapping[str, Any], stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats): a final usage chunk, and usage in every chunk. As in vLLM,
    continuous usage needs include_usage; OpenAI's include_obfuscation is a no-op (tandem never pads)."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not stream:
        raise FieldError("stream_options", "stream_options is only allowed when stream is true")
    if not isinstance(options, dict):
        raise FieldError("stream_options", f"stream_options must be an object, got {options!r}")
    for name in options:
        if name not in ("include_usage", "continuous_usage_stats", "include_obfuscation"):
            raise UnsupportedFieldError(f"stream_options.{name}")
    include_usage = boolean(options, "include_usage")
    return include_usage, include_usage and boolean(options, "continuous_usage_stats")


def _message_content(index: int, content: object) -> str:
    """A message's text: a string, or an array of text parts (joined by newlines)."""
    if isinstance(content, str):
        return content
    param = f"messages[{index}].content"
    if not isinstance(content, list):
        raise FieldError(param, f"{param} must be a string or an array of text parts, got {content!r}")
    texts = []
    for position, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise UnsupportedFieldError(
                f"{param}[{position}]", f"is a {kind!r} part; only text parts are supported"
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _messages(body: Mapping[str, Any], max_messages: int) -> list[pb.ChatMessage]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise FieldError("messages", "messages must be a non-empty array of {role, content} objects")
    if len(messages) > max_messages:
        raise FieldError(
            "messages",
            f"messages has {len(messages)} turns, above this server's limit of {max_messages} "
            "(--max-chat-messages)",
        )
    converted = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise FieldError(
                f"messages[{index}]", f"messages[{index}] must be an object with role and content"
            )
        for name, value in message.items():
            if name not in _MESSAGE_FIELDS and name not in _DROPPED_MESSAGE_FIELDS and value is not None:
                raise UnsupportedFieldError(f"messages[{index}].{name}")
        role = message.get("role")
        if not isinstance(role, str):
            raise FieldError(f"messages[{index}].role", f"messages[{index}].role must be a string")
        content = message.get("content")
        # An assistant turn that only called tools has no content (null), as OpenAI sends it.
        text = "" if content is None and role == "assistant" else _message_content(index, content)
        converted_message = pb.ChatMessage(role=role, content=text)
        if message.get("tool_calls") is not None:
            converted_message.tool_calls.extend(tool_calls(index, message["tool_calls"]))
        for name in ("tool_call_id", "name"):
            value = string(message, name) if name in message else None
            if value is not None:
                setattr(converted_message, name, value)
        converted.append(converted_message)
    return converted


def _prompt(body: Mapping[str, Any], request: pb.GenerateRequest) -> None:
    """A string or token ids; a batch of several prompts is refused (send one request per prompt)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        request.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(is_int(t) and t in INT32 for t in prompt):
        request.token_ids.extend(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise UnsupportedFieldError("prompt", "holds several prompts; send one request per prompt")
    else:
        raise FieldError("prompt", f"prompt must be a non-empty string or array of token ids, got {prompt!r}")


def _sampling(body: Mapping[str, Any], request: pb.GenerateRequest, max_logit_bias: int) -> None:
    sampling = request.sampling
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        value = number(body, name)
        if value is not None:
            setattr(sampling, name, value)
    top_k = integer(body, "top_k")
    if top_k is not None:
        sampling.top_k = top_k
    sampling.disable_speculation = boolean(body, "disable_speculation")
    seed = body.get("seed")
    if seed is not None:
        if not is_int(seed) or not -(2**63) <= seed < 2**64:
            raise FieldError("seed", f"seed must be a 64-bit integer, got {seed!r}")
        # OpenAI seeds are signed; the wire's are uint64. The mapping is one-to-one, so still reproducible.
        sampling.seed = seed & SEED_MASK
    sampling.logit_bias.update(_logit_bias(body, max_logit_bias))


def _top_logprobs(body: Mapping[str, Any], endpoint: Endpoint) -> int | None:
    """How many alternatives to report per token; None when logprobs were not asked for."""
    if endpoint is Endpoint.COMPLETION:
        return integer(body, "logprobs")
    top = integer(body, "top_logprobs")
    if not boolean(body, "logprobs"):
        if top:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs set to true")
        return None
    return top or 0


def translate(body: object, endpoint: Endpoint, limits: RequestLimits = DEFAULT_LIMITS) -> OpenAIRequest:
    """Check an OpenAI request body's shape and build the `GenerateRequest` it stands for; `logit_bias`
    entries and chat turns past `limits` are refused before any is converted."""
    if not isinstance(body, dict):
        raise FieldError("body", "the request body must be a JSON object")
    _check_fields(body, _CHAT_FIELDS if endpoint is Endpoint.CHAT else _COMPLETION_FIELDS)
    request = pb.GenerateRequest()
    if endpoint is Endpoint.CHAT:
        request.messages.extend(_messages(body, limits.max_chat_messages))
    else:
        _prompt(body, request)
    _sampling(body, request, limits.max_logit_bias)
    top_logprobs = _top_logprobs(body, endpoint)
    if top_logprobs is not None:
        # The engine returns the chosen token's logprob only alongside >= 1 alternative; extra ones are cut.
        request.sampling.logprobs = max(top_logprobs, 1) if top_logprobs >= 0 else top_logprobs
    max_tokens = integer(body, "max_completion_tokens") if endpoint is Endpoint.CHAT else None
    if max_tokens is None:
        max_tokens = integer(body, "max_tokens")
    if max_tokens is None and endpoint is Endpoint.COMPLETION:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    if max_tokens is not None:
        request.stopping.max_tokens = max_tokens
    request.stopping.stop.extend(_stop(body))
    request.stopping.stop_token_ids.extend(_int_list(body, "stop_token_ids"))
    request.stopping.ignore_eos = boolean(body, "ignore_eos")
    request.stopping.min_tokens = integer(body, "min_tokens") or 0
    n = integer(body, "n")
    if n == 0:
        # The wire's n = 0 means "unset" (one choice); an explicit 0 here is a mistake to report, not 1.
        raise FieldError("n", "n must be >= 1, got 0")
    request.n = 1 if n is None else n
    request.priority = integer(body, "priority") or 0
    request.tenant = string(body, "user") or ""
    cache_salt = string(body, "cache_salt")
    if cache_salt:
        request.cache_salt = cache_salt
    constraint, constraint_param = structured_output(body)
    if constraint is not None:
        request.structured_output.CopyFrom(constraint)
    if endpoint is Endpoint.CHAT:
        chat_tools(body, request, constraint_param)
        kwargs = body.get("chat_template_kwargs")
        if kwargs:
            request.chat_template_kwargs_json = json.dumps(json_object(kwargs, "chat_template_kwargs"))
    request_id = string(body, "request_id")
    if request_id:
        request.request_id = request_id
    if body.get("skip_special_tokens") is not None:
        request.skip_special_tokens = boolean(body, "skip_special_tokens")
    stream = boolean(body, "stream")
    include_usage, continuous_usage = _stream_options(body, stream)
    return OpenAIRequest(
        endpoint=endpoint,
        generate=request,
        model=string(body, "model"),
        stream=stream,
        include_usage=include_usage,
        top_logprobs=top_logprobs,
        continuous_usage=continuous_usage,
        include_stop=boolean(body, "include_stop_str_in_output"),
        constraint_param=constraint_param,
    )
