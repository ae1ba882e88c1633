"""The agent-traffic fields of an OpenAI request → `GenerateRequest`: output constraints and tools.

Output constraints come as `response_format`, vLLM's `structured_outputs` or its older `guided_*` fields;
a request may use exactly one, and it becomes `GenerateRequest.structured_output`. Tools, `tool_choice`
and `parallel_tool_calls` become their proto fields, and an assistant turn's earlier `tool_calls` its
message's. Only the JSON shapes are checked here; schemas are compiled, and tool names checked, by the
validation both APIs share.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from decode_service.front_door import json_text
from decode_service.front_door.openai_http.fields import (
    FieldError,
    UnsupportedFieldError,
    boolean,
    json_object,
    known_keys,
    required_string,
    string,
)
from protos.tandem.v1 import generation_pb2 as pb

# Each way of asking for a constrained output: response_format, vLLM's structured_outputs and its older
# guided_* fields (vLLM users still send them). A request may use exactly one.
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


CONSTRAINT_FIELDS = ("response_format", "structured_outputs", *GUIDED_FIELDS)


_TOOL_CHOICE_MODES = {
    "none": pb.TOOL_CHOICE_NONE,
    "auto": pb.TOOL_CHOICE_AUTO,
    "required": pb.TOOL_CHOICE_REQUIRED,
}


def tool_calls(index: int, calls: object) -> list[pb.ToolCall]:
    """An assistant turn's earlier calls: [{"id", "type": "function", "function": {"name", "arguments"}}]."""
    param = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise FieldError(param, f"{param} must be an array of tool calls, got {calls!r}")
    converted = []
    for position, call in enumerate(calls):
        at = f"{param}[{position}]"
        call = json_object(call, at)
        known_keys(call, at, ("id", "type", "function"))
        if call.get("type", "function") != "function":
            raise UnsupportedFieldError(
                f"{at}.type", f"is {call['type']!r}; only function calls are supported"
            )
        function = json_object(call.get("function"), f"{at}.function")
        known_keys(function, f"{at}.function", ("name", "arguments"))
        converted.append(
            pb.ToolCall(
                id=required_string(call, "id", at),
                name=required_string(function, "name", f"{at}.function"),
                arguments=required_string(function, "arguments", f"{at}.function"),
            )
        )
    return converted


def _tools(body: Mapping[str, Any]) -> list[pb.FunctionTool]:
    """[{"type": "function", "function": {name, description, parameters, strict}}] → FunctionTools.

    `strict` is accepted whatever its value: required and named tool choices always follow the schema
    (a grammar enforces it) and auto never can (the model writes the calls freely)."""
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise FieldError("tools", f"tools must be an array of function tools, got {tools!r}")
    converted = []
    for index, tool in enumerate(tools):
        param = f"tools[{index}]"
        tool = json_object(tool, param)
        if tool.get("type") != "function":
            raise UnsupportedFieldError(
                f"{param}.type", f"is {tool.get('type')!r}; only function tools are supported"
            )
        known_keys(tool, param, ("type", "function"))
        function = json_object(tool.get("function"), f"{param}.function")
        known_keys(function, f"{param}.function", ("name", "description", "parameters", "strict"))
        converted_tool = pb.FunctionTool(name=required_string(function, "name", f"{param}.function"))
        description = string(function, "description")
        if description:
            converted_tool.description = description
        parameters = function.get("parameters")
        if parameters is not None:
            converted_tool.parameters_json = json.dumps(
                json_object(parameters, f"{param}.function.parameters")
            )
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise FieldError(f"{param}.function.strict", f"{param}.function.strict must be a boolean")
        converted.append(converted_tool)
    return converted


def _tool_choice(body: Mapping[str, Any], has_tools: bool) -> pb.ToolChoice | None:
    """ "none" | "auto" | "required" | {"type": "function", "function": {"name"}}; None when unset."""
    choice = body.get("tool_choice")
    if choice is None:
        return None
    if isinstance(choice, str) and choice in _TOOL_CHOICE_MODES:
        converted = pb.ToolChoice(mode=_TOOL_CHOICE_MODES[choice])
    elif isinstance(choice, dict) and choice.get("type") == "function":
        function = json_object(choice.get("function"), "tool_choice.function")
        converted = pb.ToolChoice(function_name=required_string(function, "name", "tool_choice.function"))
    else:
        raise FieldError(
            "tool_choice",
            f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": '
            f'{{"name": ...}}}}, got {choice!r}',
        )
    if not has_tools:
        if choice != "none":
            raise FieldError("tool_choice", f"tool_choice {choice!r} needs tools")
        return None  # "none" without tools is the default: nothing to send
    return converted


def _json_schema_text(value: object, param: str) -> str:
    """A JSON schema given as an object or as JSON text, as JSON text."""
    if isinstance(value, str):
        try:
            value = json_text.loads(value)
        except json_text.JsonTextError as exc:
            raise FieldError(param, f"{param} {exc}") from None
    if not isinstance(value, (dict, bool)):
        raise FieldError(param, f"{param} must be a JSON schema (an object), got {value!r}")
    return json.dumps(value)


def _constraint(kind: str, value: object, param: str) -> pb.StructuredOutput:
    """One structured-output kind (json, regex, choice, grammar, json_object) as a StructuredOutput."""
    if kind == "json":
        return pb.StructuredOutput(json_schema=_json_schema_text(value, param))
    if kind == "json_object":
        if value is not True:
            raise FieldError(param, f"{param} must be true, got {value!r}")
        return pb.StructuredOutput(json_object=True)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise FieldError(param, f"{param} must be a non-empty array of strings, got {value!r}")
        return pb.StructuredOutput(choice=pb.ChoiceList(choices=value))
    if not isinstance(value, str) or not value:
        raise FieldError(param, f"{param} must be a non-empty string, got {value!r}")
    return pb.StructuredOutput(**{kind: value})


def _response_format(value: object) -> tuple[pb.StructuredOutput | None, str]:
    """OpenAI's response_format: text (no constraint), json_object, or json_schema {name, schema, strict}."""
    response_format = json_object(value, "response_format")
    kind = response_format.get("type")
    if kind == "text":
        known_keys(response_format, "response_format", ("type",))
        return None, "response_format"
    if kind == "json_object":
        known_keys(response_format, "response_format", ("type",))
        return pb.StructuredOutput(json_object=True), "response_format"
    if kind == "json_schema":
        known_keys(response_format, "response_format", ("type", "json_schema"))
        spec = json_object(response_format.get("json_schema"), "response_format.json_schema")
        known_keys(spec, "response_format.json_schema", ("name", "schema", "strict", "description"))
        param = "response_format.json_schema.schema"
        if spec.get("schema") is None:
            raise FieldError(param, f"{param} is required")
        return pb.StructuredOutput(json_schema=_json_schema_text(spec["schema"], param)), param
    raise FieldError(
        "response_format.type",
        f'response_format.type must be "text", "json_object" or "json_schema", got {kind!r}',
    )


def structured_output(body: Mapping[str, Any]) -> tuple[pb.StructuredOutput | None, str | None]:
    """The one output constraint the request asks for, and the parameter that asked; a 400 when several."""
    given = [name for name in CONSTRAINT_FIELDS if body.get(name) is not None]
    if "response_format" in given and body["response_format"] == {"type": "text"}:
        given.remove("response_format")
    if "structured_outputs" in given:
        options = json_object(body["structured_outputs"], "structured_outputs")
        known_keys(options, "structured_outputs", ("json", "regex", "choice", "grammar", "json_object"))
        given.remove("structured_outputs")
        given.extend(f"structured_outputs.{name}" for name in options if options[name] is not None)
    if len(given) > 1:
        raise FieldError(
            given[1], f"{' and '.join(given)} are all set; a request may use one output constraint"
        )
    if not given:
        return None, None
    param = given[0]
    if param == "response_format":
        return _response_format(body[param])
    if param in GUIDED_FIELDS:
        return _constraint(GUIDED_FIELDS[param], body[param], param), param
    kind = param.removeprefix("structured_outputs.")
    return _constraint(kind, body["structured_outputs"][kind], param), param


def chat_tools(body: Mapping[str, Any], request: pb.GenerateRequest, constraint_param: str | None) -> None:
    """tools, tool_choice and parallel_tool_calls; a required or named choice is a grammar of its own, so
    it cannot be combined with an output constraint."""
    request.tools.extend(_tools(body))
    choice = _tool_choice(body, len(request.tools) > 0)
    if choice is not None:
        request.tool_choice.CopyFrom(choice)
        forced = choice.WhichOneof("choice") == "function_name" or choice.mode == pb.TOOL_CHOICE_REQUIRED
        if forced and constraint_param is not None and request.tools:
            raise FieldError(
                "tool_choice",
                f"tool_choice {body['tool_choice']!r} and {constraint_param} are both set; "
                "a request may use one output constraint",
            )
    if body.get("parallel_tool_calls") is not None:
        request.parallel_tool_calls = boolean(body, "parallel_tool_calls")
