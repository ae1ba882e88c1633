"""Admission: the cheap checks a request meets on the event loop before it takes a slot or is tokenized.

Everything here is bounded by the request's size, not its content: counts and byte sizes against the
server's limits (`RequestLimits`), the max_tokens cap, the number of choices, and the trusted gateway
headers. What needs the tokenizer or the grammar compiler is `decode_service.front_door.validation`'s, run off
the loop; what the HTTP door must bound before it can even build a request (a chat's turns, a
logit_bias's entries) it counts with the same `RequestLimits`.

Each limit check takes plain values, so both front doors (gRPC and HTTP) call the same functions, and
each refusal names the server flag that sets the limit, so a client knows what to ask its operator for.
They run before a request takes a slot and before its prompt is tokenized (tokenizing costs ~300 bytes
of memory per prompt byte).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from base.errors import ConfigError, InvalidRequestError
from engine.model_facts import ModelFacts
from protos.tandem.v1 import generation_pb2 as pb


@dataclass(frozen=True)
class RequestLimits:
    """Per-request bounds; the defaults suit the default model and are raised by flags.

    `max_id_bytes` bounds request ids and tenant names (printable text only: they are echoed in every
    stream message and written to logs). `max_prompt_bytes` bounds a text or chat prompt's UTF-8 size
    before it is tokenized. `max_stop_strings` and `max_stop_string_length` (characters) bound the
    stop-string matcher, which runs in the front door for every token. `max_logit_bias` bounds a
    request's logit bias entries, checked before any is converted (each costs Python time on the way in
    and a scatter on every step). `max_chat_messages` bounds a chat's turns before any is converted or
    rendered: the chat template costs GIL-held Python per turn, however short. `max_json_objects`
    bounds an HTTP body's JSON objects while it is parsed: each costs a dict built under the GIL, and
    a body of 110k tiny turns held the event loop 40-100 ms before any field was looked at. A non-streamed
    HTTP answer is built whole in memory, so `max_unstreamed_tokens` bounds what it may hold: choices
    x max_tokens x (1 + alternatives per token), ~300 bytes each.
    """

    max_id_bytes: int = 1024
    max_prompt_bytes: int = 1024 * 1024
    max_stop_strings: int = 16
    max_stop_string_length: int = 256
    max_logit_bias: int = 1024
    max_chat_messages: int = 2048
    max_json_objects: int = 16384
    max_unstreamed_tokens: int = 64 * 4096

    def validate(self) -> None:
        for name in (
            "max_id_bytes",
            "max_prompt_bytes",
            "max_stop_strings",
            "max_stop_string_length",
            "max_logit_bias",
            "max_chat_messages",
            "max_json_objects",
            "max_unstreamed_tokens",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")

    def check_id(self, field: str, value: str) -> None:
        """An identifier the server echoes and logs: printable, and at most `max_id_bytes` of UTF-8."""
        size = len(value.encode("utf-8", "surrogatepass"))
        if size > self.max_id_bytes:
            raise InvalidRequestError(
                f"{field} is {size} bytes, above this server's limit of {self.max_id_bytes} (--max-id-bytes)"
            )
        if not value.isprintable():
            raise InvalidRequestError(f"{field} must be printable text (no newlines or control characters)")

    def check_prompt_bytes(self, size: int) -> None:
        if size > self.max_prompt_bytes:
            raise InvalidRequestError(
                f"the prompt is {size} bytes, above this server's limit of {self.max_prompt_bytes} "
                "(--max-prompt-bytes)"
            )

    def check_stop(self, stop: Sequence[str]) -> None:
        if len(stop) > self.max_stop_strings:
            raise InvalidRequestError(
                f"stop has {len(stop)} strings, above this server's limit of {self.max_stop_strings} "
                "(--max-stop-strings)"
            )
        longest = max((len(s) for s in stop), default=0)
        if longest > self.max_stop_string_length:
            raise InvalidRequestError(
                f"a stop string has {longest} characters, above this server's limit of "
                f"{self.max_stop_string_length} (--max-stop-string-length)"
            )

    def check_logit_bias(self, count: int) -> None:
        if count > self.max_logit_bias:
            raise InvalidRequestError(
                f"logit_bias has {count} entries, above this server's limit of {self.max_logit_bias} "
                "(--max-logit-bias)"
            )

    def check_chat_messages(self, count: int) -> None:
        if count > self.max_chat_messages:
            raise InvalidRequestError(
                f"messages has {count} turns, above this server's limit of {self.max_chat_messages} "
                "(--max-chat-messages)"
            )

    def check_json_objects(self, count: int) -> None:
        """Called as an HTTP body's objects are parsed, so a refusal costs `max_json_objects` of them."""
        if count > self.max_json_objects:
            raise InvalidRequestError(
                f"the request body holds more than {self.max_json_objects} JSON objects, this server's "
                "limit (--max-json-objects)"
            )

    def check_unstreamed(self, choices: int, max_tokens: int, alternatives: int) -> None:
        """A whole (non-streamed) answer's worst case, from what the request asks for."""
        worst = choices * max_tokens * (1 + alternatives)
        if worst > self.max_unstreamed_tokens:
            raise InvalidRequestError(
                f"a non-streamed answer of n={choices} x max_tokens={max_tokens} x (1 + {alternatives} "
                f"logprobs) may hold {worst} tokens, above this server's limit of "
                f"{self.max_unstreamed_tokens} (--max-unstreamed-tokens); stream it (stream: true), "
                "or lower n, max_tokens or logprobs"
            )


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
    request: pb.GenerateRequest,
    headers: Iterable[tuple[str, object]],
    tenant_header: str,
    priority_header: str,
) -> tuple[str, int]:
    """Tenant and priority from the trusted gateway's headers (gRPC metadata or HTTP headers, as (name,
    value) pairs) when their names are configured (`FrontDoorConfig`), else from the request."""
    tenant, priority = request.tenant, request.priority
    if tenant_header:
        tenant = _trusted_header(headers, tenant_header) or ""
    if priority_header:
        value = _trusted_header(headers, priority_header) or "0"
        try:
            priority = int(value)
        except ValueError:
            priority = 0
    return tenant, priority
