"""Reasoning parsers: split what a reasoning model writes into its reasoning and its answer.

The front door runs them on each choice's text deltas (see `choice_text`), so the engine knows nothing
of them. The semantics are vLLM's (`--reasoning-parser`):

- `deepseek_r1`: the DeepSeek-R1 distills' chat template opens `<think>` in the prompt, so everything the
  model writes before `</think>` is reasoning, with or without a `<think>` of its own; an answer cut off
  before `</think>` is all reasoning.
- `qwen3`: reasoning only when the answer opens with `<think>` (Qwen3 with thinking off writes none);
  it lasts until `</think>` (or the end of a cut-off answer).

Text that may be the start of a marker (`</thi`) is held back until the next delta decides it, so a
marker split across tokens never leaks into either part.

A constrained request's grammar decides otherwise, and the split follows it, so that the answer the
client gets is exactly the text the grammar constrained. Its grammar waits for the reasoning's end TOKEN
(`engine.grammar`, `activate_after`): everything before that token is reasoning, whatever the parser's
rule or the text (a `</think>` the model spells with other tokens is still reasoning), and the answer
starts right after it; `ChoiceText` says where that token's text lies. A grammar that applies from the
first token (the prompt closed the reasoning: Qwen3's `enable_thinking: false`) makes all of it answer.
"""

from __future__ import annotations

import enum

THINK_START = "<think>"
THINK_END = "</think>"


class _State(enum.Enum):
    OPENING = "opening"  # before any non-blank text: a <think> here opens the reasoning
    REASONING = "reasoning"
    ANSWER = "answer"


def held_prefix_length(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker` (what to hold back)."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


ReasoningEnd = tuple[int, int]
"""Where the text of the token that ends the reasoning lies in the choice's whole text: (start, stop)."""


class ReasoningParser:
    """One choice's splitter: `feed` each text delta, `finish` at the end; both return (answer, reasoning).

    `ends_at_token`: the reasoning starts at once and ends at the end token (see the module's docstring),
    whose place `feed` is told; `answer_only`: there is no reasoning.
    """

    def __init__(
        self, starts_in_reasoning: bool, ends_at_token: bool = False, answer_only: bool = False
    ) -> None:
        # deepseek_r1 starts inside the reasoning (a leading <think> is still skipped); qwen3 does not.
        self._starts_in_reasoning = starts_in_reasoning or ends_at_token
        self._ends_at_token = ends_at_token
        self._state = _State.ANSWER if answer_only else _State.OPENING
        self._held = ""
        # Where in the choice's text the next delta starts (the held text lies just before it).
        self._position = 0

    @property
    def in_reasoning(self) -> bool:
        return self._state is _State.REASONING

    def feed(self, text: str, end: ReasoningEnd | None = None) -> tuple[str, str]:
        """Split the next text delta; `end`, once known, is where the end token's text lies (read only
        when the reasoning `ends_at_token`)."""
        start = self._position - len(self._held)
        self._position += len(text)
        text = self._held + text
        self._held = ""
        if self._state is _State.OPENING:
            stripped = text.lstrip()
            if stripped.startswith(THINK_START):
                self._state = _State.REASONING
                skipped = len(text) - len(stripped) + len(THINK_START)
                start, text = start + skipped, text[skipped:]
            elif THINK_START.startswith(stripped):
                self._held = text  # blank, or a start of <think>: undecided
                return "", ""
            elif self._starts_in_reasoning:
                self._state = _State.REASONING
            else:
                self._state = _State.ANSWER
        if self._state is _State.ANSWER:
            return text, ""
        if self._ends_at_token:
            return self._split_at_token(text, start, end)
        marker = text.find(THINK_END)
        if marker >= 0:
            self._state = _State.ANSWER
            return text[marker + len(THINK_END) :], text[:marker]
        held = held_prefix_length(text, THINK_END)
        if held:
            self._held = text[-held:]
            text = text[:-held]
        return "", text

    def _split_at_token(self, text: str, start: int, end: ReasoningEnd | None) -> tuple[str, str]:
        """Reasoning up to the end token's text, the answer after it; `text` starts at `start` in the
        choice's text. The token's text is neither, and what of it has come is held until all of it has
        (a stop string may hold its last characters back)."""
        if end is None:
            return "", text
        token_start, token_stop = end[0] - start, end[1] - start
        if token_stop > len(text):
            self._held = text[max(token_start, 0) :]
            return "", text[: max(token_start, 0)]
        self._state = _State.ANSWER
        return text[token_stop:], text[: max(token_start, 0)]

    def finish(self) -> tuple[str, str]:
        """What was held back: an unfinished marker is plain text of the part it was found in, an unfinished
        end token's text is dropped."""
        held, self._held = self._held, ""
        if self._state is _State.REASONING and self._ends_at_token:
            return "", ""
        if self._state is _State.REASONING or (self._state is _State.OPENING and self._starts_in_reasoning):
            return "", held
        return held, ""


REASONING_PARSERS = {"deepseek_r1": True, "qwen3": False}  # name -> whether the answer starts in reasoning


def make_reasoning_parser(name: str, grammar_waits: bool | None = None) -> ReasoningParser:
    """A fresh parser for one choice; `name` is one of `REASONING_PARSERS` (checked by the config).

    `grammar_waits` is None for a request without a grammar (the parser's own rule), True when its grammar
    waits for the end token (the reasoning ends there), False when it applies from the first token (all
    answer)."""
    return ReasoningParser(
        starts_in_reasoning=REASONING_PARSERS[name],
        ends_at_token=grammar_waits is True,
        answer_only=grammar_waits is False,
    )
