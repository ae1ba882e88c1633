"""The schemas and prompts `tandem bench structured-output` sends: what agent traffic asks a model for.

Each entry is a chat prompt that asks for JSON and the schema that constrains the answer. Together they
cover the shapes real schemas have (nested objects, arrays with item bounds, enums, anyOf, nullable
fields, string patterns and lengths, bounded numbers, `additionalProperties: false`), because both the
per-step mask cost and how much text the grammar forces (jump-forward) depend on the shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SYSTEM_PROMPT = "You are a helpful assistant. Answer with one JSON object and nothing else."


@dataclass(frozen=True)
class SchemaCase:
    """One prompt and the schema its answer must satisfy."""

    name: str
    prompt: str
    schema: dict[str, Any]


def _object(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required if required is not None else list(properties),
        "additionalProperties": False,
    }


CORPUS: tuple[SchemaCase, ...] = (
    SchemaCase(
        "person",
        "Describe a fictional person: name, age, email and whether they are a student.",
        _object(
            {
                "name": {"type": "string", "minLength": 1, "maxLength": 40},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
                "student": {"type": "boolean"},
            }
        ),
    ),
    SchemaCase(
        "weather",
        "Give today's weather report for Paris.",
        _object(
            {
                "city": {"type": "string", "maxLength": 30},
                "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
                "conditions": {"enum": ["sunny", "cloudy", "rain", "snow", "storm"]},
                "wind_kmh": {"type": ["integer", "null"], "minimum": 0, "maximum": 300},
            }
        ),
    ),
    SchemaCase(
        "order",
        "Write a grocery order with two to four items, each with a quantity.",
        _object(
            {
                "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
                "items": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 4,
                    "items": _object(
                        {
                            "product": {"type": "string", "maxLength": 24},
                            "quantity": {"type": "integer", "minimum": 1, "maximum": 20},
                        }
                    ),
                },
                "express": {"type": "boolean"},
            }
        ),
    ),
    SchemaCase(
        "event",
        "Plan a team meeting: title, date, duration and attendees.",
        _object(
            {
                "title": {"type": "string", "maxLength": 50},
                "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                "duration_minutes": {"enum": [15, 30, 45, 60, 90]},
                "attendees": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
            }
        ),
    ),
    SchemaCase(
        "tool_call",
        "Call the search tool to find flights from Lyon to Oslo.",
        _object(
            {
                "name": {"const": "search_flights"},
                "arguments": _object(
                    {
                        "origin": {"type": "string", "maxLength": 20},
                        "destination": {"type": "string", "maxLength": 20},
                        "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                        "cabin": {"enum": ["economy", "business", "first"]},
                    },
                    required=["origin", "destination"],
                ),
            }
        ),
    ),
    SchemaCase(
        "review",
        "Review a restaurant you visited: score, summary, pros and cons.",
        _object(
            {
                "score": {"type": "number", "minimum": 0, "maximum": 5},
                "summary": {"type": "string", "minLength": 10, "maxLength": 120},
                "pros": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
                "cons": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
            }
        ),
    ),
    SchemaCase(
        "shape",
        "Describe a geometric shape: either a circle with a radius or a rectangle with width and height.",
        _object(
            {
                "shape": {
                    "anyOf": [
                        _object({"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0}}),
                        _object(
                            {
                                "kind": {"const": "rectangle"},
                                "width": {"type": "number", "minimum": 0},
                                "height": {"type": "number", "minimum": 0},
                            }
                        ),
                    ]
                },
                "color": {"type": ["string", "null"], "maxLength": 15},
            }
        ),
    ),
    SchemaCase(
        "address",
        "Give the postal address of a company headquarters.",
        _object(
            {
                "company": {"type": "string", "maxLength": 40},
                "street": {"type": "string", "maxLength": 40},
                "city": {"type": "string", "maxLength": 30},
                "postcode": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["FR", "DE", "US", "GB", "JP", "NO"]},
                "floor": {"type": ["integer", "null"], "minimum": -2, "maximum": 99},
            }
        ),
    ),
)
