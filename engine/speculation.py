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

A draft costs a forward over its tokens whether they are kept or not, so it is skipped where it does
not pay: in large batches (the step is no longer bound by reading the weights) and for a sequence whose
recent guesses were mostly wrong (it pauses, then tries again).
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
    num_speculative_tokens: int = 4
    # Lengths of the suffix looked up, longest first (vLLM's prompt_lookup_min/max).
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    # No drafts in a step that decodes more sequences than this (vLLM's speculative_disable_by_batch_size).
    disable_by_batch_size: int = 4
    # A sequence whose recent acceptance (the share of drafted tokens kept, smoothed) falls below this
    # stops drafting for `pause_steps` steps.
    min_acceptance: float = 0.3
    pause_steps: int = 16

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

    @property
    def enabled(self) -> bool:
        return self.method != "none"


class NgramDrafts:
    """One sequence's lookup table: each n-gram of its tokens -> where its latest occurrence ends.

    Sequences only grow, so the table is extended with the tokens appended since the last call and a
    lookup costs one dictionary probe per n-gram length. It also tracks how many of this sequence's
    guesses were kept, for the pause rule.
    """

    # Weight of the latest verification in the smoothed acceptance.
    _SMOOTHING = 0.25

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._latest_end: dict[tuple[int, ...], int] = {}
        # End positions (exclusive) indexed so far: every n-gram ending before it is in the table.
        self._indexed = 0
        self.acceptance = 1.0
        self._paused_steps = 0

    def propose(self, token_ids: SequenceOf[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest matching
        suffix of `token_ids` (empty when none occurred, or while paused)."""
        if self._paused_steps > 0:
            self._paused_steps -= 1
            return []
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
        """One verification's outcome; pauses drafting when acceptance has fallen too low."""
        self.acceptance += self._SMOOTHING * (num_accepted / num_drafted - self.acceptance)
        if self.acceptance < self.config.min_acceptance:
            self._paused_steps = self.config.pause_steps
            self.acceptance = self.config.min_acceptance


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
