"""Seed-OSS tool calls (vLLM's `seed_oss`; xml_calls.py has the reading), Qwen3-Coder's
elements inside Seed's own block tags:

    <seed:tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </seed:tool_call>

The block tags are optional (a bare <function=...> element counts), and so is the closing
</seed:tool_call> (a block left open reaches to the end of the output); several calls follow
one another. The content is the text around the blocks, before, between and after them
(xml_calls.py), as vLLM's engine parser for seed_oss keeps it.

A value's text, less one newline after its opening tag and one before its closing tag, is typed
as vLLM's seed_oss parser types it, by the parameter's schema "type" read as one lowercased word:

    the text `null` (any case)             null, whatever the type
    not in the schema, or no "type"        the text
    string, str, text, varchar, char, enum the text
    int..., uint..., long..., short...,    an integer (the text if it does not read as one)
    unsigned...
    num..., float...                       a number, written as an integer when it is whole
    boolean, bool, binary                  true for `true` (any case), false for anything else
    object, array, arr, dict..., list...   JSON, else a Python literal, else the text
    anything else (a list of types, too)   a Python literal, else the text

A call cut short (no </function>) is content with the text after it, the calls before it kept
(as qwen3_coder.py does). Unlike vLLM, a value with no JSON form (NaN, a set) stays text, and
`array` values are read as JSON first (vLLM's seed_oss reads them only as Python literals, so
`[true]` stayed text there; its qwen3_coder reads them as JSON). The <seed:think> block is the
reasoning parser's: a call written inside it is read like any other.
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any

from paged_server.tool_parsers.xml_calls import XmlCallsToolParser, finite_json

_TEXT_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_JSON_TYPES = ("object", "array", "arr")


def seed_value(text: str, schema: Any) -> Any:
    """One <parameter>'s text (its layout newlines removed) as vLLM's seed_oss types it."""
    if text.lower() == "null":
        return None
    if schema is None:  # a parameter the tool does not list
        return text
    kind = "string"
    if isinstance(schema, dict) and "type" in schema:
        kind = str(schema["type"]).strip().lower()
    if kind in _TEXT_TYPES:
        return text
    if kind.startswith(_INT_PREFIXES):
        try:
            return int(text)
        except ValueError:
            return text
    if kind.startswith(("num", "float")):
        try:
            number = float(text)
        except ValueError:
            return text
        if not math.isfinite(number):
            return text
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return text.lower() == "true"
    if kind in _JSON_TYPES or kind.startswith(("dict", "list")):
        try:
            value = json.loads(text)
        except ValueError:
            pass
        else:
            if finite_json(value):
                return value
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text
    return json.loads(json.dumps(value)) if finite_json(value) else text  # tuples as lists


class SeedOssToolParser(XmlCallsToolParser):
    block_open, block_close = "<seed:tool_call>", "</seed:tool_call>"
    call_open, call_close = "<function=", "</function>"
    param_open = "<parameter="
    start_markers = (block_open, call_open)

    def value(self, raw: str, schema: Any) -> Any:
        return seed_value(raw.removeprefix("\n").removesuffix("\n"), schema)
