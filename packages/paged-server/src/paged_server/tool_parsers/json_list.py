"""Tool calls as one JSON list after a marker, `MARKER[{"name": ..., "arguments": {...}}, ...]`
(text before the marker is the message content):

    MistralToolParser   [TOOL_CALLS][...]; 9-character call ids (Mistral's templates check them)
    GraniteToolParser   <|tool_call|>[...] (Granite 3.x; "<tool_call>" spelled out also counts)
    Phi4MiniToolParser  functools[...] (Phi-4-mini)

A call's arguments may be under "arguments" or "parameters". `[TOOL_CALLS]` and `<|tool_call|>`
are special tokens: the server keeps special tokens in the text of a request these parsers read
(`keeps_special_tokens`), as vLLM does.
"""

from __future__ import annotations

import json
import secrets
import string

from paged_server.tool_parsers.base import ParsedCall, ToolParser
from paged_server.tool_parsers.streaming import PartialCall, scan_call

_ID_CHARS = string.ascii_letters + string.digits
_SEPARATORS = " \n\t\r,"
_ARGS_KEYS = ("arguments", "parameters")


class JsonListToolParser(ToolParser):
    def _marker(self, text: str) -> tuple[int, int]:
        """(where the first marker starts, where the text after it starts); (-1, -1): none."""
        found = [(i, i + len(m)) for m in self.start_markers if (i := text.find(m)) >= 0]
        return min(found, default=(-1, -1))

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        start, after = self._marker(text)
        if start < 0:
            return text, []
        body = text[after:].strip()
        try:
            value, end = json.JSONDecoder().raw_decode(body)
        except ValueError:
            return text, []
        if body[end:].strip() or not isinstance(value, list) or not value:
            return text, []  # not one list of calls: the text stays content
        calls = [self.call_from(item, "parameters") for item in value]
        if any(c is None for c in calls):
            return text, []
        return self.content_before(text, start), [c for c in calls if c is not None]

    def partial_calls(self, text: str) -> list[PartialCall]:
        _, pos = self._marker(text)
        return [] if pos < 0 else scan_call_list(text, pos, _ARGS_KEYS)


def scan_call_list(text: str, pos: int, args_keys: tuple[str, ...]) -> list[PartialCall]:
    """The call objects of the JSON list at text[pos] (after whitespace), as far as the text has
    arrived: every complete one, then the one being written (its `end` None)."""
    calls: list[PartialCall] = []
    while pos < len(text) and text[pos] in " \n\t\r":
        pos += 1
    if not text.startswith("[", pos):
        return calls
    pos += 1
    while True:
        while pos < len(text) and text[pos] in _SEPARATORS:
            pos += 1
        if pos >= len(text) or text[pos] != "{":
            return calls
        call = scan_call(text, pos, args_keys)
        calls.append(call)
        if call.end is None:
            return calls
        pos = call.end


class MistralToolParser(JsonListToolParser):
    start_markers = ("[TOOL_CALLS]",)
    keeps_special_tokens = True

    @staticmethod
    def new_call_id() -> str:
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


class GraniteToolParser(JsonListToolParser):
    start_markers = ("<|tool_call|>", "<tool_call>")
    keeps_special_tokens = True


class Phi4MiniToolParser(JsonListToolParser):
    start_markers = ("functools",)
