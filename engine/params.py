"""Per-request sampling and stopping parameters.

They are frozen so that one request's parameters can be shared by the scheduler, the sampler and the
stop checker without anyone mutating them behind the others' backs. `validate()` runs once, when the
request enters the system, and names the offending field so the client can fix its request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from base.errors import InvalidRequestError

MAX_LOGPROBS = 20

# OpenAI's ranges: presence and frequency penalties in [-2, 2], logit bias in [-100, 100].
MAX_ADDITIVE_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0

# Temperatures below this are treated as greedy: dividing logits by them overflows fp32 and the
# distribution is a point mass on the argmax anyway.
GREEDY_TEMPERATURE_EPS = 1e-5


def _require_real(name: str, value: object) -> float:
    """Return `value` as a float, refusing bools, non-numbers and NaN/inf."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}")
    try:
        as_float = float(value)
    except OverflowError:
        as_float = math.inf
    if not math.isfinite(as_float):
        raise InvalidRequestError(f"{name} must be finite, got {value!r}")
    return as_float


def _require_int(name: str, value: object) -> int:
    """Return `value` if it is an int (bools are ints to Python but never what the client meant)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token from the logits."""

    temperature: float = 1.0  # 0 => greedy (argmax)
    top_p: float = 1.0  # (0, 1]
    top_k: int = -1  # -1 (or 0) => off
    min_p: float = 0.0  # [0, 1]
    seed: int | None = None  # per-request seed: same seed and position => same token
    logprobs: int = 0  # number of top logprobs to return, 0..MAX_LOGPROBS
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence among the generated tokens
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt+output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), sorted by id
    # Opt out of the server's speculative decoding (`engine.speculation`); the output is the same either way.
    disable_speculation: bool = False

    def __post_init__(self) -> None:
        # JSON and protobuf hand over a mapping; keep a sorted tuple so the params stay hashable.
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequestError naming the first field that is out of range.

        With `vocab_size`, logit_bias keys must also be below it.
        """
        temperature = _require_real("temperature", self.temperature)
        if temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}")
        top_p = _require_real("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if _require_int("top_k", self.top_k) < -1:
            raise InvalidRequestError(
                f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k!r}"
            )
        min_p = _require_real("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None:
            _require_int("seed", self.seed)
        if not 0 <= _require_int("logprobs", self.logprobs) <= MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if abs(_require_real(name, value)) > MAX_ADDITIVE_PENALTY:
                raise InvalidRequestError(
                    f"{name} must be in [-{MAX_ADDITIVE_PENALTY:g}, {MAX_ADDITIVE_PENALTY:g}], got {value!r}"
                )
        if _require_real("repetition_penalty", self.repetition_penalty) <= 0:
            raise InvalidRequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        self._validate_logit_bias(vocab_size)
        if not isinstance(self.disable_speculation, bool):
            raise InvalidRequestError(f"disable_speculation must be a bool, got {self.disable_speculation!r}")

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        if not isinstance(self.logit_bias, tuple):
            raise InvalidRequestError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
        for token_id, bias in self.logit_bias:
            _require_int("logit_bias token id", token_id)
            if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
                limit = f" and < {vocab_size}" if vocab_size is not None else ""
                raise InvalidRequestError(f"logit_bias token ids must be >= 0{limit}, got {token_id!r}")
            if abs(_require_real("logit_bias value", bias)) > MAX_LOGIT_BIAS:
                raise InvalidRequestError(
                    f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {bias!r} for token {token_id}"
                )

    @property
    def has_penalties(self) -> bool:
        """True when the sampler must look at this row's token history."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def is_greedy(self) -> bool:
        """True when the sampler takes the argmax and ignores top-k/top-p/min-p and the seed."""
        return self.temperature < GREEDY_TEMPERATURE_EPS


@dataclass(frozen=True)
class StoppingParams:
    """When a sequence ends. EOS and `stop_token_ids` end it after the token is generated; `stop`
    strings end it in the text, and the matched string is not part of the output."""

    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        # Callers building params from JSON or protobuf hand over lists (or one bare stop string, as
        # the OpenAI API allows); keep tuples so the params stay hashable and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequestError naming the first field that is out of range.

        With `vocab_size`, stop token ids must also be below it (an id the model can never produce
        would silently never stop anything).
        """
        if _require_int("max_tokens", self.max_tokens) < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if not isinstance(self.stop, tuple):
            raise InvalidRequestError(f"stop must be a sequence of strings, got {self.stop!r}")
        for stop in self.stop:
            if not isinstance(stop, str) or not stop:
                raise InvalidRequestError(f"stop strings must be non-empty strings, got {stop!r}")
        if not isinstance(self.stop_token_ids, tuple):
            raise InvalidRequestError(
                f"stop_token_ids must be a sequence of ints, got {self.stop_token_ids!r}"
            )
        for token_id in self.stop_token_ids:
            _require_int("stop_token_ids", token_id)
            if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
                limit = f" and < {vocab_size}" if vocab_size is not None else ""
                raise InvalidRequestError(f"stop_token_ids entries must be >= 0{limit}, got {token_id!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if _require_int("min_tokens", self.min_tokens) < 0:
            raise InvalidRequestError(f"min_tokens must be >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
