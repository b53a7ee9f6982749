"""GLM-4.5 / 4.6 / 4.7 tool calls (vLLM's `glm45`; `glm47` is the same reading), one block per
call:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

The name runs to the end of its line or to the first `<arg_key>` (GLM-4.7 writes no newline);
a call may have no arguments. Values are typed as vLLM types them: a parameter whose schema
(the request's tool) says `"type": "string"` keeps its text exactly; any other value, stripped,
is read as JSON, else as a Python literal, else kept as text (so `3` is a number and `Paris` a
string when the tool gives no schema).

The content is the text around the calls (interleaved.py): before the first as written, and
the text between or after them unless it is only whitespace; whitespace alone is none. vLLM's
answer keeps only the text before the first call (whitespace alone: None) while its stream
sends all text outside the calls, whitespace too; here both forms send the text before, between
and after the calls, so a client gets the same content streamed or not, and an answer whose
calls are apart only by whitespace has vLLM's answer's content. A call that cannot be read
(malformed, or cut off by max_tokens) ends the calls: it and the text after it are content.

Arguments are JSON text built a parameter at a time, so what a stream has sent is always a
prefix of the final arguments; a string parameter's text streams as it is generated.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from paged_engine.engine.detokenizer import stop_holdback
from paged_server.tool_parsers.base import ParsedCall
from paged_server.tool_parsers.framed import plain_name
from paged_server.tool_parsers.interleaved import Block, InterleavedToolParser
from paged_server.tool_parsers.streaming import PartialCall

_CALL_OPEN, _CALL_CLOSE = "<tool_call>", "</tool_call>"
_KEY_OPEN, _KEY_CLOSE = "<arg_key>", "</arg_key>"
_VALUE_OPEN, _VALUE_CLOSE = "<arg_value>", "</arg_value>"


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):  # a set, bytes, NaN, ...: no JSON form
        return False
    return True


def glm_value(text: str, schema: Any) -> Any:
    """One <arg_value>'s text as the value of the arguments' JSON."""
    if isinstance(schema, dict) and schema.get("type") == "string":
        return text
    word = text.strip()
    for read in (json.loads, ast.literal_eval):
        try:
            value = read(word)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if _is_json(value):
            return json.loads(json.dumps(value))  # a literal's tuples as lists
    return word


def _field(key: str, value: Any) -> str:
    return json.dumps({key: value}, ensure_ascii=False)[1:-1]  # "key": value


class Glm45ToolParser(InterleavedToolParser):
    start_markers = (_CALL_OPEN,)
    keeps_special_tokens = True  # vLLM keeps them for GLM too (added tokens)
    blank_is_no_content = True  # vLLM's answer: whitespace-only content is None
    _scanned: tuple[str, list[tuple[int, PartialCall]]] | None = None  # (text, its scan)

    def blocks(self, text: str, final: bool) -> list[Block]:
        return [
            Block(start, call.end, [ParsedCall(call.name, call.args)])
            if call.name is not None and call.args_done
            else Block(start, None, None)
            for start, call in self._scan(text)
        ]

    def partial_calls(self, text: str) -> list[PartialCall]:
        return [call for _, call in self._scan(text)]

    def _scan(self, text: str) -> list[tuple[int, PartialCall]]:
        """`_scan_calls(text)`, once per text: a stream's rescan asks for the calls and then
        for the blocks of the same text."""
        if self._scanned is None or self._scanned[0] is not text:
            self._scanned = (text, self._scan_calls(text))
        return self._scanned[1]

    def _scan_calls(self, text: str) -> list[tuple[int, PartialCall]]:
        """(where it starts, the call) for every call, the last one as far as it has arrived;
        a malformed call ends the scan with its arguments never done."""
        calls: list[tuple[int, PartialCall]] = []
        pos = 0
        while (pos := text.find(_CALL_OPEN, pos)) >= 0:
            call = PartialCall()
            calls.append((pos, call))
            pos += len(_CALL_OPEN)
            ends = [i for m in ("\n", _KEY_OPEN, _CALL_CLOSE) if (i := text.find(m, pos)) >= 0]
            if not ends:
                return calls
            name = text[pos : min(ends)].strip()
            if not plain_name(name):
                return calls
            call.name = name
            schema = self.schemas.get(name, {})
            props = schema.get("properties", {}) if isinstance(schema, dict) else {}
            props = props if isinstance(props, dict) else {}
            fields: list[str] = []
            pos = min(ends)
            while True:
                close = text.find(_CALL_CLOSE, pos)
                key = text.find(_KEY_OPEN, pos)
                if key < 0 or 0 <= close < key:
                    break
                if text[pos:key].strip():
                    return calls  # text between the parameters
                key_end = text.find(_KEY_CLOSE, key)
                value = text.find(_VALUE_OPEN, key_end) if key_end >= 0 else -1
                if value < 0:
                    return calls  # still arriving, or no value
                name_key = text[key + len(_KEY_OPEN) : key_end].strip()
                # GLM-4.7 may write the newline between key and value as the two characters \n
                if text[key_end + len(_KEY_CLOSE) : value].replace("\\n", "").strip():
                    return calls
                value += len(_VALUE_OPEN)
                value_end = text.find(_VALUE_CLOSE, value)
                kind = props.get(name_key)
                if value_end < 0:  # still arriving: a string's text so far streams
                    if isinstance(kind, dict) and kind.get("type") == "string":
                        raw = text[value:]
                        raw = raw[: len(raw) - stop_holdback(raw, (_VALUE_CLOSE,))]
                        call.args = "{" + ", ".join([*fields, _field(name_key, raw)[:-1]])
                    return calls
                fields.append(_field(name_key, glm_value(text[value:value_end], kind)))
                call.args = "{" + ", ".join(fields)
                pos = value_end + len(_VALUE_CLOSE)
            if close < 0 or text[pos:close].strip():
                return calls
            pos = close + len(_CALL_CLOSE)
            call.args, call.args_done, call.end = "{" + ", ".join(fields) + "}", True, pos
        return calls
