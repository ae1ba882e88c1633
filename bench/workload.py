"""What a benchmark sends: a seeded list of requests (prompt tokens, exact output length) and when.

Every system in a comparison gets the very same requests, so prompts are token ids (exact lengths on
every engine that shares the tokenizer) and outputs are exact lengths (`ignore_eos`). Synthetic prompts
are random token ids; their content does not matter for speed, only their length does. Output lengths
come from a distribution because their variance is what static batching suffers from: a static batch
runs until its longest member is done while the short ones sit finished.

Distributions are written `fixed:N`, `uniform:LO:HI` (inclusive) or `exp:MEAN:CAP` (exponential with
that mean, rounded, clipped to [1, CAP]). Arrivals are a request rate with Poisson (burstiness 1) or
gamma inter-arrival times, or all at once (rate `inf`); a concurrency cap is applied by the runner.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from base.errors import TandemError

# Skip the first ids of the vocabulary when drawing random prompts: BPE vocabularies keep their special
# and control tokens there, and a prompt full of <|im_end|> is not a prompt any server sees.
DEFAULT_MIN_TOKEN_ID = 100


class WorkloadError(TandemError, ValueError):
    """A workload description (distribution, file, arrival process) is malformed; the CLI reports it
    as a one-line error."""


@dataclass(frozen=True)
class LengthDistribution:
    """A distribution of token counts, parsed from `fixed:N`, `uniform:LO:HI` or `exp:MEAN:CAP`."""

    kind: str
    params: tuple[float, ...]

    @classmethod
    def parse(cls, text: str) -> LengthDistribution:
        kind, *raw = text.strip().split(":")
        arity = {"fixed": 1, "uniform": 2, "exp": 2}
        if kind not in arity or len(raw) != arity[kind]:
            raise WorkloadError(f"length distribution {text!r}: use fixed:N, uniform:LO:HI or exp:MEAN:CAP")
        try:
            params = tuple(float(value) for value in raw)
        except ValueError:
            raise WorkloadError(f"length distribution {text!r} has a non-numeric parameter") from None
        if any(p < 1 for p in params) or (kind == "uniform" and params[0] > params[1]):
            raise WorkloadError(f"length distribution {text!r}: lengths must be >= 1 and LO <= HI")
        return cls(kind, params)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.params[0])
        if self.kind == "uniform":
            return rng.randint(int(self.params[0]), int(self.params[1]))
        mean, cap = self.params
        return max(1, min(int(cap), round(rng.expovariate(1.0 / mean))))

    @property
    def upper_bound(self) -> int:
        return int(self.params[0] if self.kind == "fixed" else self.params[1])

    def __str__(self) -> str:
        return ":".join([self.kind, *(f"{p:g}" for p in self.params)])


@dataclass(frozen=True)
class WorkloadRequest:
    """One request: its prompt as token ids and the exact number of tokens to generate."""

    index: int
    prompt_token_ids: tuple[int, ...]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class SyntheticWorkload:
    """A seeded generator of random-token prompts; the same spec always yields the same requests."""

    num_requests: int
    prompt_len: LengthDistribution
    output_len: LengthDistribution
    vocab_size: int
    seed: int = 0
    min_token_id: int = DEFAULT_MIN_TOKEN_ID

    def requests(self) -> list[WorkloadRequest]:
        if self.vocab_size <= self.min_token_id:
            raise WorkloadError(f"vocab_size {self.vocab_size} leaves no ids above {self.min_token_id}")
        rng = random.Random(self.seed)
        out = []
        for index in range(self.num_requests):
            prompt_len = self.prompt_len.sample(rng)
            prompt = tuple(rng.randrange(self.min_token_id, self.vocab_size) for _ in range(prompt_len))
            out.append(WorkloadRequest(index, prompt, self.output_len.sample(rng)))
        return out

    def describe(self) -> dict:
        return {
            "source": "synthetic",
            "num_requests": self.num_requests,
            "prompt_len": str(self.prompt_len),
            "output_len": str(self.output_len),
            "seed": self.seed,
            "vocab_size": self.vocab_size,
            "min_token_id": self.min_token_id,
        }


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


def load_jsonl(
    path: Path,
    encoder: Encoder | None,
    default_output_len: LengthDistribution,
    seed: int = 0,
    num_requests: int | None = None,
) -> list[WorkloadRequest]:
    """Requests from a JSONL file: one object a line with `prompt` (text) or `prompt_token_ids`, and
    optionally `output_len`; a missing `output_len` is drawn from `default_output_len` (seeded)."""
    rng = random.Random(seed)
    requests = []
    for line_number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{path}:{line_number}: not JSON: {exc}") from None
        if "prompt_token_ids" in item:
            prompt = tuple(int(t) for t in item["prompt_token_ids"])
        elif "prompt" in item:
            if encoder is None:
                raise WorkloadError(f"{path}:{line_number}: a text prompt needs a tokenizer (--tokenizer)")
            prompt = tuple(encoder.encode(str(item["prompt"])))
        else:
            raise WorkloadError(f"{path}:{line_number}: needs 'prompt' or 'prompt_token_ids'")
        output_len = int(item["output_len"]) if "output_len" in item else default_output_len.sample(rng)
        if not prompt or output_len < 1:
            raise WorkloadError(f"{path}:{line_number}: empty prompt or output_len < 1")
        requests.append(WorkloadRequest(len(requests), prompt, output_len))
        if num_requests is not None and len(requests) == num_requests:
            break
    if not requests:
        raise WorkloadError(f"{path} holds no requests")
    return requests


@dataclass(frozen=True)
class ArrivalProcess:
    """When requests are sent: `rate` requests/s (inf: all at once), gamma-distributed gaps of shape
    `burstiness` (1.0 is Poisson; lower is burstier, higher is more regular)."""

    rate: float = math.inf
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise WorkloadError(f"request rate must be > 0 (inf: all at once), got {self.rate}")
        if not self.burstiness > 0:
            raise WorkloadError(f"burstiness must be > 0, got {self.burstiness}")

    def offsets(self, count: int) -> list[float]:
        """Send times in seconds from the start, one per request, non-decreasing, the first at 0."""
        if math.isinf(self.rate):
            return [0.0] * count
        rng = random.Random(self.seed)
        scale = 1.0 / (self.rate * self.burstiness)
        times, now = [], 0.0
        for index in range(count):
            if index:
                now += rng.gammavariate(self.burstiness, scale)
            times.append(now)
        return times

    def describe(self) -> dict:
        return {"request_rate": "inf" if math.isinf(self.rate) else self.rate, "burstiness": self.burstiness}


def workload_summary(requests: Sequence[WorkloadRequest]) -> dict:
    """Token totals of a request list, for result files and the physical-limit estimate."""
    prompt = [r.prompt_len for r in requests]
    output = [r.output_len for r in requests]
    return {
        "num_requests": len(requests),
        "prompt_tokens": sum(prompt),
        "output_tokens": sum(output),
        "prompt_len_min": min(prompt),
        "prompt_len_max": max(prompt),
        "output_len_min": min(output),
        "output_len_max": max(output),
    }
