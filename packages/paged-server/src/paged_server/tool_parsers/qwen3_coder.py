"""Qwen3-Coder tool calls (XML-style), one block per call:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Text before the first block is the message content. A parameter's value is text (one newline
after its opening tag and one before its closing tag are layout, not value); the tool's JSON
schema types it: `string` (or no type, or a parameter the schema does not list) keeps the text,
`integer` / `number` / `boolean` / `null` read it as such, `object` / `array` as JSON (or a
Python literal). A value its type cannot read stays text.

Arguments are JSON text built one whole parameter at a time, so what a stream has sent of them
is always a prefix of the final arguments.
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any

from paged_server.tool_parsers.base import ParsedCall, ToolParser
from paged_server.tool_parsers.streaming import PartialCall

_CALL_OPEN, _CALL_CLOSE = "<tool_call>", "</tool_call>"
_FN_OPEN, _FN_CLOSE = "<function=", "</function>"
_PARAM_OPEN, _PARAM_CLOSE = "<parameter=", "</parameter>"


def _types(schema: Any) -> set[str]:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    return set()


def typed_value(text: str, schema: Any) -> Any:
    """The parameter's text as the value its schema's type says (the text when none fits)."""
    types = _types(schema)
    if not types or "string" in types:
        return text
    word = text.strip()
    if "null" in types and word.lower() in ("null", "none"):
        return None
    if "boolean" in types and word.lower() in ("true", "false"):
        return word.lower() == "true"
    if "integer" in types:
        try:
            return int(word)
        except ValueError:
            pass
    if "number" in types:
        try:
            number = float(word)
        except ValueError:
            pass
        else:
            if math.isfinite(number):  # JSON has no NaN or Infinity
                return int(number) if number.is_integer() and "." not in word else number
    if types & {"object", "array"}:
        for read in (json.loads, ast.literal_eval):
            try:
                value = read(word)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                continue
            if isinstance(value, dict | list):
                return json.loads(json.dumps(value))  # a literal's tuples and sets as lists
    return text


class Qwen3CoderToolParser(ToolParser):
    start_markers = (_CALL_OPEN, _FN_OPEN)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        start = self._start(text)
        if start < 0:
            return text, []
        calls = []
        for call in self._scan(text, start):
            if call.name is None or not call.args_done:  # cut off: the text stays content
                return text, []
            calls.append(ParsedCall(call.name, call.args))
        if not calls:  # a <tool_call> with no <function=...> in it: no call, the text kept
            return text, []
        return self.content_before(text, start), calls

    def partial_calls(self, text: str) -> list[PartialCall]:
        start = self._start(text)
        return [] if start < 0 else self._scan(text, start)

    @staticmethod
    def _start(text: str) -> int:
        found = [i for i in (text.find(_CALL_OPEN), text.find(_FN_OPEN)) if i >= 0]
        return min(found, default=-1)

    def _scan(self, text: str, pos: int) -> list[PartialCall]:
        """Every call from `pos` on, the last one as far as it has arrived."""
        calls: list[PartialCall] = []
        while True:
            fn = text.find(_FN_OPEN, pos)
            if fn < 0:
                return calls
            call = PartialCall()
            calls.append(call)
            name_end = text.find(">", fn)
            if name_end < 0:
                return calls
            call.name = text[fn + len(_FN_OPEN) : name_end].strip()
            schema = self.schemas.get(call.name, {})
            props = schema.get("properties", {}) if isinstance(schema, dict) else {}
            fields: list[str] = []
            pos = name_end + 1
            while True:
                close = text.find(_FN_CLOSE, pos)
                param = text.find(_PARAM_OPEN, pos)
                if param < 0 or (0 <= close < param):
                    break
                key_end = text.find(">", param)
                value_end = text.find(_PARAM_CLOSE, key_end + 1) if key_end >= 0 else -1
                if value_end < 0:
                    return calls  # this parameter is still arriving
                key = text[param + len(_PARAM_OPEN) : key_end].strip()
                raw = text[key_end + 1 : value_end]
                raw = raw.removeprefix("\n").removesuffix("\n")
                value = typed_value(raw, props.get(key) if isinstance(props, dict) else None)
                fields.append(json.dumps({key: value}, ensure_ascii=False)[1:-1])  # "key": value
                call.args = "{" + ", ".join(fields)
                pos = value_end + len(_PARAM_CLOSE)
            if close < 0:
                return calls
            call.args, call.args_done = "{" + ", ".join(fields) + "}", True
            pos = close + len(_FN_CLOSE)
            after = text[pos:].lstrip()
            if after.startswith(_CALL_CLOSE):
                pos = len(text) - len(after) + len(_CALL_CLOSE)
            call.end = pos
