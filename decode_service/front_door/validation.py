"""Checks a public `GenerateRequest` (from gRPC, or translated from HTTP) and makes its engine sequence.

What the request's fields get wrong is caught here, before the request reaches the scheduler, as an
`InvalidRequestError` whose message names the field: INVALID_ARGUMENT over gRPC, 400 over HTTP.
The cheap checks that come first, on the event loop, are `decode_service.front_door.admission`'s; the answer
parsers a request asks for are `decode_service.front_door.choice_text`'s.

Defaults for unset fields follow what vLLM users expect: temperature 1.0, top_p 1.0, top_k off,
min_p 0, no seed; `max_tokens` unset means "until the context is full", capped by the server's
`max_tokens_cap` (and never less than 1, so an over-long prompt is reported as such).

Validation runs off the event loop (`ValidationPool`), with cheap requests never queued behind costly
ones. Building a request tokenizes text prompts, which for a large prompt costs seconds and hundreds
of MB, and parses constraints (JSON schemas, regexes, grammars; the engine core compiles them). So
each kind of cost has its own lane: token-id and short-text requests go to one thread, large texts to
another, constrained requests with short prompts to threads of their own; at most a bounded number of
large or constrained ones may wait or run at once in their lane (more get RESOURCE_EXHAUSTED). A flood
of huge prompts or deep schemas then delays only its own kind.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from base.errors import ConfigError, InvalidRequestError
from decode_service.chat_template import read_chat_template
from decode_service.engine_core.messages import Submit
from decode_service.front_door import json_text
from decode_service.front_door.constraints import (
    ConstraintError,
    Constraints,
    Tool,
    grammar_spec,
    parse_tools,
    tool_choice,
)
from engine.model_facts import ModelFacts
from engine.params import StoppingParams
from engine.tokenizer import RESERVED_TEMPLATE_KWARGS
from protos.tandem.v1 import generation_pb2 as pb
from serving.errors import QueueFullError
from serving.sampling import sampling_params


def chat_message(index: int, message: pb.ChatMessage) -> dict[str, Any]:
    """A message in the chat-template format Hugging Face templates read (tool call arguments as dicts)."""
    converted: dict[str, Any] = {"role": message.role, "content": message.content}
    calls = []
    for number, call in enumerate(message.tool_calls):
        field = f"messages[{index}].tool_calls[{number}]"
        try:
            arguments = json_text.loads(call.arguments) if call.arguments else {}
        except json_text.JsonTextError as exc:
            raise ConstraintError(f"{field}.arguments", str(exc)) from None
        if not isinstance(arguments, dict):
            raise ConstraintError(f"{field}.arguments", "must be a JSON object")
        calls.append(
            {"type": "function", "id": call.id, "function": {"name": call.name, "arguments": arguments}}
        )
    if calls:
        converted["tool_calls"] = calls
    if message.tool_call_id:
        converted["tool_call_id"] = message.tool_call_id
    if message.name:
        converted["name"] = message.name
    return converted


def prompt_token_ids(
    request: pb.GenerateRequest, model: ModelFacts, tools: SequenceOf[Tool] = ()
) -> list[int]:
    """The prompt as token ids, from exactly one of prompt, token_ids and messages; chats show `tools`."""
    given = [
        name
        for name, present in (
            ("prompt", bool(request.prompt)),
            ("token_ids", len(request.token_ids) > 0),
            ("messages", len(request.messages) > 0),
        )
        if present
    ]
    if len(given) != 1:
        detail = "none was given" if not given else f"got {' and '.join(given)}"
        raise InvalidRequestError(f"set exactly one of prompt, token_ids and messages; {detail}")
    if given[0] != "messages" and request.chat_template_kwargs_json:
        raise ConstraintError("chat_template_kwargs_json", "needs a chat request (messages)")
    if given[0] == "token_ids":
        return list(request.token_ids)
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise InvalidRequestError(f"this server has no tokenizer: send token_ids instead of {given[0]}")
    if given[0] == "prompt":
        ids = tokenizer.encode(request.prompt)
        if not ids:
            raise InvalidRequestError("the prompt encodes to no tokens")
        return ids
    messages = [chat_message(index, message) for index, message in enumerate(request.messages)]
    return tokenizer.apply_chat_template(
        messages, tools=[tool.for_chat_template() for tool in tools], template_kwargs=template_kwargs(request)
    )


def template_kwargs(request: pb.GenerateRequest) -> dict[str, Any]:
    """The chat template's extra variables the request sets (`chat_template_kwargs_json`)."""
    if not request.chat_template_kwargs_json:
        return {}
    field = "chat_template_kwargs_json"
    try:
        kwargs = json_text.loads(request.chat_template_kwargs_json)
    except json_text.JsonTextError as exc:
        raise ConstraintError(field, str(exc)) from None
    if not isinstance(kwargs, dict):
        raise ConstraintError(field, f"must be a JSON object, got {type(kwargs).__name__}")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise ConstraintError(field, f"must not set {', '.join(reserved)}: the server sets them itself")
    return kwargs


def stopping_params(
    request: pb.GenerateRequest, num_prompt_tokens: int, model: ModelFacts, max_tokens_cap: int
) -> StoppingParams:
    """StoppingParams; unset max_tokens fills the context up to `max_tokens_cap`. Validated."""
    proto = request.stopping
    if proto.HasField("max_tokens"):
        max_tokens = proto.max_tokens
    else:
        max_tokens = max(1, min(model.max_model_len - num_prompt_tokens, max_tokens_cap))
    params = StoppingParams(
        max_tokens=max_tokens,
        stop=tuple(proto.stop),
        stop_token_ids=tuple(proto.stop_token_ids),
        ignore_eos=proto.ignore_eos,
        min_tokens=proto.min_tokens,
    )
    params.validate(model.vocab_size)
    return params


def cache_salt(request: pb.GenerateRequest, salt_tenant: str | None) -> str:
    """The request's effective prefix-cache salt: its `cache_salt`, prefixed by `salt_tenant` when the server
    salts by tenant (length-prefixed, so no tenant/salt pair can spell another)."""
    if salt_tenant is None:
        return request.cache_salt
    return f"{len(salt_tenant)}:{salt_tenant}:{request.cache_salt}"


def use_chat_template(model: ModelFacts, value: str) -> None:
    """Render this server's chats with the template `value` (--chat-template: a Jinja file, read now, or
    the template inline); set on the tokenizer object, so whoever shares it with `model` (the engine that
    built it) renders the same."""
    if model.tokenizer is None:
        raise ConfigError("--chat-template needs the model's tokenizer")
    model.tokenizer.set_chat_template(read_chat_template(value))


def rendered_tools(request: pb.GenerateRequest, tools: list[Tool]) -> list[Tool]:
    """The tools the chat template shows: none when tool_choice is NONE, so the model is not invited to
    call what it may not (vLLM shows them unless --exclude-tools-when-tool-choice-none)."""
    mode, _ = tool_choice(request)
    return [] if mode == pb.TOOL_CHOICE_NONE else tools


def skips_special_tokens(request: pb.GenerateRequest, keep_special_tokens: bool) -> bool:
    """Whether the answer's text leaves out the tokenizer's special tokens: as the request says (default
    yes), unless `keep_special_tokens` (the answer's parser reads control tokens)."""
    asked = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
    return asked and not keep_special_tokens


def uses_agent_fields(request: pb.GenerateRequest) -> bool:
    """Whether `request` sets tools, tool_choice or structured_output; a request that sets none of them
    skips their parsing."""
    return bool(request.tools) or request.HasField("tool_choice") or request.HasField("structured_output")


def served_prompt_ids(request: pb.GenerateRequest, model: ModelFacts) -> list[int]:
    """The token ids `request`'s prompt is served with: the chat template applied, showing the tools
    `build_request` would show. Tokenizes, so call it off the event loop."""
    tools = rendered_tools(request, parse_tools(request)) if uses_agent_fields(request) else []
    return prompt_token_ids(request, model, tools)


def build_request(
    request: pb.GenerateRequest,
    request_id: str,
    model: ModelFacts,
    max_tokens_cap: int,
    salt_tenant: str | None = None,
    constraints: Constraints | None = None,
) -> Submit:
    """Validate a public request against the served model and return what the engine core is sent for it
    (the caller numbers the submission and adds its scheduling fields), with the constraint the core
    compiles for it (None: unconstrained).

    Tokenizes text and chat prompts and parses constraints, so call it off the event loop. Without
    `constraints` a constrained request is refused.
    """
    sampling = sampling_params(request.sampling, model.vocab_size)
    tools, spec, shown_tools = [], None, []
    if uses_agent_fields(request):
        tools = parse_tools(request)
        spec = grammar_spec(request, tools)
        shown_tools = rendered_tools(request, tools)
    ids = prompt_token_ids(request, model, shown_tools)
    stopping = stopping_params(request, len(ids), model, max_tokens_cap)
    grammar = None if spec is None else (constraints or Constraints(None)).check(spec, ids)
    model.check_request(ids, sampling, stopping)
    check_fits_pool(model, len(ids), stopping.max_tokens)
    return Submit(
        submission=0,
        request_id=request_id,
        prompt_token_ids=list(ids),
        sampling=sampling,
        stopping=stopping,
        cache_salt=cache_salt(request, salt_tenant),
        grammar=grammar,
        priority=0,
        tenant="",
        arrival_time=None,
        n=1,
    )


def check_fits_pool(model: ModelFacts, num_prompt_tokens: int, max_tokens: int) -> None:
    """Refuse a request that could not finish even with the whole KV pool to itself.

    Preemption only helps when the victim can eventually run alone; a request longer than the pool
    would preempt everyone and then itself, forever.
    """
    needed = model.blocks_for_tokens(num_prompt_tokens + max_tokens)
    total = model.num_blocks
    if needed > total:
        raise InvalidRequestError(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) needs "
            f"{needed} KV blocks but the server's pool has {total}; lower max_tokens"
        )


T = TypeVar("T")

# Text prompts above this many bytes tokenize on the long-prompt thread (a few ms of work at most below).
SHORT_PROMPT_BYTES = 16 * 1024


class _BoundedLane:
    """`threads` threads whose backlog (waiting plus running) is bounded."""

    def __init__(self, name: str, what: str, max_queue: int, threads: int = 1) -> None:
        self.what = what
        self.max_queue = max_queue
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
        self.count = 0

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        if self.count >= self.max_queue:
            raise QueueFullError(
                f"{self.count} {self.what} are already waiting to be validated, this server's limit "
                f"(--max-validation-queue); retry later"
            )
        loop = asyncio.get_running_loop()
        self.count += 1
        future = self.executor.submit(fn, *args)
        # Counted until the work itself ends, not when a cancelled caller stops waiting for it.
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._done))
        return await asyncio.wrap_future(future)

    def _done(self) -> None:
        self.count -= 1


class ValidationPool:
    """Three executors: short, long prompts and constrained; the last two bounded.

    Constrained requests get threads of their own (up to their bound): parsing a large schema or many
    tools takes milliseconds, which unconstrained short requests should not wait behind.
    """

    def __init__(self, max_long_queue: int, max_constrained_queue: int | None = None) -> None:
        self._short = ThreadPoolExecutor(max_workers=1, thread_name_prefix="validate")
        self._long = _BoundedLane("validate-long", "large prompts", max_long_queue)
        max_constrained = max_constrained_queue or max_long_queue
        self._constrained = _BoundedLane(
            "validate-grammar", "constrained requests", max_constrained, threads=max_constrained
        )

    async def run(
        self, prompt_bytes: int, fn: Callable[..., T], *args: object, constrained: bool = False
    ) -> T:
        """`fn(*args)` on the executor for a prompt of `prompt_bytes` (0 for token ids); `constrained`
        requests (which may compile a grammar) never wait behind or hold up unconstrained short ones."""
        if prompt_bytes > SHORT_PROMPT_BYTES:
            return await self._long.run(fn, *args)
        if constrained:
            return await self._constrained.run(fn, *args)
        return await asyncio.wrap_future(self._short.submit(fn, *args))

    def shutdown(self) -> None:
        for executor in (self._short, self._long.executor, self._constrained.executor):
            executor.shutdown(wait=False, cancel_futures=True)
