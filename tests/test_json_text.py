"""JSON from outside the server parsed with bounds: nesting past MAX_NESTING and lone surrogates are a
JsonTextError saying so (never a RecursionError, never a string that cannot be encoded later), wherever
the text came from and however deep Python's own stack already is."""

from __future__ import annotations

import json

import pytest

from decode_service.front_door import json_text
from decode_service.front_door.json_text import MAX_NESTING, JsonTextError, LoneSurrogateError, TooDeepError


def nested(depth: int) -> str:
    """JSON text `depth` levels deep: objects outside, arrays inside."""
    objects, arrays = depth // 2, depth - depth // 2
    return '{"a": ' * objects + "[" * arrays + "1" + "]" * arrays + "}" * objects


@pytest.mark.parametrize("as_bytes", [False, True], ids=["str", "bytes"])
def test_nesting_up_to_the_bound_parses_and_past_it_is_refused(as_bytes):
    for depth in (0, 1, 2, MAX_NESTING - 1, MAX_NESTING):
        text = nested(depth)
        assert json_text.loads(text.encode() if as_bytes else text) == json.loads(text)
    for depth in (MAX_NESTING + 1, 5_000, 200_000):  # past the bound, past Python's recursion limit
        text = nested(depth)
        with pytest.raises(
            TooDeepError, match=f"nests arrays or objects too deeply \\(more than {MAX_NESTING}"
        ):
            json_text.loads(text.encode() if as_bytes else text)


def test_brackets_inside_strings_do_not_nest():
    text = json.dumps({"a": "[" * 1000 + '\\"{' * 500, "b": ["]]]", "\\", "ü[{"]})
    assert json_text.nesting_depth(text) == 2
    assert json_text.loads(text) == json.loads(text)
    assert json_text.nesting_depth('[[1, {"x": [[]]}], []]') == 5


def test_lone_surrogates_are_refused_with_where_they_are_and_pairs_are_text():
    assert json_text.loads('["\\ud83d\\ude00"]') == ["\U0001f600"]
    cases = {
        '"\\ud800"': "",
        '{"a": {"b": ["x", "\\uDC00"]}}': "a.b[1]",
        '{"a": [{"\\ud800": 1}]}': "a[0]",
        '{"\\ud800": 1}': "",
        '["ok", "a\\ud83d"]': "[1]",
    }
    for text, path in cases.items():
        with pytest.raises(LoneSurrogateError, match="holds a lone UTF-16 surrogate") as caught:
            json_text.loads(text)
        assert caught.value.path == path, text
    assert json_text.loads('{"a": "\\ud800"}', keep_lone_surrogates=True) == {"a": "\ud800"}
    assert json_text.lone_surrogate_path({"a": ["b", {"c": "\udfff"}]}) == "a[1].c"
    assert json_text.lone_surrogate_path({"a": ["b"]}) is None


def test_invalid_json_is_a_json_text_error_and_hook_exceptions_pass_through():
    with pytest.raises(JsonTextError, match="is not valid JSON"):
        json_text.loads("{nope")

    class Refused(Exception):
        pass

    def hook(pairs):
        raise Refused

    with pytest.raises(Refused):
        json_text.loads('{"a": 1}', object_pairs_hook=hook)


def test_the_bound_holds_however_deep_the_callers_stack_is():
    def at_depth(frames: int):
        if frames:
            return at_depth(frames - 1)
        with pytest.raises(TooDeepError):
            json_text.loads(nested(900))
        return json_text.loads(nested(MAX_NESTING))

    assert at_depth(700) == json.loads(nested(MAX_NESTING))
