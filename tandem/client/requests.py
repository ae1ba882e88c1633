"""Turning keyword arguments into a `GenerateRequest`: the one place both clients build requests.

The client does not re-validate what the server validates (ranges, exactly one prompt form): the
server is the single source of truth and answers INVALID_ARGUMENT with a precise message. Unset
optional parameters stay unset on the wire so that the server's defaults apply.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from protos.tandem.v1 import generation_pb2 as pb

# A chat turn as {"role": ..., "content": ...}, as a (role, content) pair, or as the protobuf message.
ChatMessageLike = Mapping[str, str] | tuple[str, str] | pb.ChatMessage


def _chat_message(message: ChatMessageLike) -> pb.ChatMessage:
    if isinstance(message, pb.ChatMessage):
        return message
    if isinstance(message, Mapping):
        return pb.ChatMessage(role=message["role"], content=message["content"])
    role, content = message
    return pb.ChatMessage(role=role, content=content)


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
) -> pb.GenerateRequest:
    """A GenerateRequest; parameters mean what the fields of the same name in generation.proto mean."""
    if isinstance(stop, str):
        # A bare string would otherwise become one stop string per character.
        stop = (stop,)
    sampling = pb.SamplingParams(logprobs=logprobs, logit_bias=dict(logit_bias or {}))
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
    return pb.GenerateRequest(
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
    )
