"""Turning keyword arguments into a `GenerateRequest`, for both clients (blocking and asyncio).

The client does not re-validate what the server validates (ranges, exactly one prompt form): the
server is the single source of truth and answers INVALID_ARGUMENT with a precise message. Unset
optional parameters stay unset on the wire so that the server's defaults apply.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypedDict

from protos.tandem.v1 import generation_pb2 as pb

# A chat turn as {"role": ..., "content": ...} (OpenAI's shape, `tool_calls` and `tool_call_id` included),
# as a (role, content) pair, or as the protobuf message.
ChatMessageLike = Mapping[str, Any] | tuple[str, str] | pb.ChatMessage
# A function tool as OpenAI writes it ({"type": "function", "function": {...}}), its inner
# {"name", "description", "parameters"} mapping, or the protobuf message.
ToolLike = Mapping[str, Any] | pb.FunctionTool
_TOOL_CHOICE_MODES = {
    "none": pb.TOOL_CHOICE_NONE,
    "auto": pb.TOOL_CHOICE_AUTO,
    "required": pb.TOOL_CHOICE_REQUIRED,
}


def _tool_call(call: Mapping[str, Any] | pb.ToolCall) -> pb.ToolCall:
    if isinstance(call, pb.ToolCall):
        return call
    function = call.get("function", call)
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return pb.ToolCall(id=call.get("id", ""), name=function["name"], arguments=arguments)


def _chat_message(message: ChatMessageLike) -> pb.ChatMessage:
    if isinstance(message, pb.ChatMessage):
        return message
    if isinstance(message, Mapping):
        return pb.ChatMessage(
            role=message["role"],
            content=message.get("content") or "",
            tool_calls=[_tool_call(call) for call in message.get("tool_calls") or ()],
            tool_call_id=message.get("tool_call_id") or "",
            name=message.get("name") or "",
        )
    role, content = message
    return pb.ChatMessage(role=role, content=content)


def _tool(tool: ToolLike) -> pb.FunctionTool:
    if isinstance(tool, pb.FunctionTool):
        return tool
    function = tool.get("function", tool)
    parameters = function.get("parameters")
    return pb.FunctionTool(
        name=function["name"],
        description=function.get("description") or "",
        parameters_json=json.dumps(parameters) if parameters is not None else "",
    )


def _tool_choice(choice: str | Mapping[str, Any]) -> pb.ToolChoice:
    """ "none", "auto", "required", or a named function as OpenAI writes it
    ({"type": "function", "function": {"name": ...}}) or as {"name": ...}."""
    if isinstance(choice, str):
        if choice not in _TOOL_CHOICE_MODES:
            raise ValueError(f"tool_choice must be none, auto, required or a function, got {choice!r}")
        return pb.ToolChoice(mode=_TOOL_CHOICE_MODES[choice])
    return pb.ToolChoice(function_name=choice.get("function", choice)["name"])


def structured_output(
    json_schema: Mapping[str, Any] | str | None = None,
    regex: str | None = None,
    choice: Sequence[str] | None = None,
    grammar: str | None = None,
    json_object: bool = False,
) -> pb.StructuredOutput | None:
    """The StructuredOutput for at most one of the constraints (None: unconstrained)."""
    given = [
        name
        for name, value in (
            ("json_schema", json_schema),
            ("regex", regex),
            ("choice", choice),
            ("grammar", grammar),
            ("json_object", json_object or None),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise ValueError(f"give at most one of json_schema, regex, choice, grammar, json_object; got {given}")
    if json_schema is not None:
        text = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
        return pb.StructuredOutput(json_schema=text)
    if regex is not None:
        return pb.StructuredOutput(regex=regex)
    if choice is not None:
        return pb.StructuredOutput(choice=pb.ChoiceList(choices=list(choice)))
    if grammar is not None:
        return pb.StructuredOutput(grammar=grammar)
    if json_object:
        return pb.StructuredOutput(json_object=True)
    return None


class RequestOptions(TypedDict, total=False):
    """`build_request`'s keyword arguments, which both clients' `generate()` take and pass on whole."""

    token_ids: Sequence[int] | None
    messages: Iterable[ChatMessageLike] | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    seed: int | None
    logprobs: int
    presence_penalty: float | None
    frequency_penalty: float | None
    repetition_penalty: float | None
    logit_bias: Mapping[int, float] | None
    disable_speculation: bool
    n: int
    max_tokens: int | None
    stop: Iterable[str]
    stop_token_ids: Iterable[int]
    ignore_eos: bool
    min_tokens: int
    request_id: str | None
    priority: int
    tenant: str
    cache_salt: str
    json_schema: Mapping[str, Any] | str | None
    regex: str | None
    choice: Sequence[str] | None
    grammar: str | None
    json_object: bool
    tools: Iterable[ToolLike] | None
    tool_choice: str | Mapping[str, Any] | None
    parallel_tool_calls: bool | None
    chat_template_kwargs: Mapping[str, Any] | None
    skip_special_tokens: bool | None


def build_request(
    prompt: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    messages: Iterable[ChatMessageLike] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    logprobs: int = 0,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    logit_bias: Mapping[int, float] | None = None,
    disable_speculation: bool = False,
    n: int = 0,
    max_tokens: int | None = None,
    stop: Iterable[str] = (),
    stop_token_ids: Iterable[int] = (),
    ignore_eos: bool = False,
    min_tokens: int = 0,
    request_id: str | None = None,
    priority: int = 0,
    tenant: str = "",
    cache_salt: str = "",
    json_schema: Mapping[str, Any] | str | None = None,
    regex: str | None = None,
    choice: Sequence[str] | None = None,
    grammar: str | None = None,
    json_object: bool = False,
    tools: Iterable[ToolLike] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    skip_special_tokens: bool | None = None,
) -> pb.GenerateRequest:
    """A GenerateRequest; parameters mean what the fields of the same name in generation.proto mean.

    `json_schema` (a dict or JSON text), `regex`, `choice`, `grammar` and `json_object` are the kinds of
    `structured_output` (give at most one); `tool_choice` is "none", "auto", "required" or a function
    ({"type": "function", "function": {"name": ...}}, or {"name": ...}); `chat_template_kwargs` are extra
    chat template variables (e.g. {"enable_thinking": False})."""
    if isinstance(stop, str):
        # A bare string would otherwise become one stop string per character.
        stop = (stop,)
    sampling = pb.SamplingParams(
        logprobs=logprobs, logit_bias=dict(logit_bias or {}), disable_speculation=disable_speculation
    )
    for name, value in (
        ("temperature", temperature),
        ("top_p", top_p),
        ("top_k", top_k),
        ("min_p", min_p),
        ("seed", seed),
        ("presence_penalty", presence_penalty),
        ("frequency_penalty", frequency_penalty),
        ("repetition_penalty", repetition_penalty),
    ):
        if value is not None:
            setattr(sampling, name, value)
    stopping = pb.StoppingParams(
        stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos, min_tokens=min_tokens
    )
    if max_tokens is not None:
        stopping.max_tokens = max_tokens
    request = pb.GenerateRequest(
        request_id=request_id or "",
        prompt=prompt or "",
        token_ids=list(token_ids or ()),
        messages=[_chat_message(m) for m in messages or ()],
        sampling=sampling,
        stopping=stopping,
        priority=priority,
        tenant=tenant,
        n=n,
        cache_salt=cache_salt,
        tools=[_tool(tool) for tool in tools or ()],
    )
    output = structured_output(json_schema, regex, choice, grammar, json_object)
    if output is not None:
        request.structured_output.CopyFrom(output)
    if tool_choice is not None:
        request.tool_choice.CopyFrom(_tool_choice(tool_choice))
    if parallel_tool_calls is not None:
        request.parallel_tool_calls = parallel_tool_calls
    if chat_template_kwargs:
        request.chat_template_kwargs_json = json.dumps(dict(chat_template_kwargs))
    if skip_special_tokens is not None:
        request.skip_special_tokens = skip_special_tokens
    return request
