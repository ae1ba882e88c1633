r"""String patterns in a JSON schema, made safe to enforce inside JSON before xgrammar compiles them.

xgrammar (0.2.9, as measured) matches a string's `pattern` against the characters written between its
quotes, unescaped, in one of two ways:
- as an automaton from which every character a JSON string must escape (`"`, `\`, U+0000-U+001F) is
  removed: `.`, `[^a]`, `\S` or `[ -~]` then never write one, and the output stays JSON (the answer
  matches the pattern, those characters left out). It takes this way when the pattern's text is
  printable ASCII, its automaton builder takes every construct, and something still matches once
  those characters are removed;
- otherwise, as a grammar written character for character: a pattern `"` (or `\\`, `\n`, `\x22`,
  `[\x00-\x1f]`, `x{0}"`) puts a raw quote, backslash or control character between the quotes, and
  the answer is no longer JSON; a non-ASCII pattern such as `é.` lets its `.` write one too.

So before compiling, each pattern (`pattern` anywhere in the schema, `patternProperties`' keys) is
rewritten to printable ASCII (`é` as `\u00e9`: the same strings match) so that the first way applies,
and refused, as a `ConstraintError` naming where it is, when it would still take the second: when every
string it matches holds such a character (which could never be written unescaped), or when it uses a
construct the automaton builder does not take (`[^]`, `[:alpha:]`, a `]` outside a class, or `\p`,
`\k`, `\B` or a backreference inside a class). The schema walk and the pattern scan are iterative:
no schema nests too deep for them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from decode_service.engine_core.grammar_compiler import ConstraintError

# What a container in a schema is: a schema (or a list of them) or a map of names to schemas. Data (the
# values of `_DATA_KEYWORDS`) is not walked: a "pattern" key there is no pattern.
_SCHEMA, _SCHEMA_MAP = "schema", "map"
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example"})
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "dependentSchemas"})

# Characters of patterns checked per schema, at most: the check is Python, a few microseconds each.
MAX_PATTERN_CHARS = 65536

Intervals = list[tuple[int, int]]
_MAX_CODE_POINT = 0x10FFFF
# What a JSON string holds unescaped: everything but U+0000-U+001F, '"' and '\'.
_UNESCAPED: Intervals = [(0x20, 0x21), (0x23, 0x5B), (0x5D, _MAX_CODE_POINT)]
_DIGITS: Intervals = [(0x30, 0x39)]
_WORD: Intervals = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACE: Intervals = [
    (0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
    (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF),
]  # fmt: skip
# Escapes that stand for one control character (`\b` only inside a class; outside it is a boundary).
_CONTROL_ESCAPES = {"a": 0x07, "e": 0x1B, "f": 0x0C, "n": 0x0A, "r": 0x0D, "t": 0x09, "v": 0x0B, "0": 0x00}
# Escapes xgrammar's automaton builder refuses inside a class (it would fall back to raw characters).
_UNSUPPORTED_IN_CLASS = frozenset("kpPB123456789")
_POSIX_CLASS = re.compile(r"\[:[A-Za-z]+:\]")
_HEX = re.compile(r"x([0-9A-Fa-f]{2})|u([0-9A-Fa-f]{4})|u\{([0-9A-Fa-f]{1,6})\}|c([A-Za-z])")
_QUANTIFIER = re.compile(r"\{(\d+)(,\d*)?\}")
_FLAGS = re.compile(r"\?[A-Za-z-]*([:)])")


class UnsafePatternError(ValueError):
    """A pattern that xgrammar would enforce by writing characters a JSON string must escape."""


def json_safe_schema(schema: dict[str, Any], field_name: str) -> dict[str, Any]:
    """`schema` with its patterns rewritten to printable ASCII (the same strings match); a
    ConstraintError on `field_name` naming the first pattern that cannot be enforced inside JSON."""
    try:
        return _rewrite_patterns(schema)
    except UnsafePatternError as exc:
        raise ConstraintError(field_name, str(exc)) from None


def _rewrite_patterns(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of `schema` (its containers; scalars shared) with every pattern checked and rewritten."""
    budget = [MAX_PATTERN_CHARS]

    def checked(pattern: str, where: str) -> str:
        budget[0] -= len(pattern)
        if budget[0] < 0:
            raise UnsafePatternError(
                f"{where}: the schema's patterns hold more than {MAX_PATTERN_CHARS} characters in all, "
                "more than this server checks"
            )
        return checked_pattern(pattern, where)

    root: list[Any] = [None]
    # (container, where its copy goes, its path, what it is)
    pending: list[tuple[Any, Callable[[Any], None], str, str]] = [(schema, _setter(root, 0), "", _SCHEMA)]
    while pending:
        value, store, path, kind = pending.pop()
        if isinstance(value, list):
            items = list(value)
            store(items)
            for index, item in enumerate(value):
                if isinstance(item, (dict, list)):
                    pending.append((item, _setter(items, index), f"{path}[{index}]", kind))
        else:
            copy = dict(value)  # filled in below and as `pending` is worked off, in the same key order
            store(copy)
            for key, item in value.items():
                where = f"{path}.{key}" if path else key
                if kind == _SCHEMA and key == "pattern" and isinstance(item, str):
                    copy[key] = checked(item, where)
                elif not isinstance(item, (dict, list)):
                    continue  # a scalar, in the copy already
                elif kind == _SCHEMA_MAP:
                    pending.append((item, _setter(copy, key), where, _SCHEMA))
                elif key == "patternProperties" and isinstance(item, dict):
                    renamed = {checked(name, f"{where}[{name!r}]"): inner for name, inner in item.items()}
                    pending.append((renamed, _setter(copy, key), where, _SCHEMA_MAP))
                elif key not in _DATA_KEYWORDS:  # data is in the copy already, as it is
                    inner = _SCHEMA_MAP if key in _SCHEMA_MAPS else _SCHEMA
                    pending.append((item, _setter(copy, key), where, inner))
    return root[0]


def _setter(container: Any, key: Any) -> Callable[[Any], None]:
    def store(value: Any) -> None:
        container[key] = value

    return store


def checked_pattern(pattern: str, where: str) -> str:
    """`pattern` in printable ASCII, if xgrammar can enforce it inside a JSON string; else an
    UnsafePatternError naming `where`."""
    ascii_pattern = ascii_regex(pattern)
    scan = _PatternScan(ascii_pattern)
    unsupported = scan.run()
    if unsupported is not None:
        raise UnsafePatternError(
            f"{where} {pattern!r} uses {unsupported}, which cannot be enforced inside a JSON string"
        )
    if not scan.matches_unescaped:
        raise UnsafePatternError(
            f"{where} {pattern!r} matches only strings holding '\"', '\\' or a control character, which a "
            "JSON string holds only escaped and patterns are enforced unescaped: leave them out of it"
        )
    return ascii_pattern


def ascii_regex(pattern: str) -> str:
    r"""`pattern` with every character outside printable ASCII written as an escape (`\u00e9`,
    `\u{1f600}`), an escaped one (`\é`) included: the same strings match."""
    if pattern.isascii() and pattern.isprintable():
        return pattern
    out: list[str] = []
    escaped = False
    for char in pattern:
        code = ord(char)
        if 0x20 <= code <= 0x7E:
            out.append(char)
            escaped = char == "\\" and not escaped
            continue
        if escaped:  # an identity escape (`\é`): the escape below stands for the character itself
            out.pop()
        out.append(f"\\u{code:04x}" if code <= 0xFFFF else f"\\u{{{code:x}}}")
        escaped = False
    return "".join(out)


@dataclass
class _Group:
    """An open group while scanning: whether an alternative already matched unescaped, and the verdicts
    of the current alternative's atoms (True: can match without characters JSON escapes)."""

    zero_width: bool = False
    alternative_matched: bool = False
    atoms: list[bool] = field(default_factory=list)

    def matches(self) -> bool:
        return self.alternative_matched or all(self.atoms)


class _PatternScan:
    """One pass over a printable-ASCII pattern, in xgrammar's reading of regex syntax: whether some
    string it matches needs no character JSON escapes (`matches_unescaped`), and the first construct
    that would make xgrammar write raw characters (`run`'s result). Syntax errors are left to xgrammar,
    which refuses them when it compiles."""

    def __init__(self, pattern: str) -> None:
        self._pattern = pattern
        self._position = 0
        self.matches_unescaped = True

    def run(self) -> str | None:
        text = self._pattern
        groups = [_Group()]
        while self._position < len(text):
            char = text[self._position]
            group = groups[-1]
            if char == "\\":
                verdict = self._escape()
                if isinstance(verdict, str):
                    return verdict
                if verdict is not None:
                    group.atoms.append(verdict)
            elif char == "[":
                verdict_or_problem = self._class()
                if isinstance(verdict_or_problem, str):
                    return verdict_or_problem
                group.atoms.append(verdict_or_problem)
            elif char == "(":
                kind = self._open_group()
                if kind != "flags":
                    groups.append(_Group(zero_width=kind == "lookaround"))
            elif char == ")" and len(groups) > 1:
                groups.pop()
                groups[-1].atoms.append(True if group.zero_width else group.matches())
                self._position += 1
            elif char == "|":
                group.alternative_matched = group.matches()
                group.atoms = []
                self._position += 1
            elif char in "*?{+":
                self._quantifier(group)
            elif char in "^$":
                self._position += 1
            elif char == "]":
                return "an unescaped ']' outside a class (write \\])"
            else:  # `.` or a literal: only '"' is one JSON escapes, in printable ASCII outside escapes
                group.atoms.append(char != '"')
                self._position += 1
        while len(groups) > 1:  # unclosed groups: xgrammar refuses the pattern
            group = groups.pop()
            groups[-1].atoms.append(True if group.zero_width else group.matches())
        self.matches_unescaped = groups[0].matches()
        return None

    def _open_group(self) -> str:
        """Step past a group's opening: "group" (captured or not, named or not), "lookaround"
        (xgrammar ignores lookaheads and refuses lookbehinds: either way no character) or "flags"."""
        text, start = self._pattern, self._position
        self._position += 1
        if not text.startswith("?", self._position):
            return "group"
        after = text[self._position + 1 : self._position + 4]
        if after[:1] in ("=", "!") or after[:2] in ("<=", "<!"):
            self._position += 2 if after[:1] in ("=", "!") else 3
            return "lookaround"
        if after[:1] == "<" or after[:2] == "P<":
            end = text.find(">", self._position)
            self._position = len(text) if end < 0 else end + 1
            return "group"
        flags = _FLAGS.match(text, self._position)
        if flags is None:  # not syntax xgrammar reads: it refuses the pattern
            self._position = start + 1
            return "group"
        self._position = flags.end()
        return "flags" if flags.group(1) == ")" else "group"

    def _quantifier(self, group: _Group) -> None:
        """A quantifier that allows no repetition makes its atom match the empty string."""
        text = self._pattern
        char = text[self._position]
        allows_none = char in "*?"
        if char == "{":
            bounds = _QUANTIFIER.match(text, self._position)
            if bounds is None:  # a brace xgrammar does not read as a bound: it refuses the pattern
                self._position += 1
                return
            allows_none = not bounds.group(1).strip("0")  # no int(): its digits may be thousands
            self._position = bounds.end()
        else:
            self._position += 1
        if text[self._position : self._position + 1] in ("?", "+"):  # lazy or possessive
            self._position += 1
        if allows_none and group.atoms:
            group.atoms[-1] = True

    def _escape(self) -> bool | str | None:
        r"""An escape outside a class: whether it matches a character JSON need not escape, None for a
        zero-width one (`\b`, a backreference: xgrammar refuses those), or the malformed escape."""
        text = self._pattern
        letter = text[self._position + 1 : self._position + 2]
        if not letter:
            self._position += 1
            return None
        if letter in "bBkpP" or letter in "123456789":
            self._position += 2
            return None
        if letter in "dDwWsS":
            self._position += 2
            return True
        code = self._escaped_code()
        return code if isinstance(code, str) else _holds_unescaped([(code, code)])

    def _escaped_code(self) -> int | str:
        r"""The character an escape at the position stands for, stepping past it; for a malformed one
        (`\x` without two hex digits) what to call it: xgrammar's automaton builder refuses it."""
        text = self._pattern
        letter = text[self._position + 1]
        if letter in _CONTROL_ESCAPES:
            self._position += 2
            return _CONTROL_ESCAPES[letter]
        numeric = _HEX.match(text, self._position + 1)
        if numeric is not None and letter in "xuc":
            self._position = numeric.end()
            hex_digits = numeric.group(1) or numeric.group(2) or numeric.group(3)
            return int(hex_digits, 16) if hex_digits else ord(numeric.group(4)) % 32
        self._position += 2
        return f"the malformed escape \\{letter}" if letter in "xuc" else ord(letter)

    def _class(self) -> bool | str:
        """A character class: whether it holds a character JSON need not escape, or the construct in it
        xgrammar's automaton builder refuses."""
        text = self._pattern
        self._position += 1
        negated = text.startswith("^", self._position)
        if negated:
            self._position += 1
        if text.startswith("]", self._position):
            self._position += 1
            return "the class [^]" if negated else True  # `[]`: xgrammar refuses it
        members: Intervals = []
        while self._position < len(text) and text[self._position] != "]":
            if posix := _POSIX_CLASS.match(text, self._position):
                return f"the POSIX class {posix.group()}"
            low = self._class_atom()
            if isinstance(low, str):
                return low
            if (
                isinstance(low, int)
                and text.startswith("-", self._position)
                and self._position + 1 < len(text)
                and text[self._position + 1] != "]"
            ):
                self._position += 1
                high = self._class_atom()
                if isinstance(high, str):
                    return high
                if isinstance(high, int):
                    members.append((min(low, high), max(low, high)))
                    continue
                members.extend([(low, low), (ord("-"), ord("-")), *high])
                continue
            members.extend([(low, low)] if isinstance(low, int) else low)
        if self._position >= len(text):  # unclosed: xgrammar refuses the pattern
            return True
        self._position += 1
        return _holds_unescaped(_complement(members) if negated else members)

    def _class_atom(self) -> int | Intervals | str:
        r"""One member of a class: a character, a set (`\d`), or the escape xgrammar refuses there."""
        text = self._pattern
        char = text[self._position]
        if char != "\\":
            self._position += 1
            return ord(char)
        letter = text[self._position + 1 : self._position + 2]
        if not letter:  # the pattern ends in the class: xgrammar refuses it
            self._position += 1
            return ord("\\")
        if letter in _UNSUPPORTED_IN_CLASS:
            return f"the escape \\{letter} inside a class"
        if letter in _SHORTHANDS:
            self._position += 2
            return _SHORTHANDS[letter]
        if letter == "b":
            self._position += 2
            return 0x08
        return self._escaped_code()


def _complement(intervals: Intervals) -> Intervals:
    """Every code point outside `intervals`."""
    out: Intervals = []
    next_free = 0
    for low, high in sorted(intervals):
        if low > next_free:
            out.append((next_free, low - 1))
        next_free = max(next_free, high + 1)
    if next_free <= _MAX_CODE_POINT:
        out.append((next_free, _MAX_CODE_POINT))
    return out


def _holds_unescaped(intervals: Intervals) -> bool:
    """Whether `intervals` hold a character a JSON string may hold unescaped."""
    return any(
        low <= safe_high and safe_low <= high for low, high in intervals for safe_low, safe_high in _UNESCAPED
    )


_SHORTHANDS: dict[str, Intervals] = {
    "d": _DIGITS,
    "D": _complement(_DIGITS),
    "w": _WORD,
    "W": _complement(_WORD),
    "s": _SPACE,
    "S": _complement(_SPACE),
}
