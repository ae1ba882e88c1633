"""A choice's answer as its client sees it: the engine's tokens made into text, cut at stop strings.

The engine decides only what token ids mean to it (stop tokens, EOS, a grammar's end, length); text,
and the stop strings matched against it, are made here in the front door, so an engine step never
detokenizes (and, with the engine in a process of its own, only token ids cross between the two).
When a stop string matches, the front door ends the choice for its client at once and has the engine
stop it; a token or two the engine made meanwhile are dropped.

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from decode_service.front_door.constraints import ConstraintError
from decode_service.front_door.reasoning import ReasoningEnd, ReasoningParser, make_reasoning_parser
from decode_service.front_door.tool_parsers import (
    TOOL_CALL_PARSERS,
    NamedCallParser,
    RequiredCallsParser,
    ToolParser,
)
from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.params import StoppingParams
from engine.tokenizer import Tokenizer
from protos.tandem.v1 import generation_pb2 as pb


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
