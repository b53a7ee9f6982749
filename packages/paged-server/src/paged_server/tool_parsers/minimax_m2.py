"""MiniMax-M2 tool calls (vLLM's `minimax_m2`; xml_calls.py has the reading), one or more
invocations per block:

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    </minimax:tool_call>

Names and keys may be quoted ("..." or '...') or not. Only invocations inside a closed block
count (vLLM reads the closed blocks only); the text before, between and after the blocks is the
content (xml_calls.py, as vLLM's engine parser keeps it). A value's
text is stripped, then typed as vLLM's minimax_m2 parser types it:

    `null`, `none` or `nil` (any case)     null, whatever the type
    otherwise, by the types the parameter's schema allows ("type", a list of types, the types of
    its "enum" values, those of anyOf / oneOf / allOf; "string" when none or not listed), tried
    in this order, the first that reads the text wins:
        integer, int                       an integer
        number, float                      a number, written as an integer when it is whole
        boolean, bool                      true for true/1/yes/on, false for false/0/no/off
        object, array                      JSON
        string, str, text                  the text
    none of them                           JSON, else the text

A block left open (max_tokens) or an invocation left open inside a closed block ends the calls:
it and the text after it are content, the calls of the blocks before it kept (as vLLM keeps the
blocks that did close). Unlike vLLM, a value with no JSON form (NaN, Infinity) stays text.
"""

from __future__ import annotations

import json
import math
from typing import Any

from paged_server.tool_parsers.xml_calls import XmlCallsToolParser, finite_json

_NULLS = ("null", "none", "nil")
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
_ORDER = ("integer", "int", "number", "float", "boolean", "bool", "object", "array")
_TEXT_TYPES = ("string", "str", "text")
# an enum value's JSON type (bool before int: True is an int too)
_ENUM_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"))
_ENUM_TYPES += ((list, "array"), (dict, "object"), (type(None), "null"))


def schema_types(schema: Any) -> set[str]:
    """The types a parameter's schema allows, lowercased; {"string"} when it names none."""
    if not isinstance(schema, dict):
        return {"string"}
    types: set[str] = set()
    kind = schema.get("type")
    for k in kind if isinstance(kind, list) else [kind]:
        if isinstance(k, str):
            types.add(k.lower())
    enum = schema.get("enum")
    for v in enum if isinstance(enum, list) else []:
        types.update(next(([n] for t, n in _ENUM_TYPES if isinstance(v, t)), []))
    for choice in ("anyOf", "oneOf", "allOf"):
        options = schema.get(choice)
        for option in options if isinstance(options, list) else []:
            types |= schema_types(option)
    return types or {"string"}


def _json(text: str) -> tuple[bool, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        return False, None
    return finite_json(value), value


def minimax_value(text: str, schema: Any) -> Any:
    """One <parameter>'s text as vLLM's minimax_m2 types it (`schema` None: not listed)."""
    text = text.strip()
    if text.lower() in _NULLS:
        return None
    types = schema_types(schema)
    for kind in _ORDER:
        if kind not in types:
            continue
        if kind in ("integer", "int"):
            try:
                return int(text)
            except ValueError:
                continue
        if kind in ("number", "float"):
            try:
                number = float(text)
            except ValueError:
                continue
            if math.isfinite(number):
                return int(number) if number.is_integer() else number
            continue
        if kind in ("boolean", "bool"):
            word = text.lower()
            if word in _TRUE or word in _FALSE:
                return word in _TRUE
            continue
        ok, value = _json(text)  # object, array
        if ok:
            return value
    if types & set(_TEXT_TYPES):
        return text
    ok, value = _json(text)
    return value if ok else text


class MinimaxM2ToolParser(XmlCallsToolParser):
    block_open, block_close = "<minimax:tool_call>", "</minimax:tool_call>"
    call_open, call_close = "<invoke name=", "</invoke>"
    param_open = "<parameter name="
    blocks_required = True
    start_markers = (block_open,)

    def attr(self, raw: str) -> str:
        raw = raw.strip()
        if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'":
            return raw[1:-1]
        return raw

    def value(self, raw: str, schema: Any) -> Any:
        return minimax_value(raw, schema)
