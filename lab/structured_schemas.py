"""The structured-output workloads the lab scripts share: a nested JSON schema, a tool call, and
instances of each that a constrained model could produce (for timing grammar engines on real
token sequences)."""
from __future__ import annotations

import json
from typing import Any

NESTED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["engineer", "doctor", "artist", "teacher"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "score", "address", "skills"],
    "additionalProperties": False,
}

NESTED_INSTANCE = {"name": "Ada Lovelace", "age": 36, "role": "engineer", "score": 0.97,
                   "address": {"city": "London", "zip": "12345"}, "skills": ["maths", "poetry"]}

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}

TIME_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 40}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}

TOOL_CALL_INSTANCE = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}


def compact(value: Any) -> str:
    """JSON as the grammars here produce it: ', ' and ': ' separators, no other whitespace."""
    return json.dumps(value, separators=(", ", ": "))
