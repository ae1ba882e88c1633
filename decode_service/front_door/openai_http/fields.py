"""Readers of OpenAI JSON request fields: the right JSON type, or a `FieldError` naming the parameter.

Both the core translation (`protocol`) and the agent fields (`agent_fields`) read their values through
these, so every wrongly typed field gets the same kind of 400.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from base.errors import InvalidRequestError


class FieldError(InvalidRequestError):
    """A request field of the wrong JSON type; `param` names it for the error body."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class UnsupportedFieldError(FieldError):
    """A request field tandem does not implement (a 400 naming it, as OpenAI clients expect)."""

    def __init__(self, param: str, detail: str = "is not supported by this server") -> None:
        super().__init__(param, f"{param} {detail}")


INT32 = range(-(2**31), 2**31)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def finite_number(value: object, param: str, what: str) -> float:
    """`value` as a finite float; `what` names it in the refusal (bools, huge ints and inf are refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FieldError(param, f"{what} must be a number, got {value!r}")
    try:
        as_float = float(value)
    except OverflowError:
        as_float = math.inf
    if not math.isfinite(as_float):
        raise FieldError(param, f"{what} must be a finite number, got {str(value)[:40]}")
    return as_float


def number(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    return finite_number(value, name, name)


def integer(body: Mapping[str, Any], name: str) -> int | None:
    """An integer field; the wire's fields are int32, so larger values cannot be meant."""
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value):
        raise FieldError(name, f"{name} must be an integer, got {value!r}")
    if value not in INT32:
        raise FieldError(name, f"{name} is out of range, got {value!r}")
    return value


def boolean(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise FieldError(name, f"{name} must be a boolean, got {value!r}")
    return value


def string(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise FieldError(name, f"{name} must be a string, got {value!r}")
    return value


def json_object(value: object, param: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise FieldError(param, f"{param} must be an object, got {value!r}")
    return value


def known_keys(value: Mapping[str, Any], param: str, known: tuple[str, ...]) -> None:
    for name, item in value.items():
        if name not in known and item is not None:
            raise UnsupportedFieldError(f"{param}.{name}")


def required_string(value: Mapping[str, Any], name: str, param: str) -> str:
    item = value.get(name)
    if not isinstance(item, str):
        raise FieldError(f"{param}.{name}", f"{param}.{name} must be a string, got {item!r}")
    return item
