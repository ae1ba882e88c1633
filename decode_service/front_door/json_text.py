"""JSON text from outside the server, parsed with bounds: request bodies, the JSON inside request string
fields (schemas, tool parameters, earlier calls' arguments, template kwargs) and the model's tool calls.

`json.loads` alone lets through two things that fail later, far from the field at fault, as a 500:
- nesting: the parser stops only at Python's recursion limit (a RecursionError, not a ValueError), and
  a value nested just below it still breaks whatever walks it next (a chat template's `tojson`, a
  schema converter); so nesting is bounded at `MAX_NESTING`, well above what real schemas use;
- lone UTF-16 surrogates: `"\\ud800"` is valid JSON but no text, so it cannot be encoded into a
  prompt, a protobuf string or a response; they are refused unless the caller keeps them.

Every refusal is a `JsonTextError` whose message completes "<field> ...", for the caller to name its field.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

# Arrays and objects inside one another, at most; pydantic's deepest schemas use a few dozen.
MAX_NESTING = 128

# JSON string literals (in valid JSON text), whose brackets do not nest anything.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in b"[]{}")
_BRACKET_STEPS = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
# An escape that may decode to half of a surrogate pair.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE_ESCAPE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]")


class JsonTextError(ValueError):
    """JSON text the server will not take; the message completes "<field> ..."."""


class TooDeepError(JsonTextError):
    def __init__(self, max_nesting: int) -> None:
        super().__init__(f"nests arrays or objects too deeply (more than {max_nesting} levels)")


class LoneSurrogateError(JsonTextError):
    """`path` is where the surrogate is, `field.key[0]` style ("" for the top level or a top-level key)."""

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__("holds a lone UTF-16 surrogate" + (f" at {path}" if path else ""))


def loads(
    text: str | bytes | bytearray,
    *,
    max_nesting: int = MAX_NESTING,
    keep_lone_surrogates: bool = False,
    **loads_kwargs: Any,
) -> Any:
    """`json.loads(text, **loads_kwargs)`, refusing more than `max_nesting` levels and (unless
    `keep_lone_surrogates`) lone surrogates; invalid JSON is a JsonTextError too. Exceptions the
    hooks in `loads_kwargs` raise, other than ValueError, pass through."""
    try:
        value = json.loads(text, **loads_kwargs)
    except RecursionError:
        raise TooDeepError(max_nesting) from None
    except ValueError as exc:
        raise JsonTextError(f"is not valid JSON: {exc}") from None
    if _openings(text) > max_nesting and nesting_depth(text) > max_nesting:
        raise TooDeepError(max_nesting)
    if not keep_lone_surrogates and _may_hold_surrogates(text):
        path = lone_surrogate_path(value)
        if path is not None:
            raise LoneSurrogateError(path)
    return value


def nesting_depth(text: str | bytes | bytearray) -> int:
    """How deep arrays and objects nest in valid JSON `text` (0 for a scalar)."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    return max(itertools.accumulate(map(_BRACKET_STEPS.__getitem__, brackets)), default=0)


def _openings(text: str | bytes | bytearray) -> int:
    """How many arrays and objects `text` opens at most (brackets in strings count too): cheap."""
    if isinstance(text, str):
        return text.count("[") + text.count("{")
    return text.count(b"[") + text.count(b"{")


def _may_hold_surrogates(text: str | bytes | bytearray) -> bool:
    if isinstance(text, str):
        return _SURROGATE_ESCAPE.search(text) is not None
    return _SURROGATE_ESCAPE_BYTES.search(text) is not None


def lone_surrogate_path(value: object) -> str | None:
    """Where the first string (or key) under `value` holding a lone surrogate is, `a.b[0]` style: the
    value's own path, or its object's for a key ("" at the top level); None when there is none."""
    pending: list[tuple[object, str]] = [(value, "")]
    while pending:
        item, path = pending.pop()
        if isinstance(item, str):
            if not encodes(item):
                return path
        elif isinstance(item, list):
            indexed = [(element, f"{path}[{index}]") for index, element in enumerate(item)]
            pending.extend(reversed(indexed))
        elif isinstance(item, dict):
            for key in item:
                if not encodes(key):
                    return path
            children = [(element, f"{path}.{key}" if path else key) for key, element in item.items()]
            pending.extend(reversed(children))
    return None


def encodes(text: str) -> bool:
    """Whether `text` is text: no lone surrogate, so it encodes as UTF-8."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
