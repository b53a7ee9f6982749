"""Llama 3.1 / 3.2 JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}`
(optionally after `<|python_tag|>`), several calls joined by ";"."""

from __future__ import annotations

import json

from paged_server.tool_parsers.base import ParsedCall, ToolParser
from paged_server.tool_parsers.streaming import PartialCall, scan_call

_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    start_markers = (_TAG, "{")
    blank_is_no_content = True

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip()
        if body.startswith(_TAG):
            body = body[len(_TAG) :].strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return text, []
            call = self.call_from(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return None, calls

    def partial_calls(self, text: str) -> list[PartialCall]:
        calls: list[PartialCall] = []
        pos = len(text) - len(text.lstrip())
        if text.startswith(_TAG, pos):
            pos += len(_TAG)
        while pos < len(text) and text[pos] in " \n\t;":
            pos += 1
        while pos < len(text) and text[pos] == "{":
            call = scan_call(text, pos, ("parameters", "arguments"))
            calls.append(call)
            if call.end is None:
                break
            pos = call.end
            while pos < len(text) and text[pos] in " \n\t;":
                pos += 1
        return calls
