"""Streaming text out of a token stream: incremental detokenization and stop strings.

Both run once per generated token per sequence on the decode hot path, so each call does work
bounded by a short window of recent tokens (detokenizer) or by the longest stop string (matcher),
never by the length of the sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded as left context for the first generated tokens: enough for tokenizers whose
# decoders treat a sequence's first token specially (SentencePiece drops its leading space).
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns generated token ids, one at a time, into text deltas.

    It keeps two offsets into a window of recent tokens (the prefix/read-offset scheme): the text
    of tokens [prefix, read) has already been emitted; a new token's delta is what decoding
    [prefix, end) adds to decoding [prefix, read). Decoding from `prefix` rather than `read` gives
    the decoder the left context it needs (merged spaces, multi-byte characters). While the decoded
    tail ends in U+FFFD the token completed no character yet, so nothing is emitted and the offsets
    stay put until a later token completes it.

    For byte-level BPE tokenizers (GPT-2, Llama 3, Qwen2, SmolLM2) the concatenated deltas equal
    `tokenizer.decode(generated_ids)` (plus `flush()` if the sequence stopped inside a character).
    For SentencePiece tokenizers the first delta keeps the leading space that decoding the generated
    ids on their own would strip, because the prompt is its left context, so prompt text plus
    completion text reads right.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            # A prompt cut inside a character would make the first delta start mid-character.
            context = []
        self._tokens = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one generated token and return the text it completes (possibly "")."""
        self._tokens.append(token_id)
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._tokens[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            # A skipped special token, or a character still missing bytes: wait for more tokens.
            return ""
        # The tokens just emitted become the next window's context; drop what lies before them.
        del self._tokens[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Text held back at the end of the sequence (a character left incomplete, shown as U+FFFD)."""
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._tokens[self._prefix_offset :])
        del self._tokens[: self._read_offset]
        self._read_offset = len(self._tokens)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""


class StopStringMatcher:
    """Finds stop strings in streamed text and holds back text that could still begin one.

    The output never contains a stop string or anything after the first one (OpenAI/vLLM
    semantics). When several stop strings complete in the same delta, the one that ends first wins
    (ties: the longer one), which is the one a character-by-character stream would have hit first.
    After a match the matcher is spent: it emits nothing more.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._stop = tuple(stop)
        self._max_len = max((len(s) for s in self._stop), default=0)
        # Every proper prefix of a stop string: a buffer tail among them may still grow into a match.
        self._prefixes = frozenset(s[:i] for s in self._stop for i in range(1, len(s)))
        self._held = ""
        self._matched: str | None = None

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text, once one has."""
        return self._matched

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Take the next text delta; return (text safe to emit now, matched stop string or None)."""
        if self._matched is not None:
            return "", None
        if not self._stop:
            return delta, None
        text = self._held + delta
        match = self._earliest_match(text, search_from=max(0, len(self._held) - self._max_len + 1))
        if match is not None:
            start, stop = match
            self._matched = stop
            self._held = ""
            return text[:start], stop
        hold = self._held_back_length(text)
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], None

    def flush(self) -> str:
        """Release the held-back text when the sequence ends for another reason."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, text: str, search_from: int) -> tuple[int, str] | None:
        """(start, stop string) of the match that ends first in `text`, or None.

        Matches can only end in the new delta (the held text was checked before), so the search
        starts no earlier than one stop-string length before it.
        """
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self._stop:
            start = text.find(stop, search_from)
            if start >= 0:
                candidate = (start + len(stop), -len(stop), stop)
                if best is None or candidate < best:
                    best = candidate
        if best is None:
            return None
        end, _, stop = best
        return end - len(stop), stop

    def _held_back_length(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        for length in range(min(len(text), self._max_len - 1), 0, -1):
            if text[len(text) - length :] in self._prefixes:
                return length
        return 0
