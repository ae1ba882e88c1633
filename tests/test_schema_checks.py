"""String patterns in JSON schemas, checked against what xgrammar 0.2.9 does with them: a pattern it would
enforce by writing a raw `"`, `\\` or control character between a string's quotes (so the answer is not
JSON) is refused with the path to it, anywhere in the schema; one it enforces safely is kept (rewritten
to printable ASCII when it is not, so that xgrammar takes its safe way)."""

from __future__ import annotations

import json
import random

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from decode_service.front_door.constraints import ConstraintError
from decode_service.front_door.schema_checks import (
    MAX_PATTERN_CHARS,
    UnsafePatternError,
    checked_pattern,
    json_safe_schema,
)

# Patterns whose every match holds a character JSON escapes, or that use a construct xgrammar's safe way
# does not take: xgrammar writes them character for character.
REFUSED = [
    '"', '\\"', "\\\\", "a\\\\b", "\\n", "[\\n]", "\\t", "\\x22", "\\u0022", "\\x5c", "\\u{5c}", "\\cJ",
    "[\\b]", "\\0", "\\e", "[\\x00-\\x1f]", '\\d"', '("|\\\\)', 'x{0}"', "[^\\s\\S]", '(?:")', "[^]",
    "[[:alpha:]]", "[a\\p]", "[a\\1]", ".]", "\\x.", "\\\\é", "\n", "a\tb",
]  # fmt: skip
# Patterns xgrammar enforces without writing such characters (it leaves them out of its matches).
KEPT = [
    "^[a-z]+$", ".", ".*", "[^a]+", "\\S+", "\\W", "[ -~]{1,20}", "[\\x01-\\x7f]", '(a|")', '"?x',
    '[ab"]', "a(?=\")", "[\\d-z]", "\\{0\\}", "(?i)ab", "(?<name>a)+", "^\\w+@\\w+\\.com$", "\\u00e9",
]  # fmt: skip


def xgrammar_way(pattern: str) -> str:
    """How xgrammar enforces `pattern` in a string: "safe" (its automaton without the characters JSON
    escapes), "raw" (character for character) or "error" (it refuses the pattern)."""
    schema = json.dumps({"type": "string", "pattern": pattern})
    try:
        grammar = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    except RuntimeError:
        return "error"
    return "safe" if "json_string=true" in grammar else "raw"


@pytest.mark.parametrize("pattern", REFUSED)
def test_patterns_xgrammar_would_write_raw_are_refused(pattern):
    assert xgrammar_way(pattern) in ("raw", "error")
    with pytest.raises(UnsafePatternError) as caught:
        checked_pattern(pattern, "properties.q.pattern")
    assert str(caught.value).startswith(f"properties.q.pattern {pattern!r} ")


@pytest.mark.parametrize("pattern", KEPT)
def test_patterns_xgrammar_enforces_safely_are_kept(pattern):
    assert checked_pattern(pattern, "p") == pattern
    assert xgrammar_way(pattern) == "safe"


def test_non_ascii_patterns_are_rewritten_so_xgrammar_enforces_them_safely():
    rewritten = {
        "é.": "\\u00e9.",
        "^[А-Яа-я]+$": "^[\\u0410-\\u042f\\u0430-\\u044f]+$",
        "[^é]": "[^\\u00e9]",
        "\\é|😀": "\\u00e9|\\u{1f600}",
    }
    for pattern, ascii_pattern in rewritten.items():
        assert xgrammar_way(pattern) == "raw"
        assert checked_pattern(pattern, "p") == ascii_pattern
        assert xgrammar_way(ascii_pattern) == "safe"
    # The same strings match; a raw quote, which the original's `.` let through, does not.
    grammar = xgr.Grammar.from_json_schema(json.dumps({"type": "string", "pattern": "\\u00e9."}))
    assert _is_grammar_accept_string(grammar, '"éx"') and _is_grammar_accept_string(grammar, '"éü"')
    raw = xgr.Grammar.from_json_schema(json.dumps({"type": "string", "pattern": "é."}))
    assert _is_grammar_accept_string(raw, '"é""') and not _is_grammar_accept_string(grammar, '"é""')


def test_a_thousand_random_patterns_agree_with_xgrammar():
    """Kept means xgrammar enforces it safely (or refuses it); refused means xgrammar would not."""
    pieces = [
        "a", '"', "\\\\", '\\"', "\\n", "\\x22", "\\u0022", "\\u00e9", "é", ".", "\\d", "\\s", "\\S", "[a\"]",
        '["]', '[^"]', "[\\x00-\\x1f]", "[ -~]", "[^\\s\\S]", "(", ")", "(?:", "(?=", "|", "*", "?", "+",
        "{0}", "{2}", "{0,2}", "^", "$", "[\\n\\t]", "\\e", "\\cA", "[\\b]", "[\\d\"]", "[^\\x20-\\x7e]",
        "\\p{L}", "\\b", "(?i)", "{", "}", "]", "-", "\\", "\\]", "[\\]]", "[^]a]", "\\x", "\\u", "[a-\\d]",
        "[--\"]", "[[:a:]]", "\\k<n>", "\\1", "[\\\\]", "[\\x22\\x5c]",
    ]  # fmt: skip
    rng = random.Random(33)
    for _ in range(1000):
        pattern = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 5)))
        try:
            kept = checked_pattern(pattern, "p")
        except UnsafePatternError:
            assert xgrammar_way(pattern) != "safe", pattern
        else:
            assert xgrammar_way(kept) != "raw", pattern


def test_every_pattern_in_the_schema_is_checked_and_named_by_its_path():
    def refused(schema: dict) -> str:
        with pytest.raises(ConstraintError) as caught:
            json_safe_schema(schema, "structured_output.json_schema")
        return str(caught.value)

    bad = {"type": "string", "pattern": '^"$'}
    places = {
        "properties.q.pattern": {"properties": {"q": bad}},
        "items.properties.q.pattern": {"items": {"properties": {"q": bad}}},
        "anyOf[1].pattern": {"anyOf": [{"type": "integer"}, bad]},
        "$defs.Name.properties.q.items[0].pattern": {
            "$defs": {"Name": {"properties": {"q": {"items": [bad]}}}}
        },
        "propertyNames.pattern": {"type": "object", "propertyNames": bad},
        "patternProperties['^\"$']": {"type": "object", "patternProperties": {'^"$': {"type": "string"}}},
        "properties.pattern.pattern": {"properties": {"pattern": bad}},
    }
    for path, schema in places.items():
        assert refused(schema).startswith(f"structured_output.json_schema: {path} "), schema
    deep: dict = bad
    for _ in range(2000):  # the walk is iterative
        deep = {"type": "array", "items": deep}
    assert refused(deep).startswith("structured_output.json_schema: items.items.items.")
    # Data is no schema: a "pattern" under const, enum, default or examples is not checked.
    data = {"const": {"pattern": '"'}, "default": {"pattern": '"'}, "enum": [{"pattern": '"'}]}
    assert json_safe_schema(data, "f") == data
    # Nor is a property named "pattern", nor a pattern that is no string (xgrammar judges that one).
    odd = {"pattern": 5, "properties": {"pattern": '"', "x": {"pattern": None}}}
    assert json_safe_schema(odd, "f") == odd
    many = {
        "anyOf": [
            {"pattern": "a" * (MAX_PATTERN_CHARS // 2)},
            {"pattern": "b" * (MAX_PATTERN_CHARS // 2 + 1)},
        ]
    }
    assert "characters in all" in refused(many)


def test_the_schema_is_copied_with_its_key_order_and_only_patterns_change():
    schema = {
        "type": "object",
        "properties": {
            "b": {"type": "string", "pattern": "é+"},
            "a": {"type": "integer"},
            "c": {"$ref": "#/$defs/C"},
        },
        "$defs": {"C": {"type": "object", "patternProperties": {"^ü": {"type": "string"}}}},
        "required": ["b", "a"],
    }
    original = json.loads(json.dumps(schema))
    safe = json_safe_schema(schema, "f")
    assert schema == original, "the schema given is left as it was"
    assert list(safe["properties"]) == ["b", "a", "c"] and list(safe) == list(schema)
    assert safe["properties"]["b"]["pattern"] == "\\u00e9+"
    assert list(safe["$defs"]["C"]["patternProperties"]) == ["^\\u00fc"]
    assert {**safe, "properties": None, "$defs": None} == {**schema, "properties": None, "$defs": None}
