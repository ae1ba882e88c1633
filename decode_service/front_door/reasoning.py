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


class ReasoningParser:
    """One choice's splitter: `feed` each text delta, `finish` at the end; both return (answer, reasoning)."""

    def __init__(self, starts_in_reasoning: bool) -> None:
        # deepseek_r1 starts inside the reasoning (a leading <think> is still skipped); qwen3 does not.
        self._starts_in_reasoning = starts_in_reasoning
        self._state = _State.OPENING
        self._held = ""

    @property
    def in_reasoning(self) -> bool:
        return self._state is _State.REASONING

    def feed(self, text: str) -> tuple[str, str]:
        text = self._held + text
        self._held = ""
        if self._state is _State.OPENING:
            stripped = text.lstrip()
            if stripped.startswith(THINK_START):
                self._state = _State.REASONING
                text = stripped[len(THINK_START) :]
            elif THINK_START.startswith(stripped):
                self._held = text  # blank, or a start of <think>: undecided
                return "", ""
            elif self._starts_in_reasoning:
                self._state = _State.REASONING
            else:
                self._state = _State.ANSWER
        if self._state is _State.ANSWER:
            return text, ""
        end = text.find(THINK_END)
        if end >= 0:
            self._state = _State.ANSWER
            return text[end + len(THINK_END) :], text[:end]
        held = held_prefix_length(text, THINK_END)
        if held:
            self._held = text[-held:]
            text = text[:-held]
        return "", text

    def finish(self) -> tuple[str, str]:
        """What was held back: an unfinished marker is plain text of the part it was found in."""
        held, self._held = self._held, ""
        if self._state is _State.REASONING or (self._state is _State.OPENING and self._starts_in_reasoning):
            return "", held
        return held, ""


REASONING_PARSERS = {"deepseek_r1": True, "qwen3": False}  # name -> whether the answer starts in reasoning


def make_reasoning_parser(name: str) -> ReasoningParser:
    """A fresh parser for one choice; `name` is one of `REASONING_PARSERS` (checked by the config)."""
    return ReasoningParser(starts_in_reasoning=REASONING_PARSERS[name])
