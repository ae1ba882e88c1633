"""Tool-call parsers: turn what the model writes into tool calls, incrementally, delta by delta.

Two kinds, both fed each choice's answer text (after any reasoning was split off):

- The `--tool-call-parser` ones, for `tool_choice` auto, read the model's own format: `hermes`
  (Qwen2/2.5: `<tool_call>{"name": .., "arguments": {..}}</tool_call>`, several, text around),
  `llama3_json` (an answer that is `{"name": .., "parameters": {..}}`, optionally after `<|python_tag|>`,
  several separated by `;`) and `mistral` (`[TOOL_CALLS][{"name": .., "arguments": {..}}, ..]`). Each call
  is emitted once its JSON is complete; text that may be the start of a marker (`<tool_`) is held back
  until the next delta decides it, and flushed as text at the end. What does not parse as a call is text.
- The grammar-enforced ones, whose format `decode_service.front_door.constraints` compiles: `required`
  (a JSON array `[{"name": .., "arguments": {..}}, ..]`) and a named function (the arguments object
  itself). The grammar guarantees the shape, so their arguments stream as they are generated.

Every call's first delta carries its index, id and name; later deltas add pieces of its arguments.
"""

from __future__ import annotations

import abc
import json
import secrets
import string
from collections.abc import Callable

from decode_service.front_door import json_text
from decode_service.front_door.reasoning import held_prefix_length
from protos.tandem.v1 import generation_pb2 as pb

_ALPHANUMERIC = string.ascii_letters + string.digits


def openai_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def mistral_call_id() -> str:
    """Mistral's chat templates refuse tool-call ids other than 9 alphanumerics when the call comes back."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


Parsed = tuple[str, list[pb.ToolCallDelta]]  # (answer text, tool-call deltas)


class ToolParser(abc.ABC):
    """One choice's parser: `feed` every text delta, then `finish` once."""

    # Whether the calls start with a control token, which the text keeps only when asked to.
    reads_special_tokens = False

    def __init__(self, new_id: Callable[[], str] = openai_call_id) -> None:
        self.num_calls = 0
        self._new_id = new_id

    @abc.abstractmethod
    def feed(self, text: str) -> Parsed: ...

    @abc.abstractmethod
    def finish(self) -> Parsed: ...

    def _start_call(self, name: str, arguments: str = "") -> list[pb.ToolCallDelta]:
        """A new call's deltas as OpenAI streams them: its index, id and name first, then what is known of
        its arguments (if anything) in a delta of its own."""
        index = self.num_calls
        self.num_calls += 1
        deltas = [pb.ToolCallDelta(index=index, id=self._new_id(), name=name)]
        if arguments:
            deltas.append(pb.ToolCallDelta(index=index, arguments=arguments))
        return deltas


class _JsonString:
    """Whether JSON text read one character at a time is inside a string literal (escapes understood)."""

    def __init__(self) -> None:
        self.inside = False
        self._escape = False

    def step(self, char: str) -> bool:
        """Read `char`; True when it belongs to a string literal, its quotes included."""
        if self.inside:
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self.inside = False
            return True
        self.inside = char == '"'
        return self.inside


class _JsonObjectScanner:
    """Finds where a JSON object ends in a growing buffer, resuming where the last scan stopped."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._position = 0
        self._depth = 0
        self._string = _JsonString()

    def end(self, text: str) -> int | None:
        """The index just past the object that opens `text`, or None if it is not complete yet."""
        for position in range(self._position, len(text)):
            char = text[position]
            if self._string.step(char):
                continue
            if char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.reset()
                    return position + 1
        self._position = len(text)
        return None


def _call_fields(text: str, arguments_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a call written as a JSON object; None when it is not one.

    The model may write anything: JSON nested too deeply to parse or to pass on is not a call, and
    neither is a name or string arguments holding a lone surrogate (`"\\ud800"`), which no response can
    encode; arguments given as an object keep such an escape as they were written."""
    try:
        call = json_text.loads(text, keep_lone_surrogates=True)
    except json_text.JsonTextError:
        return None
    if (
        not isinstance(call, dict)
        or not isinstance(name := call.get("name"), str)
        or not json_text.encodes(name)
    ):
        return None
    arguments = next((call[key] for key in arguments_keys if key in call), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string already
        return (name, arguments) if json_text.encodes(arguments) else None
    if json_text.lone_surrogate_path(arguments) is not None:
        return name, json.dumps(arguments)  # ASCII: the surrogate stays an escape
    return name, json.dumps(arguments, ensure_ascii=False)


class _AutoParser(ToolParser):
    """What the model-format parsers share: blank text between and after calls is dropped, as vLLM does."""

    def __init__(self, new_id: Callable[[], str] = openai_call_id) -> None:
        super().__init__(new_id)
        self._blank = ""

    def _text(self, text: str) -> str:
        if self.num_calls and not text.strip():
            self._blank += text
            return ""
        text, self._blank = self._blank + text, ""
        return text

    def _call(self, body: str, arguments_keys: tuple[str, ...]) -> list[pb.ToolCallDelta] | None:
        fields = _call_fields(body, arguments_keys)
        if fields is None:
            return None
        self._blank = ""
        return self._start_call(*fields)


class HermesParser(_AutoParser):
    """`<tool_call>{"name": .., "arguments": {..}}</tool_call>`, any number, with text around them."""

    START = "<tool_call>"
    END = "</tool_call>"

    def __init__(self, new_id: Callable[[], str] = openai_call_id) -> None:
        super().__init__(new_id)
        self._buffer = ""
        self._inside = False

    def feed(self, text: str) -> Parsed:
        buffer = self._buffer + text
        out: list[str] = []
        calls: list[pb.ToolCallDelta] = []
        while True:
            if not self._inside:
                start = buffer.find(self.START)
                if start < 0:
                    held = held_prefix_length(buffer, self.START)
                    out.append(self._text(buffer[: len(buffer) - held]))
                    buffer = buffer[len(buffer) - held :]
                    break
                out.append(self._text(buffer[:start]))
                buffer = buffer[start + len(self.START) :]
                self._inside = True
            else:
                end = buffer.find(self.END)
                if end < 0:
                    break
                body, buffer = buffer[:end], buffer[end + len(self.END) :]
                self._inside = False
                call = self._call(body, ("arguments", "parameters"))
                if call is None:
                    out.append(self._text(self.START + body + self.END))
                else:
                    calls.extend(call)
        self._buffer = buffer
        return "".join(out), calls

    def finish(self) -> Parsed:
        buffer, self._buffer = self._buffer, ""
        if self._inside:  # a call the answer did not close: a call if its JSON is whole, else text
            self._inside = False
            call = self._call(buffer, ("arguments", "parameters"))
            if call is not None:
                return "", call
            buffer = self.START + buffer
        return self._text(buffer) if buffer.strip() or not self.num_calls else "", []


class _JsonCallsParser(_AutoParser):
    """JSON call objects after an opening marker, separated by `separators`; anything else is text."""

    OPENERS: tuple[str, ...] = ()
    SEPARATORS = ""

    def __init__(self, new_id: Callable[[], str] = openai_call_id) -> None:
        super().__init__(new_id)
        self._buffer = ""
        self._in_calls = False
        self._scanner = _JsonObjectScanner()

    def feed(self, text: str) -> Parsed:
        self._buffer += text
        out: list[str] = []
        calls: list[pb.ToolCallDelta] = []
        while self._buffer:
            if not self._in_calls:
                if not self._open(out):
                    break
                continue
            stripped = self._buffer.lstrip(self.SEPARATORS + " \t\r\n")
            if stripped != self._buffer:
                self._buffer = stripped
                self._scanner.reset()
                continue
            if not self._buffer.startswith("{"):
                self._in_calls = False
                continue
            end = self._scanner.end(self._buffer)
            if end is None:
                break
            call = self._call(self._buffer[:end], ("arguments", "parameters"))
            if call is None:
                self._in_calls = False  # not a call after all: the rest of the answer is text
                continue
            calls.extend(call)
            self._buffer = self._buffer[end:]
        return "".join(out), calls

    @abc.abstractmethod
    def _open(self, out: list[str]) -> bool:
        """Move text before the calls from the buffer to `out`; True once the calls begin."""

    def finish(self) -> Parsed:
        buffer, self._buffer = self._buffer, ""
        self._scanner.reset()
        if self._in_calls and buffer.strip():
            call = self._call(buffer.strip(), ("arguments", "parameters"))
            if call is not None:
                return "", call
        return self._text(buffer), []


class Llama3JsonParser(_JsonCallsParser):
    """An answer that opens with `{` (or `<|python_tag|>`): `{"name": .., "parameters": {..}}; ..`."""

    PYTHON_TAG = "<|python_tag|>"
    SEPARATORS = ";"

    def __init__(self, new_id: Callable[[], str] = openai_call_id) -> None:
        super().__init__(new_id)
        self._decided = False

    def _open(self, out: list[str]) -> bool:
        if self._decided:  # the answer is text from here on
            out.append(self._text(self._buffer))
            self._buffer = ""
            return False
        stripped = self._buffer.lstrip()
        if stripped.startswith(self.PYTHON_TAG) or stripped.startswith("{"):
            self._buffer = stripped.removeprefix(self.PYTHON_TAG)
            self._decided = self._in_calls = True
            return True
        if not stripped or self.PYTHON_TAG.startswith(stripped):
            return False  # undecided: hold it
        self._decided = True
        return True


class MistralParser(_JsonCallsParser):
    """`[TOOL_CALLS]` then a JSON array of calls (or call objects); text before it is the answer's text."""

    MARKER = "[TOOL_CALLS]"
    SEPARATORS = "[],"
    reads_special_tokens = True

    def __init__(self, new_id: Callable[[], str] = mistral_call_id) -> None:
        super().__init__(new_id)

    def _open(self, out: list[str]) -> bool:
        start = self._buffer.find(self.MARKER)
        if start < 0:
            held = held_prefix_length(self._buffer, self.MARKER)
            out.append(self._text(self._buffer[: len(self._buffer) - held]))
            self._buffer = self._buffer[len(self._buffer) - held :]
            return False
        out.append(self._text(self._buffer[:start]))
        self._buffer = self._buffer[start + len(self.MARKER) :]
        self._in_calls = True
        return True


class NamedCallParser(ToolParser):
    """A named `tool_choice`: the grammar makes the whole answer that function's arguments object."""

    def __init__(self, name: str, new_id: Callable[[], str] = openai_call_id) -> None:
        super().__init__(new_id)
        self._name = name

    def feed(self, text: str) -> Parsed:
        if not text:
            return "", []
        if self.num_calls == 0:
            return "", self._start_call(self._name, text)
        return "", [pb.ToolCallDelta(index=0, arguments=text)]

    def finish(self) -> Parsed:
        return "", []


class RequiredCallsParser(ToolParser):
    """`tool_choice` required: the grammar makes the answer `[{"name": .., "arguments": {..}}, ..]`.

    Tracks JSON string, escape and nesting state character by character, so each call is announced as
    soon as its name is complete and its arguments stream as they are generated.
    """

    def __init__(self, new_id: Callable[[], str] = openai_call_id) -> None:
        super().__init__(new_id)
        self._depth = 0
        self._quoted = _JsonString()
        self._string: list[str] = []  # the key or name string being read (depth 2 only)
        self._expect_key = False
        self._key: str | None = None
        self._name: str | None = None
        self._arguments_pending = False  # after "arguments": and before its value
        self._arguments_depth: int | None = None  # set while inside the arguments value
        self._unsent = ""  # arguments written before the call's name (sent with it)
        self._started = False

    def feed(self, text: str) -> Parsed:
        deltas: list[pb.ToolCallDelta] = []
        pieces: list[str] = []
        for char in text:
            if self._arguments_pending and not char.isspace():
                self._arguments_pending = False
                self._arguments_depth = self._depth
            if self._arguments_depth is not None:
                if self._arguments_char(char):
                    pieces.append(char)
                    if self._arguments_depth is None:  # the arguments' last character
                        self._send(pieces, deltas)
                    continue
                self._send(pieces, deltas)
            self._structure_char(char, pieces, deltas)
        self._send(pieces, deltas)
        return "", deltas

    def _arguments_char(self, char: str) -> bool:
        """Advance through the arguments value; False when `char` is past its end (not part of it)."""
        if self._quoted.step(char):
            return True
        base = self._arguments_depth
        if char in "{[":
            self._depth += 1
        elif char in "}]":
            if self._depth == base:  # a scalar value ended by its object's close
                self._arguments_depth = None
                return False
            self._depth -= 1
            if self._depth == base:
                self._arguments_depth = None
        elif char == "," and self._depth == base:
            self._arguments_depth = None
            return False
        return True

    def _structure_char(self, char: str, pieces: list[str], deltas: list[pb.ToolCallDelta]) -> None:
        """The array and call objects around the arguments: reads keys and the name."""
        was_quoted = self._quoted.inside
        if self._quoted.step(char):
            if not was_quoted:  # the opening quote
                self._string = []
            elif self._quoted.inside:
                self._string.append(char)
            else:
                self._string_done(pieces, deltas)
        elif char in "{[":
            self._depth += 1
            if self._depth == 2:
                self._expect_key, self._key, self._name, self._started = True, None, None, False
        elif char in "}]":
            self._depth -= 1
            if self._depth == 1 and not self._started and self._name is not None:
                self._announce(pieces, deltas)
        elif self._depth == 2 and char == ":":
            self._expect_key = False
            self._arguments_pending = self._key == "arguments"
        elif self._depth == 2 and char == ",":
            self._expect_key = True

    def _string_done(self, pieces: list[str], deltas: list[pb.ToolCallDelta]) -> None:
        if self._depth != 2:
            return
        value = json.loads('"' + "".join(self._string) + '"')
        if self._expect_key:
            self._key = value
        elif self._key == "name":
            self._name = value
            self._announce(pieces, deltas)

    def _announce(self, pieces: list[str], deltas: list[pb.ToolCallDelta]) -> None:
        """The call's first delta, carrying the arguments written before its name, if any."""
        self._send(pieces, deltas)
        deltas.extend(self._start_call(self._name or "", self._unsent))
        self._unsent = ""
        self._started = True

    def _send(self, pieces: list[str], deltas: list[pb.ToolCallDelta]) -> None:
        if not pieces:
            return
        text = "".join(pieces)
        pieces.clear()
        if self._started:
            deltas.append(pb.ToolCallDelta(index=self.num_calls - 1, arguments=text))
        else:
            self._unsent += text

    def finish(self) -> Parsed:
        return "", []


TOOL_CALL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}
