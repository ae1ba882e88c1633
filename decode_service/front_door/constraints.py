"""What a request constrains its output to, checked and turned into a grammar before admission.

A `GenerateRequest` may constrain its answer in two ways: `structured_output` (a JSON schema, any JSON
object, a regex, a choice of strings or an EBNF grammar), or a tool choice that forces calls
(`REQUIRED`, or a named function). Both become one xgrammar grammar, parsed here (xgrammar's own
parser, a millisecond or so: a malformed schema, regex or EBNF is refused before admission) and compiled
once, where the engine runs (`engine_core.grammar_gate`, which refuses what does not compile in time or
is too large); `AUTO` and `NONE` compile nothing (the front door parses what the model writes).

The formats the model is held to, which the front door's parsers read back:
- `REQUIRED`: a JSON array of calls, `[{"name": "get_weather", "arguments": {"city": "Paris"}}]`, at
  least one, exactly one when `parallel_tool_calls` is false (`required_tool_calls_schema`);
- a named function: that function's arguments object itself, `{"city": "Paris"}`.

Every refusal is a `ConstraintError` whose message starts with the request field at fault, e.g.
`structured_output.json_schema: ...` or `tools[1].parameters_json: ...`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from base.errors import ConfigError
from decode_service.engine_core.grammar_compiler import ConstraintError, clean_error_message
from decode_service.engine_core.messages import GrammarSource
from decode_service.front_door import json_text
from decode_service.front_door.schema_checks import json_safe_schema
from protos.tandem.v1 import generation_pb2 as pb

if TYPE_CHECKING:
    from engine.model_facts import ModelFacts
    from engine.tokenizer import Tokenizer

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
# The reasoning parsers tandem knows, and the token that ends their reasoning.
REASONING_END_TOKENS = {"deepseek_r1": "</think>", "qwen3": "</think>"}
# Grammar kinds whose output is compact JSON, which never holds a raw control character.
JSON_KINDS = ("json_schema", "json_object")


@dataclass(frozen=True)
class Tool:
    """One validated function tool; `parameters` is its arguments' JSON schema (an object schema)."""

    name: str
    description: str
    parameters: dict[str, Any]

    def for_chat_template(self) -> dict[str, Any]:
        """The OpenAI-style entry Hugging Face chat templates render (`tools=`)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class GrammarSpec:
    """What to compile: a `GrammarCompiler` kind, its text, and the field to blame if it fails."""

    kind: str
    spec: str
    field: str
    # Specs parsed one by one when this one fails, to name the part at fault (each tool's schema).
    parts: tuple[GrammarSpec, ...] = ()


def _parse_object(text: str, field: str, what: str) -> dict[str, Any]:
    try:
        value = json_text.loads(text)
    except json_text.JsonTextError as exc:
        raise ConstraintError(field, str(exc)) from None
    if not isinstance(value, dict):
        raise ConstraintError(field, f"must be {what} (a JSON object), got {type(value).__name__}")
    return value


def parse_tools(request: pb.GenerateRequest) -> list[Tool]:
    """The request's tools, validated: names unique and well formed, parameters an object schema."""
    tools: list[Tool] = []
    seen: set[str] = set()
    for index, proto in enumerate(request.tools):
        field = f"tools[{index}]"
        if not TOOL_NAME.match(proto.name):
            raise ConstraintError(
                f"{field}.name", f"must be 1-64 of a-z, A-Z, 0-9, '_' and '-', got {proto.name!r}"
            )
        if proto.name in seen:
            raise ConstraintError(f"{field}.name", f"{proto.name!r} names two tools")
        seen.add(proto.name)
        parameters: dict[str, Any] = {"type": "object"}
        if proto.parameters_json:
            parameters = _parse_object(proto.parameters_json, f"{field}.parameters_json", "a JSON schema")
            if parameters.get("type", "object") != "object":
                raise ConstraintError(
                    f"{field}.parameters_json",
                    f"must describe an object (type 'object'), got type {parameters['type']!r}",
                )
            parameters = json_safe_schema(parameters, f"{field}.parameters_json")
        tools.append(Tool(proto.name, proto.description, parameters))
    return tools


def tool_choice(request: pb.GenerateRequest) -> tuple[int, str | None]:
    """(mode, function name): a named function is (REQUIRED, name); unset is AUTO with tools, NONE
    without."""
    which = request.tool_choice.WhichOneof("choice") if request.HasField("tool_choice") else None
    if which == "function_name":
        return pb.TOOL_CHOICE_REQUIRED, request.tool_choice.function_name
    mode = request.tool_choice.mode if which == "mode" else pb.TOOL_CHOICE_MODE_UNSPECIFIED
    if mode == pb.TOOL_CHOICE_MODE_UNSPECIFIED:
        mode = pb.TOOL_CHOICE_AUTO if request.tools else pb.TOOL_CHOICE_NONE
    return mode, None


def parallel_tool_calls(request: pb.GenerateRequest) -> bool:
    return request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True


def may_compile(request: pb.GenerateRequest) -> bool:
    """Whether `request` has a grammar to parse (it then validates on a thread of its own)."""
    return request.HasField("structured_output") or tool_choice(request)[0] == pb.TOOL_CHOICE_REQUIRED


# Keywords whose values are data, not schemas: a "$ref" inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example"})
# Keywords whose values map names to schemas: a name "$ref" there is a property, not a reference.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _rebased(schema: Any, base: str) -> Any:
    """`schema` with each local reference (`#`, `#/$defs/X`, `#/properties/a`) pointing into `base` (a
    `#/...` pointer) instead of the document's root: where the schema now stands inside a larger one."""
    if isinstance(schema, list):
        return [_rebased(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebased: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            rebased[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            rebased[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            rebased[key] = {name: _rebased(sub, base) for name, sub in value.items()}
        else:
            rebased[key] = _rebased(value, base)
    return rebased


def required_tool_calls_schema(tools: Sequence[Tool], parallel: bool) -> dict[str, Any]:
    """The JSON schema `tool_choice: REQUIRED` holds the answer to: an array of calls to the tools.

    Each tool's parameters sit deep inside it, where their own references (`#/$defs/Model`, as pydantic
    writes them) would resolve against this schema's root. So a tool that has references moves whole
    under this schema's `$defs` (as `tool_<index>`, names no tool can take from another) with its
    references rebased there, and its call's arguments refer to it.
    """
    definitions: dict[str, Any] = {}
    call_schemas = []
    for index, tool in enumerate(tools):
        arguments = tool.parameters
        pointer = f"#/$defs/tool_{index}"
        rebased = _rebased(arguments, pointer)
        if rebased != arguments:
            definitions[f"tool_{index}"] = rebased
            arguments = {"$ref": pointer}
        call_schemas.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": call_schemas}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return schema


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def _structured_output_spec(output: pb.StructuredOutput) -> GrammarSpec:
    kind = output.WhichOneof("kind")
    field = f"structured_output.{kind}"
    if kind == "json_schema":
        schema = _parse_object(output.json_schema, field, "a JSON schema")
        schema = json_safe_schema(schema, field)
        return GrammarSpec("json_schema", json.dumps(schema), field)
    if kind == "json_object":
        return GrammarSpec("json_object", "", field)
    if kind == "regex":
        if not output.regex:
            raise ConstraintError(field, "must not be empty")
        return GrammarSpec("regex", output.regex, field)
    if kind == "choice":
        if not output.choice.choices:
            raise ConstraintError(field, "must list at least one string")
        return GrammarSpec("grammar", choice_grammar(output.choice.choices), field)
    if kind == "grammar":
        if not output.grammar.strip():
            raise ConstraintError(field, "must not be empty")
        return GrammarSpec("grammar", output.grammar, field)
    raise ConstraintError("structured_output", "set one of json_schema, json_object, regex, choice, grammar")


def _tool_spec(index: int, tool: Tool) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(tool.parameters), f"tools[{index}].parameters_json")


def grammar_spec(request: pb.GenerateRequest, tools: Sequence[Tool]) -> GrammarSpec | None:
    """What `request` must be compiled into (None: unconstrained); raises when the fields conflict."""
    mode, function_name = tool_choice(request)
    if (request.tools or request.HasField("tool_choice")) and not request.messages:
        field = "tools" if request.tools else "tool_choice"
        raise ConstraintError(field, "needs a chat request (messages), not prompt or token_ids")
    forced = mode == pb.TOOL_CHOICE_REQUIRED
    if forced and not tools:
        raise ConstraintError("tool_choice", "forces a tool call but the request has no tools")
    if forced and request.HasField("structured_output"):
        raise ConstraintError(
            "structured_output", "cannot be combined with tool_choice REQUIRED or a named function"
        )
    if function_name is not None:
        for index, tool in enumerate(tools):
            if tool.name == function_name:
                return GrammarSpec(
                    "json_schema", json.dumps(tool.parameters), f"tools[{index}].parameters_json"
                )
        names = ", ".join(tool.name for tool in tools)
        raise ConstraintError(
            "tool_choice.function_name", f"{function_name!r} is not one of the request's tools: {names}"
        )
    if forced:
        schema = required_tool_calls_schema(tools, parallel_tool_calls(request))
        parts = tuple(_tool_spec(index, tool) for index, tool in enumerate(tools))
        return GrammarSpec("json_schema", json.dumps(schema), "tools", parts)
    if request.HasField("structured_output"):
        return _structured_output_spec(request.structured_output)
    return None


def reasoning_end_token_id(tokenizer: Tokenizer | None, reasoning_parser: str | None) -> int | None:
    """The token after which grammars apply (None: from the first token); checked at server start."""
    if reasoning_parser is None:
        return None
    end = REASONING_END_TOKENS[reasoning_parser]
    if tokenizer is None:
        raise ConfigError(f"--reasoning-parser {reasoning_parser} needs the model's tokenizer")
    token_id = tokenizer.hf.convert_tokens_to_ids(end)
    if not isinstance(token_id, int) or token_id == tokenizer.hf.unk_token_id:
        raise ConfigError(
            f"--reasoning-parser {reasoning_parser}: the tokenizer has no single {end} token, so this "
            "model does not write reasoning the way the parser expects"
        )
    return token_id


def check_grammar(kind: str, spec: str, field: str) -> None:
    """Parse (kind, spec) with xgrammar, without compiling it against the vocabulary: a ConstraintError
    naming `field` with xgrammar's message when it is malformed."""
    import xgrammar as xgr

    try:
        if kind == "json_schema":
            xgr.Grammar.from_json_schema(spec, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(spec)
    except Exception as exc:  # xgrammar raises RuntimeError, ValueError, TypeError for bad input
        raise ConstraintError(field, clean_error_message(str(exc))) from None


class Constraints:
    """The server's way from a request to what the engine core compiles: the checked spec, and where
    its grammar starts (after a reasoning model's thinking)."""

    def __init__(self, tokenizer: Tokenizer | None, activate_after: int | None = None) -> None:
        self.activate_after = activate_after
        self._tokenizer = tokenizer

    @classmethod
    def for_model(cls, model: ModelFacts, reasoning_parser: str | None) -> Constraints:
        """The server's constraints over `model`'s vocabulary; a ConfigError when the reasoning parser
        cannot work with its tokenizer."""
        tokenizer = model.tokenizer
        return cls(tokenizer, reasoning_end_token_id(tokenizer, reasoning_parser))

    def check(self, spec: GrammarSpec | None, prompt_ids: Sequence[int] = ()) -> GrammarSource | None:
        """What the engine core compiles for `spec`, once it parses; when it does not, the error names
        the first of its parts (tools) that does not parse either, else the whole. The grammar waits for
        the end of the reasoning unless `prompt_ids` already closed it."""
        if spec is None:
            return None
        if self._tokenizer is None:
            raise ConstraintError(
                spec.field, "this server has no tokenizer, so it cannot enforce constraints"
            )
        try:
            check_grammar(spec.kind, spec.spec, spec.field)
        except ConstraintError:
            for part in spec.parts:
                check_grammar(part.kind, part.spec, part.field)
            raise
        activate_after = None if self._reasoning_closed(prompt_ids) else self.activate_after
        return GrammarSource(spec.kind, spec.spec, spec.field, activate_after, spec.kind in JSON_KINDS)

    def _reasoning_closed(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the prompt ends right after the reasoning's end: a template that turns thinking off
        writes an empty think block into the generation prompt (Qwen3's `enable_thinking: false`)."""
        if self.activate_after is None or self.activate_after not in prompt_ids or self._tokenizer is None:
            return False
        last = len(prompt_ids) - 1 - list(reversed(prompt_ids)).index(self.activate_after)
        return not self._tokenizer.decode(prompt_ids[last + 1 :]).strip()
