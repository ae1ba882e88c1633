"""Reasoning and tool-call parsers: the same calls, text and reasoning whichever way the answer is cut
into deltas (one character at a time, random chunks, all at once); marker prefixes held back; text around
calls kept; the grammar formats streamed as generated; and which parser a request gets."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from decode_service import cli
from decode_service.front_door.choice_text import AnswerParser, answer_parser_factory, keeps_special_tokens
from decode_service.front_door.constraints import ConstraintError
from decode_service.front_door.reasoning import REASONING_PARSERS, make_reasoning_parser
from decode_service.front_door.tool_parsers import (
    TOOL_CALL_PARSERS,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    NamedCallParser,
    RequiredCallsParser,
    ToolParser,
)
from protos.tandem.v1 import generation_pb2 as pb


def chunkings(text: str, seeds: int = 12) -> list[list[str]]:
    """`text` whole, one character at a time, and cut at random places."""
    ways = [[text], list(text)]
    for seed in range(seeds):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        ways.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return ways


def run(parser: AnswerParser, pieces: list[str]) -> tuple[str, str, list[dict], list[list[pb.ToolCallDelta]]]:
    """Feed `pieces`; returns (text, reasoning, calls as {id, name, arguments}, the deltas per feed)."""
    text, reasoning, calls, per_feed = [], [], {}, []
    for piece in [*pieces, None]:
        parsed = parser.finish() if piece is None else parser.feed(piece)
        text.append(parsed[0])
        reasoning.append(parsed[1])
        per_feed.append(parsed[2])
        for delta in parsed[2]:
            if delta.index not in calls:
                assert delta.id and delta.name, "a call's first delta carries its id and name"
                assert delta.index == len(calls)
                calls[delta.index] = {"id": delta.id, "name": delta.name, "arguments": ""}
            else:
                assert not delta.id and not delta.name
            calls[delta.index]["arguments"] += delta.arguments
    return "".join(text), "".join(reasoning), [calls[i] for i in sorted(calls)], per_feed


def outcome(make, answer: str) -> tuple[str, str, list[tuple[str, object]]]:
    """The same for every chunking of `answer` (asserted); calls as (name, parsed arguments)."""
    results = set()
    for pieces in chunkings(answer):
        text, reasoning, calls, _ = run(make(), pieces)
        results.add((text, reasoning, json.dumps([(c["name"], json.loads(c["arguments"])) for c in calls])))
    assert len(results) == 1, results
    text, reasoning, calls = results.pop()
    return text, reasoning, [tuple(call) for call in json.loads(calls)]


def tools_only(parser_class: type[ToolParser], *args):
    return lambda: AnswerParser(None, parser_class(*args))


WEATHER = {"city": "Paris", "unit": "celsius"}
WEATHER_JSON = '{"city": "Paris", "unit": "celsius"}'


def test_hermes_calls_with_text_around_them():
    answer = (
        'Let me check. <tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris", "unit": "celsius"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"tz": "CET \\"x\\" }"}}</tool_call>\n'
    )
    text, reasoning, calls = outcome(tools_only(HermesParser), answer)
    assert text == "Let me check. "
    assert reasoning == ""
    assert calls == [("get_weather", WEATHER), ("get_time", {"tz": 'CET "x" }'})]


def test_hermes_holds_back_a_marker_prefix_and_flushes_it_as_text():
    parser = HermesParser()
    assert parser.feed("a <tool_") == ("a ", [])
    assert parser.feed("box>") == ("<tool_box>", [])
    assert parser.feed(" <tool") == (" ", [])
    assert parser.finish() == ("<tool", [])
    assert parser.num_calls == 0


def test_hermes_text_that_is_not_a_call_stays_text_and_an_unclosed_whole_call_counts():
    text, _, calls = outcome(tools_only(HermesParser), "x <tool_call>not json</tool_call> y")
    assert (text, calls) == ("x <tool_call>not json</tool_call> y", [])
    text, _, calls = outcome(tools_only(HermesParser), '<tool_call>{"name": "f", "arguments": {}}')
    assert (text, calls) == ("", [("f", {})])
    text, _, calls = outcome(tools_only(HermesParser), '<tool_call>{"name": "f", "argu')
    assert (text, calls) == ('<tool_call>{"name": "f", "argu', [])


def test_llama3_json_calls_separated_by_semicolons_with_or_without_python_tag():
    for prefix in ("", "<|python_tag|>", "  "):
        answer = (
            prefix
            + f'{{"name": "get_weather", "parameters": {WEATHER_JSON}}}; '
            + '{"name": "g", "parameters": {"a": [1, {"b": "}"}]}}'
        )
        text, _, calls = outcome(tools_only(Llama3JsonParser), answer)
        assert text == ""
        assert calls == [("get_weather", WEATHER), ("g", {"a": [1, {"b": "}"}]})]


def test_llama3_json_plain_answers_are_text():
    for answer in ("The weather is fine.", '{"answer": 42}', "<|python", "  "):
        text, _, calls = outcome(tools_only(Llama3JsonParser), answer)
        assert (text, calls) == (answer, []), answer


def test_mistral_calls_after_the_marker():
    answer = (
        f'Sure. [TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER_JSON}}}, '
        '{"name": "h", "arguments": {}}]'
    )
    parser = MistralParser()
    text, _, calls = outcome(lambda: AnswerParser(None, MistralParser()), answer)
    assert text == "Sure. "
    assert calls == [("get_weather", WEATHER), ("h", {})]
    _, _, raw_calls, _ = run(AnswerParser(None, parser), [answer])
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in raw_calls)  # what Mistral's templates demand
    assert outcome(tools_only(MistralParser), "no calls [TOOL") == ("no calls [TOOL", "", [])


def test_named_call_streams_the_arguments_as_generated():
    _, _, calls, per_feed = run(AnswerParser(None, NamedCallParser("get_weather")), list('{"city": "Paris"}'))
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert sum(1 for deltas in per_feed if deltas) == len('{"city": "Paris"}')


def test_required_calls_stream_arguments_as_generated_in_any_key_order():
    answer = (
        '[{"name": "get_weather", "arguments": {"city": "Pa\\"ris]}", "unit": "celsius", '
        '"n": [1, {"x": 2}]}}, '
        '{"arguments": {"q": "x"}, "name": "search"}, {"name": "noop", "arguments": 7}]'
    )
    text, _, calls = outcome(tools_only(RequiredCallsParser), answer)
    assert text == ""
    assert calls == [
        ("get_weather", {"city": 'Pa"ris]}', "unit": "celsius", "n": [1, {"x": 2}]}),
        ("search", {"q": "x"}),
        ("noop", 7),
    ]
    # One character at a time: the name is announced once complete, then each character of the arguments.
    _, _, _, per_feed = run(AnswerParser(None, RequiredCallsParser()), list(answer))
    first = next(i for i, deltas in enumerate(per_feed) if deltas)
    assert answer[: first + 1].endswith('"get_weather"')
    opening = answer.index('{"city"')
    assert [d.arguments for d in per_feed[opening]] == ["{"]
    assert [d.arguments for d in per_feed[opening + 1]] == ['"']


def test_reasoning_deepseek_r1_is_reasoning_until_the_end_marker_even_without_the_start():
    make = lambda: AnswerParser(make_reasoning_parser("deepseek_r1"), None)  # noqa: E731
    assert outcome(make, "I think so.</think>The answer.") == ("The answer.", "I think so.", [])
    assert outcome(make, "<think>Hmm</think>Yes") == ("Yes", "Hmm", [])
    assert outcome(make, "cut off before the end </thi") == ("", "cut off before the end </thi", [])


def test_reasoning_qwen3_needs_an_explicit_start():
    make = lambda: AnswerParser(make_reasoning_parser("qwen3"), None)  # noqa: E731
    assert outcome(make, "\n<think>\nHmm\n</think>\n\nYes") == ("\n\nYes", "\nHmm\n", [])
    assert outcome(make, "No thinking here </think>") == ("No thinking here </think>", "", [])
    assert outcome(make, "<thi") == ("<thi", "", [])


def test_reasoning_then_tool_calls():
    make = lambda: AnswerParser(make_reasoning_parser("qwen3"), HermesParser())  # noqa: E731
    answer = (
        '<think>Need <tool_call> weather</think>\n<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    )
    assert outcome(make, answer) == ("\n", "Need <tool_call> weather", [("f", {"a": 1})])
    make = lambda: AnswerParser(make_reasoning_parser("deepseek_r1"), RequiredCallsParser())  # noqa: E731
    assert outcome(make, 'plan</think>[{"name": "f", "arguments": {}}]') == ("", "plan", [("f", {})])


def request(tools: int = 1, **choice) -> pb.GenerateRequest:
    generate = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="hi")])
    generate.tools.extend(pb.FunctionTool(name=f"f{i}") for i in range(tools))
    if choice:
        generate.tool_choice.CopyFrom(pb.ToolChoice(**choice))
    return generate


def test_which_parser_a_request_gets():
    assert answer_parser_factory(request(tools=0), "hermes", None) is None  # the fast path
    assert answer_parser_factory(request(mode=pb.TOOL_CHOICE_NONE), "hermes", None) is None
    assert answer_parser_factory(pb.GenerateRequest(prompt="x"), None, "qwen3") is None  # raw prompts
    assert isinstance(answer_parser_factory(request(), "hermes", None)()._tools, HermesParser)
    required = answer_parser_factory(request(mode=pb.TOOL_CHOICE_REQUIRED), None, None)()
    assert isinstance(required._tools, RequiredCallsParser)
    named = answer_parser_factory(request(function_name="f0"), None, "qwen3")()
    assert isinstance(named._tools, NamedCallParser) and named._reasoning is not None
    for auto in (request(), request(mode=pb.TOOL_CHOICE_AUTO)):
        with pytest.raises(ConstraintError, match="^tool_choice: .*--tool-call-parser") as error:
            answer_parser_factory(auto, None, None)
        assert error.value.field == "tool_choice"


def test_the_servers_parser_flags_name_the_parsers_there_are():
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    choices = {action.dest: set(action.choices or ()) for action in parser._actions}
    assert choices["tool_call_parser"] == set(TOOL_CALL_PARSERS)
    assert choices["reasoning_parser"] == set(REASONING_PARSERS)


def test_only_a_parser_that_reads_a_control_token_keeps_special_tokens():
    tools = [pb.FunctionTool(name="f")]
    auto = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="hi")], tools=tools)
    assert keeps_special_tokens(auto, "mistral")
    assert not keeps_special_tokens(auto, "hermes") and not keeps_special_tokens(auto, None)
    named = pb.GenerateRequest(tools=tools, tool_choice=pb.ToolChoice(function_name="f"))
    assert not keeps_special_tokens(named, "mistral")
    assert not keeps_special_tokens(pb.GenerateRequest(), "mistral")


@pytest.mark.parametrize(
    ("parser_class", "start", "end", "key"),
    [
        (HermesParser, "<tool_call>", "</tool_call>", "arguments"),
        (Llama3JsonParser, "", "", "parameters"),
        (MistralParser, "[TOOL_CALLS][", "]", "arguments"),
    ],
    ids=["hermes", "llama3_json", "mistral"],
)
def test_calls_too_deep_or_with_lone_surrogates_are_text_or_escaped_never_an_error(
    parser_class, start, end, key
):
    """What the model writes is never an error: JSON nested past the parser's bound, and a name or string
    arguments holding a lone surrogate escape (no text, so no response could carry it), are answer text;
    arguments objects holding one keep it as the escape the model wrote."""

    def parsed(body: str) -> tuple[str, list[tuple[str, object]]]:
        text, _, calls = outcome(tools_only(parser_class), start + body + end)
        text.encode()  # what goes out is text
        return text, calls

    deep = "[" * 2000 + "]" * 2000
    for body in (
        f'{{"name": "f", "{key}": {{"a": {deep}}}}}',
        '{"name": "\\ud800", "' + key + '": {}}',
        '{"name": "f", "' + key + '": "{\\"a\\": \\"\\ud800\\"}"}',
    ):
        text, calls = parsed(body)
        assert calls == [] and body[:20] in text, body
    text, calls = parsed('{"name": "f", "' + key + '": {"a": "\\udc00 x", "b": "ü"}}')
    assert (text, calls) == ("", [("f", {"a": "\udc00 x", "b": "ü"})])
    _, _, raw_calls, _ = run(
        tools_only(parser_class)(), [start + '{"name": "f", "' + key + '": ["\\ud800"]}' + end]
    )
    assert raw_calls[0]["arguments"] == '["\\ud800"]'
