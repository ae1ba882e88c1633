"""A choice's answer as its client sees it: the engine's tokens made into text, cut at stop strings.

The engine decides only what token ids mean to it (stop tokens, EOS, a grammar's end, length); text,
and the stop strings matched against it, are made here in the front door, so an engine step never
detokenizes (and, with the engine in a process of its own, only token ids cross between the two).
When a stop string matches, the front door ends the choice for its client at once and has the engine
stop it; a token or two the engine made meanwhile are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.params import StoppingParams
from engine.sequence import FinishReason
from engine.tokenizer import Tokenizer


@dataclass
class TextPiece:
    """What `ChoiceText.feed` made of some tokens: the text to send, how many of the tokens the client
    gets (fewer when a stop string matched before the last), and the stop string matched, if one did."""

    text: str
    num_tokens: int
    stop: str | None = None


class ChoiceText:
    """The text of one choice, token by token (prompt tokens give the detokenizer its context)."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        prompt_token_ids: Sequence[int],
        stopping: StoppingParams,
        skip_special_tokens: bool,
    ) -> None:
        self._detokenizer = (
            IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
            if tokenizer is not None
            else None
        )
        self._matcher = StopStringMatcher(stopping.stop) if stopping.stop else None
        self._min_tokens = stopping.min_tokens
        # Tokens the client was given: the completion's length as the client sees it.
        self.num_tokens = 0
        self.stopped_at: str | None = None

    def feed(self, token_ids: Sequence[int], finish: FinishReason | None) -> TextPiece:
        """The text of `token_ids`, this choice's next tokens from the engine (`finish`: why the engine
        ended the choice with the last of them, if it did).

        Order as the engine's rules meet them: a stop token, EOS or a grammar's end (the engine's STOP)
        ends the choice without its own text; a stop string ends it with the text before the match
        (before `min_tokens` it is not a stop: its text goes out); a length limit with all text held back.
        """
        pieces = []
        last = len(token_ids) - 1
        for position, token_id in enumerate(token_ids):
            self.num_tokens += 1
            if position == last and finish is FinishReason.STOP:
                pieces.append(self._flush())
                return TextPiece("".join(pieces), len(token_ids))
            text = self._detokenizer.add(token_id) if self._detokenizer is not None else ""
            if self._matcher is not None:
                text, matched = self._matcher.feed(text, can_stop=self.num_tokens >= self._min_tokens)
                if matched is not None:
                    pieces.append(text)
                    self.stopped_at = matched
                    return TextPiece("".join(pieces), position + 1, matched)
            pieces.append(text)
        if finish is FinishReason.LENGTH:
            pieces.append(self._flush())
        return TextPiece("".join(pieces), len(token_ids))

    def _flush(self) -> str:
        """Text held back at the end: an incomplete character, a possible start of a stop string."""
        tail = self._detokenizer.flush() if self._detokenizer is not None else ""
        if self._matcher is None:
            return tail
        text, _ = self._matcher.feed(tail)
        return text + self._matcher.flush()
