"""The cheap checks a request meets on the event loop before it takes a slot or is tokenized.

Everything here is bounded by the request's size, not its content: counts and byte sizes against the
server's limits (`RequestLimits`), the max_tokens cap, the number of choices, and the trusted gateway
headers. What needs the tokenizer or the grammar compiler is `decode_service.front_door.validation`'s, run off
the loop; what the HTTP door must bound before it can even build a request (a chat's turns, a
logit_bias's entries) it counts with the same `RequestLimits`.
"""

from __future__ import annotations

from collections.abc import Iterable

from base.errors import InvalidRequestError
from decode_service.config import DecodeServiceConfig
from decode_service.front_door.request_limits import RequestLimits
from engine.model_facts import ModelFacts
from protos.tandem.v1 import generation_pb2 as pb


def prompt_bytes(request: pb.GenerateRequest) -> int:
    """UTF-8 size of a text or chat prompt (0 for token ids): what tokenizing it will cost."""
    size = len(request.prompt.encode())
    for message in request.messages:
        size += len(message.role.encode()) + len(message.content.encode())
        size += sum(len(call.name.encode()) + len(call.arguments.encode()) for call in message.tool_calls)
    for tool in request.tools:
        size += len(tool.name.encode()) + len(tool.description.encode()) + len(tool.parameters_json.encode())
    return size


def check_limits(request: pb.GenerateRequest, limits: RequestLimits, max_model_len: int) -> None:
    """The cheap checks: run them on the event loop before the request takes a slot or is tokenized."""
    if request.request_id:
        limits.check_id("request_id", request.request_id)
    if request.tenant:
        limits.check_id("tenant", request.tenant)
    if request.cache_salt:
        limits.check_id("cache_salt", request.cache_salt)
    limits.check_chat_messages(len(request.messages))
    limits.check_prompt_bytes(prompt_bytes(request))
    if len(request.token_ids) > max_model_len:
        raise InvalidRequestError(
            f"token_ids has {len(request.token_ids)} tokens, above the context length of {max_model_len}"
        )
    limits.check_stop(request.stopping.stop)
    limits.check_logit_bias(len(request.sampling.logit_bias))


def check_max_tokens_cap(request: pb.GenerateRequest, max_tokens_cap: int) -> None:
    """Refuse, rather than clip, a max_tokens above the server's cap.

    A silently shortened answer would look like a model that stopped early; an INVALID_ARGUMENT tells
    the client what to change. An unset max_tokens is filled in (up to the cap) by validation.
    """
    if request.stopping.HasField("max_tokens") and request.stopping.max_tokens > max_tokens_cap:
        raise InvalidRequestError(
            f"stopping.max_tokens is {request.stopping.max_tokens}, "
            f"above this server's cap of {max_tokens_cap}"
        )


def num_choices(request: pb.GenerateRequest, model: ModelFacts) -> int:
    """How many completions the request asks for: n, with 0 (unset) meaning 1, at most max_num_seqs."""
    limit = model.max_num_seqs
    if request.n < 0 or request.n > limit:
        raise InvalidRequestError(f"n must be in [1, {limit}] (this server's max_num_seqs), got {request.n}")
    return request.n or 1


def _trusted_header(headers: Iterable[tuple[str, object]], name: str) -> str | None:
    """The one value of the trusted header `name` (lowercase), None when absent.

    A gateway that appends its header rather than replacing the client's (Envoy's default) would let the
    client choose which copy counts, and the two doors used to pick different ones: a request that carries
    it more than once is refused."""
    values = [str(value) for key, value in headers if key.lower() == name]
    if len(values) > 1:
        raise InvalidRequestError(
            f"the {name} header appears {len(values)} times; the gateway must send exactly one"
        )
    return values[0] if values else None


def tenant_and_priority(
    request: pb.GenerateRequest, headers: Iterable[tuple[str, object]], config: DecodeServiceConfig
) -> tuple[str, int]:
    """Tenant and priority from the trusted gateway's headers (gRPC metadata or HTTP headers, as (name,
    value) pairs) when configured, else from the request."""
    tenant, priority = request.tenant, request.priority
    if config.tenant_header:
        tenant = _trusted_header(headers, config.tenant_header) or ""
    if config.priority_header:
        value = _trusted_header(headers, config.priority_header) or "0"
        try:
            priority = int(value)
        except ValueError:
            priority = 0
    return tenant, priority
