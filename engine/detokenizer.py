"""Streaming text out of a token stream: incremental detokenization and stop strings.

Both run once per generated token per sequence on the decode hot path, so each call does work
bounded by a short window of recent tokens (detokenizer) or by the new text (matcher), never by the
length of the sequence or the number of stop strings.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from functools import lru_cache

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

    A fast tokenizer runs that scheme in Rust (`Tokenizer.decode_stream`: one call per token instead
    of two decodes and their list copies); the window here is still kept, for `flush` and for a
    stream that gives up (it raises when a decoding is not an extension of the text before it).

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
        self._step = tokenizer.decode_stream(context, skip_special_tokens)
        self._tokens = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    @property
    def skip_special_tokens(self) -> bool:
        return self._skip_special_tokens

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one generated token and return the text it completes (possibly "")."""
        self._tokens.append(token_id)
        if self._step is not None:
            try:
                text = self._step(token_id)
            except Exception:
                self._step = None  # its state is lost: the window carries on from here
                return self._add_by_window()
            if text:
                self._emitted()
            return text or ""
        return self._add_by_window()

    def _add_by_window(self) -> str:
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._tokens[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            # A skipped special token, or a character still missing bytes: wait for more tokens.
            return ""
        self._emitted()
        return new_text[len(prefix_text) :]

    def _emitted(self) -> None:
        """The tokens just emitted become the next window's context; drop what lies before them."""
        del self._tokens[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)

    def flush(self) -> str:
        """Text held back at the end of the sequence (a character left incomplete, shown as U+FFFD)."""
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._tokens[self._prefix_offset :])
        del self._tokens[: self._read_offset]
        self._read_offset = len(self._tokens)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""


class StopAutomaton:
    """Aho-Corasick automaton over a set of stop strings, built once per distinct set and shared.

    A state is a trie node: the longest tail of the text seen so far that is a prefix of some stop
    string. So the state alone says how much text must be held back (its depth) and which stop string
    ends at the current character (the longest one, `match`). Memory is linear in the total length of
    the stop strings, and feeding a character costs amortized O(1) whatever their number.
    """

    def __init__(self, stop: tuple[str, ...]) -> None:
        # Edges of the trie in one dict keyed by (node, character): far smaller than a dict per node.
        self._edges: dict[tuple[int, str], int] = {}
        self.depth = [0]
        self.match: list[str | None] = [None]
        for string in stop:
            node = 0
            for char in string:
                child = self._edges.get((node, char))
                if child is None:
                    child = len(self.depth)
                    self._edges[(node, char)] = child
                    self.depth.append(self.depth[node] + 1)
                    self.match.append(None)
                node = child
            self.match[node] = string
        self._fail = [0] * len(self.depth)
        self._link_failures()
        # Text without any of these characters leaves the root state where it is (the common case).
        self.alphabet = frozenset(char for _, char in self._edges)

    def _link_failures(self) -> None:
        """Breadth-first: each node's failure link (longest proper suffix in the trie) and `match`
        (the longest stop string ending here: its own, else its failure link's)."""
        children: list[list[tuple[str, int]]] = [[] for _ in self.depth]
        for (parent, char), child in self._edges.items():
            children[parent].append((char, child))
        queue = deque(child for _, child in children[0])
        while queue:
            node = queue.popleft()
            for char, child in children[node]:
                self._fail[child] = self.step(self._fail[node], char)
                if self.match[child] is None:
                    self.match[child] = self.match[self._fail[child]]
                queue.append(child)

    def step(self, node: int, char: str) -> int:
        """The state after reading `char` in state `node`."""
        edges, fail = self._edges, self._fail
        while True:
            child = edges.get((node, char))
            if child is not None:
                return child
            if node == 0:
                return 0
            node = fail[node]


@lru_cache(maxsize=64)
def stop_automaton(stop: tuple[str, ...]) -> StopAutomaton:
    """The shared automaton of a stop set: most requests of a service send the same few stop lists."""
    return StopAutomaton(stop)


class StopStringMatcher:
    """Finds stop strings in streamed text and holds back text that could still begin one.

    The output never contains a stop string or anything after the first one (OpenAI/vLLM
    semantics). When several stop strings complete in the same delta, the one that ends first wins
    (ties: the longer one), which is the one a character-by-character stream would have hit first.
    After a match the matcher is spent: it emits nothing more. A match fed with `can_stop=False`
    (before `min_tokens`) is not taken: its text is emitted and the matcher stays armed.

    Each `feed` costs amortized O(len(delta)) plus copying at most the longest stop string.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._automaton = stop_automaton(tuple(stop)) if stop else None
        self._node = 0
        self._held = ""
        self._matched: str | None = None

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text, once one has."""
        return self._matched

    def feed(self, delta: str, can_stop: bool = True) -> tuple[str, str | None]:
        """Take the next text delta; return (text safe to emit now, matched stop string or None)."""
        if self._matched is not None:
            return "", None
        automaton = self._automaton
        if automaton is None:
            return delta, None
        node = self._node
        if node == 0 and automaton.alphabet.isdisjoint(delta):
            return delta, None
        text = self._held + delta
        match = automaton.match
        for index in range(len(self._held), len(text)):
            node = automaton.step(node, text[index])
            stop = match[node]
            if stop is not None and can_stop:
                self._matched, self._held, self._node = stop, "", 0
                return text[: index + 1 - len(stop)], stop
        self._node = node
        hold = automaton.depth[node]
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], None

    def flush(self) -> str:
        """Release the held-back text when the sequence ends for another reason."""
        held, self._held, self._node = self._held, "", 0
        return held
