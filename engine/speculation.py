"""N-gram speculative decoding: draft tokens by looking the context up in itself, verify them in one step.

Agent and editing traffic copies: a rename repeats the code it was given, an extraction quotes the
document. When the last n tokens of a sequence occurred earlier in its prompt or output, the tokens
that followed that occurrence are a cheap guess at what comes next (vLLM's `ngram` method, llama.cpp's
lookup decoding). The decode step then computes the guessed tokens' KV alongside the sequence's own
token and samples after each of them; the guesses are kept while they equal what was sampled.

Sampling after a guess exactly as if the guess had been generated keeps the target distribution: the
draft is deterministic, so accepting guess d with probability p(d) and resampling from p with d
removed on rejection (the rejection-sampling rule for a point-mass draft) is the same as sampling from
p and comparing the result with d. Greedy output is therefore identical with speculation on or off,
and a seeded request draws the same noise at the same positions either way.

A draft costs a forward over its tokens whether they are kept or not, so each sequence drafts only as
many tokens as are likely to pay: it keeps a running estimate `a` of the chance that its next draft
token is kept, and a draft token j places ahead is worth `a**j` tokens against the cost of one more row
in the step. On a CPU a step's cost grows with its rows, each extra row costing `row_cost` of a
one-row step; in a step of B sequences a draft token pays when `a**j > B * row_cost / (1 + row_cost *
(B - 1))`: any likely token alone, only near-certain ones in a large batch. A sequence whose estimate
forbids drafting tries one token again every `probe_steps` steps, so a change in its text is noticed.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

from base.errors import ConfigError

METHODS = ("none", "ngram")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative` and its knobs (vLLM's names where it has them)."""

    method: str = "none"
    num_speculative_tokens: int = 3
    # Lengths of the suffix looked up, longest first (vLLM's prompt_lookup_min/max).
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 3
    # No drafts in a step that decodes more sequences than this (vLLM's speculative_disable_by_batch_size).
    disable_by_batch_size: int = 16
    # One more row in a decode step, as a share of a one-row step's time (SmolLM2-135M int8 on 2 AMD EPYC
    # cores: 3.5 of 13 ms; bench/README.md, "Speculative decoding").
    row_cost: float = 0.27
    # Where a sequence's estimate of its draft tokens' acceptance starts, and how fast it follows.
    initial_acceptance: float = 0.6
    smoothing: float = 0.2
    probe_steps: int = 16
    # Set from `method`: a plain attribute, read on every step.
    enabled: bool = field(init=False)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"--speculative must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ConfigError(f"--num-speculative-tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(
                "--prompt-lookup-min and --prompt-lookup-max must satisfy 1 <= min <= max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.disable_by_batch_size < 1:
            raise ConfigError(
                f"--speculative-disable-by-batch-size must be >= 1, got {self.disable_by_batch_size}"
            )
        object.__setattr__(self, "enabled", self.method != "none")


class NgramDrafts:
    """One sequence's lookup table (each n-gram of its tokens -> where its latest occurrence ends) and its
    estimate of how often its draft tokens are kept.

    Sequences only grow, so the table is extended with the tokens appended since the last call and a
    lookup costs one dictionary probe per n-gram length.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._latest_end: dict[tuple[int, ...], int] = {}
        # End positions (exclusive) indexed so far: every n-gram ending before it is in the table.
        self._indexed = 0
        self.acceptance = config.initial_acceptance
        self._steps_without_draft = 0

    def draft_length(self, batch_size: int) -> int:
        """How many draft tokens pay in a step decoding `batch_size` sequences (module docstring)."""
        config = self.config
        threshold = batch_size * config.row_cost / (1 + config.row_cost * (batch_size - 1))
        length, worth = 0, self.acceptance
        while length < config.num_speculative_tokens and worth > threshold:
            length += 1
            worth *= self.acceptance
        if length > 0:
            self._steps_without_draft = 0
            return length
        self._steps_without_draft += 1
        if self._steps_without_draft >= config.probe_steps:
            self._steps_without_draft = 0
            return 1
        return 0

    def propose(self, token_ids: SequenceOf[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest matching
        suffix of `token_ids` (empty when none occurred)."""
        config = self.config
        length = len(token_ids)
        # Index every n-gram that ends before the last token: the suffix itself must not match itself.
        for end in range(max(self._indexed, 1), length):
            for n in range(config.prompt_lookup_min, min(config.prompt_lookup_max, end) + 1):
                self._latest_end[tuple(token_ids[end - n : end])] = end
        self._indexed = max(self._indexed, length)
        for n in range(min(config.prompt_lookup_max, length - 1), config.prompt_lookup_min - 1, -1):
            end = self._latest_end.get(tuple(token_ids[length - n :]))
            if end is not None:
                return list(token_ids[end : end + limit])
        return []

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """One verification's outcome: each kept token and the first refused one are trials of the
        acceptance estimate (tokens after a refusal were never tried)."""
        outcomes = [1.0] * num_accepted + ([0.0] if num_accepted < num_drafted else [])
        for outcome in outcomes:
            self.acceptance += self.config.smoothing * (outcome - self.acceptance)


@dataclass
class SpeculationStats:
    """Counters in vLLM's terms: drafts verified, tokens drafted, tokens accepted (per draft position)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafted:
            self.accepted_per_position.extend([0] * (num_drafted - len(self.accepted_per_position)))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
