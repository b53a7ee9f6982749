"""JSON schemas of different shapes, each with one valid instance.

The structured-output benchmark (`structured_backends.py`) compiles them and walks the matcher
through each instance's tokens; the tests generate under each schema and validate the output
with `jsonschema`. Every string and array is bounded (maxLength / maxItems) and every number has
a range, so even a random-weight model finishes a document within a few hundred tokens.
"""

from __future__ import annotations

from typing import Any

_NAME = {"type": "string", "minLength": 1, "maxLength": 12}

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "flat_object": (
        {
            "type": "object",
            "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        {"name": "Ada", "age": 36},
    ),
    "nested_object": (
        {
            "type": "object",
            "properties": {
                "person": {
                    "type": "object",
                    "properties": {
                        "name": _NAME,
                        "address": {
                            "type": "object",
                            "properties": {
                                "city": _NAME,
                                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                            },
                            "required": ["city", "zip"],
                            "additionalProperties": False,
                        },
                    },
                    "required": ["name", "address"],
                    "additionalProperties": False,
                }
            },
            "required": ["person"],
            "additionalProperties": False,
        },
        {"person": {"name": "Bo", "address": {"city": "Paris", "zip": "75001"}}},
    ),
    "array_of_objects": (
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "done": {"type": "boolean"},
                },
                "required": ["id", "done"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 3,
        },
        [{"id": 1, "done": True}, {"id": 2, "done": False}],
    ),
    "enum": (
        {
            "type": "object",
            "properties": {"color": {"enum": ["red", "green", "blue"]}},
            "required": ["color"],
            "additionalProperties": False,
        },
        {"color": "green"},
    ),
    "number_range": (
        {
            "type": "object",
            "properties": {
                "temperature": {"type": "number", "minimum": -50, "maximum": 50},
                "count": {"type": "integer", "minimum": 10, "maximum": 20},
            },
            "required": ["temperature", "count"],
            "additionalProperties": False,
        },
        {"temperature": 21.5, "count": 12},
    ),
    "string_pattern": (
        {
            "type": "object",
            "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
            "required": ["code"],
            "additionalProperties": False,
        },
        {"code": "ABC-123"},
    ),
    "optional_fields": (
        {
            "type": "object",
            "properties": {
                "title": _NAME,
                "subtitle": _NAME,
                "pages": {"type": "integer", "minimum": 1, "maximum": 999},
            },
            "required": ["title"],
            "additionalProperties": False,
        },
        {"title": "Dune", "pages": 412},
    ),
    "union_types": (
        {
            "type": "object",
            "properties": {
                "value": {
                    "anyOf": [
                        {"type": "boolean"},
                        {"type": "null"},
                        {"type": "integer", "minimum": 0, "maximum": 9},
                    ]
                }
            },
            "required": ["value"],
            "additionalProperties": False,
        },
        {"value": None},
    ),
    "array_of_enums": (
        {
            "type": "object",
            "properties": {
                "tags": {
                    "type": "array",
                    "items": {"enum": ["a", "b", "c"]},
                    "minItems": 1,
                    "maxItems": 4,
                }
            },
            "required": ["tags"],
            "additionalProperties": False,
        },
        {"tags": ["a", "c"]},
    ),
    "matrix": (
        {
            "type": "array",
            "items": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 2,
                "maxItems": 2,
            },
            "minItems": 2,
            "maxItems": 2,
        },
        [[1, 2], [3, 4]],
    ),
    "const_and_refs": (
        {
            "$defs": {
                "point": {
                    "type": "object",
                    "properties": {
                        "x": {"type": "integer", "minimum": 0, "maximum": 99},
                        "y": {"type": "integer", "minimum": 0, "maximum": 99},
                    },
                    "required": ["x", "y"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {
                "kind": {"const": "segment"},
                "start": {"$ref": "#/$defs/point"},
                "end": {"$ref": "#/$defs/point"},
            },
            "required": ["kind", "start", "end"],
            "additionalProperties": False,
        },
        {"kind": "segment", "start": {"x": 1, "y": 2}, "end": {"x": 3, "y": 4}},
    ),
    "tool_call": (
        {
            "type": "object",
            "properties": {
                "name": {"enum": ["get_weather", "get_time"]},
                "arguments": {
                    "type": "object",
                    "properties": {"city": _NAME, "unit": {"enum": ["celsius", "fahrenheit"]}},
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        },
        {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}},
    ),
}
