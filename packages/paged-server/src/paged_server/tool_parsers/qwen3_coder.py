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

(a `<function=...>` element without the <tool_call> tags is read too). A parameter's value is
text (one newline after its opening tag and one before its closing tag are layout, not value);
the tool's JSON schema types it: `string` (or no type, or a parameter the schema does not list)
keeps the text, `integer` / `number` / `boolean` / `null` read it as such, `object` / `array` as
JSON (or a Python literal). A value its type cannot read stays text.

The content is the text around the calls (interleaved.py): before the first block as written
(None when empty), then the text between or after the blocks unless it is only whitespace.
vLLM's qwen3_coder / qwen3_xml (the engine parser, vllm/parser/qwen3.py) sends all text outside
the calls as content, streamed as written and answered stripped; its legacy parser streamed
that text but answered only the text before the first call. Here both forms keep it as written,
so a client gets the same content streamed or not. A `<tool_call>` closed before any function
is text (vLLM's legacy answer reads it so). A call that cannot be read (a `<tool_call>` with no
function, or cut off by max_tokens) ends the calls: it and the text after it are content, the
calls before it kept (vLLM keeps the calls it reads).

Arguments are JSON text built one whole parameter at a time, so what a stream has sent of them
is always a prefix of the final arguments.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from paged_server.tool_parsers.base import ParsedCall
from paged_server.tool_parsers.interleaved import Block, InterleavedToolParser
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


_CLOSE_AFTER = re.compile(r"\s*(</tool_call>)?")  # what may follow a call's </function>


class Qwen3CoderToolParser(InterleavedToolParser):
    start_markers = (_CALL_OPEN, _FN_OPEN)
    # (text, its scan): a stream's rescan asks for the calls and then for the blocks of it
    _scanned: tuple[str, list[tuple[int, PartialCall, bool]]] | None = None

    def blocks(self, text: str, final: bool) -> list[Block]:
        return [
            Block(start, call.end, [ParsedCall(call.name, call.args)])
            if call.name is not None and call.args_done and (final or not pending)
            else Block(start, None, None)
            for start, call, pending in self._scan(text)
        ]

    def partial_calls(self, text: str) -> list[PartialCall]:
        return [call for _, call, _ in self._scan(text)]

    def _scan(self, text: str) -> list[tuple[int, PartialCall, bool]]:
        if self._scanned is None or self._scanned[0] is not text:
            self._scanned = (text, self._scan_calls(text))
        return self._scanned[1]

    def _scan_calls(self, text: str) -> list[tuple[int, PartialCall, bool]]:
        """(where its block starts, the call, whether the text may still close its block) for
        every call, the last one as far as it has arrived; a <tool_call> with no function in
        it ends the scan as a call with no name. A <tool_call> closed before the next
        <function= is text, as vLLM reads it."""
        calls: list[tuple[int, PartialCall, bool]] = []
        pos = 0
        while True:
            fn, tc = text.find(_FN_OPEN, pos), text.find(_CALL_OPEN, pos)
            while 0 <= tc < fn and 0 <= (shut := text.find(_CALL_CLOSE, tc)) < fn:
                tc = text.find(_CALL_OPEN, shut)
            if fn < 0:
                if tc >= 0:
                    calls.append((tc, PartialCall(), False))
                return calls
            call = PartialCall()
            calls.append((tc if 0 <= tc < fn else fn, call, False))
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
            after = _CLOSE_AFTER.match(text, pos)
            assert after is not None  # (the pattern matches the empty string)
            if after.group(1):  # the block's </tool_call>
                pos = after.end()
            else:  # a </tool_call> may be still arriving (read after a bare function too)
                tail = text[after.end() : after.end() + len(_CALL_CLOSE)]
                pending = after.end() + len(tail) == len(text) and _CALL_CLOSE.startswith(tail)
                calls[-1] = (calls[-1][0], call, pending)
            call.end = pos
