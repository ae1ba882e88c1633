"""A choice's answer as its client sees it: the engine's tokens made into text, cut at stop strings.

The engine decides only what token ids mean to it (stop tokens, EOS, a grammar's end, length); text,
and the stop strings matched against it, are made here in the front door, so an engine step never
detokenizes (and, with the engine in a process of its own, only token ids cross between the two).
When a stop string matches, the front door ends the choice for its client at once and has the engine
stop it; a token or two the engine made meanwhile are dropped. Both run once per generated token per
choice, so each call does work bounded by a short window of recent tokens (`IncrementalDetokenizer`) or
by the new text (`StopStringMatcher`), never by the length of the sequence or the number of stop strings.

Then the text is split into (answer text, reasoning text, tool-call deltas), for both front doors:
`Generation` runs one `AnswerParser` per choice on its text deltas when the request needs one: a
server `--reasoning-parser` on a chat request, or tools with a `tool_choice` that calls them. Every
other request never builds one and its messages are sent as the engine made them.

Which tool parser applies: `tool_choice` auto (or unset, with tools) uses the server's
`--tool-call-parser` and is refused without one, as vLLM refuses it; required and a named function use the
formats their grammar enforces; none parses nothing. An answer that made calls and stopped ends with
finish reason TOOL_CALLS whatever the choice, named included (OpenAI says "stop" for a named choice): one
rule, "the answer holds calls", is what agent loops test, on both APIs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache, partial

from decode_service.front_door.constraints import ConstraintError
from decode_service.front_door.reasoning import ReasoningEnd, ReasoningParser, make_reasoning_parser
from decode_service.front_door.tool_parsers import (
    TOOL_CALL_PARSERS,
    NamedCallParser,
    RequiredCallsParser,
    ToolParser,
)
from engine.params import StoppingParams
from engine.tokenizer import Tokenizer
from protos.tandem.v1 import generation_pb2 as pb

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


@dataclass
class TextPiece:
    """What `ChoiceText.feed` made of some tokens: the text to send, how many of the tokens the client
    gets (fewer when a stop string matched before the last), and the stop string matched, if one did."""

    text: str
    num_tokens: int
    stop: str | None = None


class ChoiceText:
    """The text of one choice, token by token (prompt tokens give the detokenizer its context).

    With `reasoning_end_id` (the token a grammar waits for) it notes where that token's text lies in the
    choice's text, `reasoning_end`, for the reasoning parser to split there as the grammar does.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        prompt_token_ids: Sequence[int],
        stopping: StoppingParams,
        skip_special_tokens: bool,
        reasoning_end_id: int | None = None,
    ) -> None:
        self._detokenizer = (
            IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
            if tokenizer is not None
            else None
        )
        self._reasoning_end_id = reasoning_end_id if tokenizer is not None else None
        self._reasoning_end_text = (
            tokenizer.decode([reasoning_end_id], skip_special_tokens)
            if tokenizer is not None and reasoning_end_id is not None
            else ""
        )
        # Characters the detokenizer made so far; stop strings only hold back or cut the end of them.
        self._made = 0
        self.reasoning_end: ReasoningEnd | None = None
        self._matcher = StopStringMatcher(stopping.stop) if stopping.stop else None
        self._min_tokens = stopping.min_tokens
        # Tokens the client was given: the completion's length as the client sees it.
        self.num_tokens = 0
        self.stopped_at: str | None = None

    def feed(self, token_ids: Sequence[int], finish: str | None) -> TextPiece:
        """The text of `token_ids`, this choice's next tokens from the engine (`finish`: why the engine
        ended the choice with the last of them, if it did: "stop", "length" or "abort").

        Order as the engine's rules meet them: a stop token, EOS or a grammar's end (the engine's STOP)
        ends the choice without its own text; a stop string ends it with the text before the match
        (before `min_tokens` it is not a stop: its text goes out); a length limit with all text held back.
        """
        pieces = []
        last = len(token_ids) - 1
        for position, token_id in enumerate(token_ids):
            self.num_tokens += 1
            if position == last and finish == "stop":
                pieces.append(self._flush())
                return TextPiece("".join(pieces), len(token_ids))
            text = self._detokenizer.add(token_id) if self._detokenizer is not None else ""
            self._made += len(text)
            if token_id == self._reasoning_end_id and self.reasoning_end is None:
                # Its text ends what it completed (a character it followed may come out with it).
                own = len(self._reasoning_end_text) if text.endswith(self._reasoning_end_text) else 0
                self.reasoning_end = (self._made - own, self._made)
            if self._matcher is not None:
                text, matched = self._matcher.feed(text, can_stop=self.num_tokens >= self._min_tokens)
                if matched is not None:
                    pieces.append(text)
                    self.stopped_at = matched
                    return TextPiece("".join(pieces), position + 1, matched)
            pieces.append(text)
        if finish == "length":
            pieces.append(self._flush())
        return TextPiece("".join(pieces), len(token_ids))

    def _flush(self) -> str:
        """Text held back at the end: an incomplete character, a possible start of a stop string."""
        tail = self._detokenizer.flush() if self._detokenizer is not None else ""
        if self._matcher is None:
            return tail
        text, _ = self._matcher.feed(tail)
        return text + self._matcher.flush()


Parsed = tuple[str, str, list[pb.ToolCallDelta]]  # (answer text, reasoning text, tool-call deltas)


class AnswerParser:
    """One choice's parser: `feed` each text delta, `finish` once at the end."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self._reasoning = reasoning
        self._tools = tools

    @property
    def made_calls(self) -> bool:
        return self._tools is not None and self._tools.num_calls > 0

    def feed(self, text: str, reasoning_end: ReasoningEnd | None = None) -> Parsed:
        """Split the next text delta; `reasoning_end` is `ChoiceText.reasoning_end`, once known."""
        reasoning = ""
        if self._reasoning is not None:
            text, reasoning = self._reasoning.feed(text, reasoning_end)
        if self._tools is None or not text:
            return text, reasoning, []
        text, calls = self._tools.feed(text)
        return text, reasoning, calls

    def finish(self) -> Parsed:
        """What was held back, flushed: unfinished markers become text, a whole unclosed call a call."""
        text, reasoning = self._reasoning.finish() if self._reasoning is not None else ("", "")
        if self._tools is None:
            return text, reasoning, []
        text, calls = self._tools.feed(text) if text else ("", [])
        rest, more_calls = self._tools.finish()
        return text + rest, reasoning, calls + more_calls


def _tool_parser_factory(
    request: pb.GenerateRequest, tool_call_parser: str | None
) -> Callable[[], ToolParser] | None:
    if not request.tools:
        return None
    choice = request.tool_choice.WhichOneof("choice") if request.HasField("tool_choice") else None
    if choice == "function_name":
        return partial(NamedCallParser, request.tool_choice.function_name)
    mode = request.tool_choice.mode if choice == "mode" else pb.TOOL_CHOICE_AUTO
    if mode == pb.TOOL_CHOICE_REQUIRED:
        return RequiredCallsParser
    if mode == pb.TOOL_CHOICE_NONE:
        return None
    if tool_call_parser is None:
        raise ConstraintError(
            "tool_choice",
            "auto (the default when tools are given) needs a server started with --tool-call-parser; "
            "send tool_choice required, none or a named function instead",
        )
    return TOOL_CALL_PARSERS[tool_call_parser]


def keeps_special_tokens(request: pb.GenerateRequest, tool_call_parser: str | None) -> bool:
    """Whether `request`'s tool parser reads a control token (mistral's [TOOL_CALLS]) that the text would
    otherwise leave out, as vLLM turns skip_special_tokens off for such parsers."""
    try:
        parser = _tool_parser_factory(request, tool_call_parser)
    except ConstraintError:
        return False
    return isinstance(parser, type) and parser.reads_special_tokens


def answer_parser_factory(
    request: pb.GenerateRequest, tool_call_parser: str | None, reasoning_parser: str | None
) -> Callable[[], AnswerParser] | None:
    """What makes each choice's parser, or None when the request's text passes through untouched.

    Cheap, no tokenizing: call it before the request takes a slot. Raises `ConstraintError` for auto tool
    choice on a server without a tool-call parser. Reasoning is parsed on chat requests only: a raw
    prompt's answer is returned as written, as vLLM's completions API does.
    """
    tools = _tool_parser_factory(request, tool_call_parser)
    reasoning = reasoning_parser if reasoning_parser is not None and request.messages else None
    if tools is None and reasoning is None:
        return None

    def make(grammar_waits: bool | None = None) -> AnswerParser:
        """`grammar_waits`: whether the request's grammar waits for the reasoning's end token (None: it
        has none; see `make_reasoning_parser`)."""
        return AnswerParser(
            make_reasoning_parser(reasoning, grammar_waits) if reasoning is not None else None,
            tools() if tools is not None else None,
        )

    return make
