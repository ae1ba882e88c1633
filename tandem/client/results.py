"""Plain Python views of the server's answers, so client code never handles protobuf messages.

Each stream message becomes a `GenerationDelta`; `CompletionBuilder` folds a stream into one
`Completion`. The original protobuf message rides along on `GenerationDelta.raw` (excluded from
equality) for callers that want the exact wire form, such as `tandem generate --json`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from protos.tandem.v1 import generation_pb2 as pb


class FinishReason(str, Enum):
    """Why a generation ended; compares equal to its lower-case string value."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    TOOL_CALLS = "tool_calls"
    # A reason added to the protocol after this client was built.
    UNKNOWN = "unknown"


_FINISH_REASONS = {
    pb.STOP: FinishReason.STOP,
    pb.LENGTH: FinishReason.LENGTH,
    pb.ABORT: FinishReason.ABORT,
    pb.TOOL_CALLS: FinishReason.TOOL_CALLS,
}


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's natural-log probability and the most likely alternatives, best first."""

    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of the answer's tool call number `index`: id and name on its first piece, then more of
    its arguments' JSON text."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True)
class ToolCall:
    """One whole tool call of an answer; `arguments` is JSON text (`json.loads` it)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class ServerTimings:
    """Seconds measured on the server from the request's arrival (see ServerTimings in the proto)."""

    queue_seconds: float
    prefill_seconds: float
    first_token_seconds: float


@dataclass(frozen=True)
class GenerationDelta:
    """What one stream message adds; `finish_reason`, `matched_stop`, `usage`, `timings` only on the last.

    `matched_stop` is the stop string or stop token id that ended generation, None for EOS or no stop.
    `reasoning_text` and `tool_calls` are what the server's reasoning and tool-call parsers split off
    the text (never part of `text`).
    """

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    usage: Usage | None = None
    timings: ServerTimings | None = None
    index: int = 0  # the choice this message belongs to, when the request asked for n > 1
    reasoning_text: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    raw: pb.GenerateResponse | None = field(default=None, compare=False, repr=False)

    @property
    def is_final(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def from_proto(cls, message: pb.GenerateResponse) -> GenerationDelta:
        logprobs = tuple(
            TokenLogprob(lp.token_id, lp.logprob, tuple(TopLogprob(t.token_id, t.logprob) for t in lp.top))
            for lp in message.logprobs
        )
        final = message.finish_reason != pb.FINISH_REASON_UNSPECIFIED
        stop_kind = message.WhichOneof("matched_stop")
        timings = message.timings
        return cls(
            request_id=message.request_id,
            text=message.text,
            token_ids=tuple(message.token_ids),
            logprobs=logprobs,
            finish_reason=_FINISH_REASONS.get(message.finish_reason, FinishReason.UNKNOWN) if final else None,
            matched_stop=getattr(message, stop_kind) if stop_kind else None,
            usage=Usage(
                message.usage.prompt_tokens, message.usage.completion_tokens, message.usage.cached_tokens
            )
            if message.HasField("usage")
            else None,
            timings=ServerTimings(timings.queue_seconds, timings.prefill_seconds, timings.first_token_seconds)
            if message.HasField("timings")
            else None,
            index=message.index,
            reasoning_text=message.reasoning_text,
            tool_calls=tuple(ToolCallDelta(t.index, t.id, t.name, t.arguments) for t in message.tool_calls),
            raw=message,
        )


@dataclass(frozen=True)
class Completion:
    """A whole generation: the concatenated text and tokens, plus what the final message reported."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: FinishReason | None
    matched_stop: str | int | None
    usage: Usage | None
    timings: ServerTimings | None
    reasoning_text: str = ""
    tool_calls: tuple[ToolCall, ...] = ()


class CompletionBuilder:
    """Accumulates deltas; shared by the sync and async clients' `complete()`."""

    def __init__(self) -> None:
        self._texts: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self._last: GenerationDelta | None = None
        self._reasoning: list[str] = []
        self._calls: dict[int, list[str]] = {}  # index -> [id, name, arguments]

    def add(self, delta: GenerationDelta) -> None:
        self._texts.append(delta.text)
        self._reasoning.append(delta.reasoning_text)
        for piece in delta.tool_calls:
            call = self._calls.setdefault(piece.index, ["", "", ""])
            call[0] = call[0] or piece.id
            call[1] = call[1] or piece.name
            call[2] += piece.arguments
        self._token_ids.extend(delta.token_ids)
        self._logprobs.extend(delta.logprobs)
        self._last = delta

    def build(self) -> Completion:
        last = self._last
        return Completion(
            request_id=last.request_id if last else "",
            text="".join(self._texts),
            token_ids=tuple(self._token_ids),
            logprobs=tuple(self._logprobs),
            finish_reason=last.finish_reason if last else None,
            matched_stop=last.matched_stop if last else None,
            usage=last.usage if last else None,
            timings=last.timings if last else None,
            reasoning_text="".join(self._reasoning),
            tool_calls=tuple(ToolCall(*self._calls[index]) for index in sorted(self._calls)),
        )


class ServingMode(str, Enum):
    UNSPECIFIED = "unspecified"
    AGGREGATED = "aggregated"
    DISAGGREGATED = "disaggregated"


_SERVING_MODES = {
    pb.SERVING_MODE_AGGREGATED: ServingMode.AGGREGATED,
    pb.SERVING_MODE_DISAGGREGATED: ServingMode.DISAGGREGATED,
}


@dataclass(frozen=True)
class ModelInfo:
    """What a decode server serves and how (see ModelInfo in the proto)."""

    model_name: str
    max_context_length: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    block_size: int
    mode: ServingMode
    server_version: str
    prefix_caching: bool = False

    @classmethod
    def from_proto(cls, message: pb.ModelInfo) -> ModelInfo:
        return cls(
            model_name=message.model_name,
            max_context_length=message.max_context_length,
            vocab_size=message.vocab_size,
            eos_token_ids=tuple(message.eos_token_ids),
            dtype=message.dtype,
            block_size=message.block_size,
            mode=_SERVING_MODES.get(message.mode, ServingMode.UNSPECIFIED),
            server_version=message.server_version,
            prefix_caching=message.prefix_caching,
        )
