"""Salesforce xLAM tool calls (vLLM's `xlam`): a JSON list of calls,

    [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]

as the whole answer (after `</think>` when the model thinks), or inside one of
```json ... ``` (or a bare ``` fence), [TOOL_CALLS] ... (to the end of that line) and
<tool_call> ... </tool_call>. The first of those, in the order they stand in the text, that holds
a non-empty list of call objects is the calls; text before it is the content (with the
thinking, when the reasoning parser has not taken it), text after it is dropped (as vLLM's
stream drops it; its non-streamed answer keeps the text around a fenced or tagged list as
content). A block that holds anything else is content and the search goes on; vLLM's answer
differs there when that block holds JSON that is not a list (it stops, and drops the block).

A call's "arguments" may be an object or its JSON text (vLLM passes text through unread), and
a call without them has none, `{}`; an item that is not a call object leaves its block content,
where vLLM drops the item (and a call without "arguments").

Streamed, content stops at the first ``` / [TOOL_CALLS] / <tool_call>, or at a "[" opening the
answer; what turns out not to be calls is sent as content when the output ends (bare_calls.py).
The content is kept as written, whitespace alone before the calls none: vLLM's answer strips it
while its stream sends it as written; here both forms agree (base.py `content_before`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from paged_server.tool_parsers.bare_calls import BareCallsStream
from paged_server.tool_parsers.base import ParsedCall, ToolParser
from paged_server.tool_parsers.json_list import scan_call_list
from paged_server.tool_parsers.streaming import PartialCall

THINK_END = "</think>"
FENCE, TOOL_CALLS, TOOL_CALL, TOOL_CALL_END = "```", "[TOOL_CALLS]", "<tool_call>", "</tool_call>"
_CLOSERS = {FENCE: FENCE, TOOL_CALLS: "\n", TOOL_CALL: TOOL_CALL_END}
_SEPARATORS = " \n\t\r,"


def _answer_start(text: str) -> int:
    """Where the answer starts: after the first </think>, else at the start."""
    think = text.find(THINK_END)
    return 0 if think < 0 else think + len(THINK_END)


def _lead(text: str, pos: int) -> int:
    return len(text) - len(text[pos:].lstrip())


class XlamToolParser(ToolParser):
    start_markers = (FENCE, TOOL_CALLS, TOOL_CALL)
    blank_is_no_content = True

    def _blocks(self, text: str, since: int = 0) -> Iterator[tuple[int, int, int, bool]]:
        """Each place a list of calls may stand, in order: (where the block starts, where its
        list's text starts, where it ends, whether that end is there: a fence's or a tag's
        closing; a [TOOL_CALLS] line and the whole answer end with the text). Only blocks
        starting at `since` or later."""
        lead = _lead(text, _answer_start(text))
        found = [(lead, lead)] if lead >= since and text.startswith("[", lead) else []
        for marker in _CLOSERS:
            pos = text.find(marker, since)
            while pos >= 0:
                found.append((pos, pos + len(marker)))
                pos = text.find(marker, pos + len(marker))
        for start, body in sorted(found):
            if start == body:
                yield start, body, len(text), True
                continue
            marker = text[start:body]
            if marker == FENCE:  # an optional "json" after the fence
                tail = text[body : body + 4]
                if tail == "json":
                    body += 4
                elif tail and "json".startswith(tail) and body + len(tail) == len(text):
                    body = len(text)  # may still become ```json
            end = text.find(_CLOSERS[marker], body)
            if end < 0 and marker == TOOL_CALLS:
                end = len(text)  # the line ends with the text
            yield start, body, (end if end >= 0 else len(text)), end >= 0

    def _calls(self, body: str) -> list[ParsedCall] | None:
        """The calls of a list's whole text; None unless it is a non-empty list of calls."""
        try:
            items = json.loads(body)
        except ValueError:
            return None
        listed = [self.call_from(item) for item in items] if isinstance(items, list) else []
        if not listed or any(c is None for c in listed):
            return None
        return [c for c in listed if c is not None]

    def _read(self, text: str) -> tuple[int, list[ParsedCall]]:
        """(where the block of the calls starts, the calls); (-1, []) when there are none."""
        for start, body, end, closed in self._blocks(text):
            calls = self._calls(text[body:end]) if closed else None
            if calls:
                return start, calls
        return -1, []

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        start, calls = self._read(text)
        if not calls:
            return text, []
        return self.content_before(text, start), calls

    # A stream's text only grows: blocks closed and not calls stay so. partial_calls passes
    # over them from the next scan on (without this, 200k characters of ``` streamed in 5 s).
    _dead = ""  # the text up to where every block starting earlier is closed and not calls

    def partial_calls(self, text: str) -> list[PartialCall]:
        """The calls of the first block that may still be calls: one whose end has arrived
        and that is not calls, or that can no longer become a list of calls, is passed over."""
        if not text.startswith(self._dead):  # another text than the one scanned before
            self._dead = ""
        dead, all_dead = len(self._dead), True  # (blocks come in order of their starts)
        for start, body, end, _closed in self._blocks(text, dead):
            if end < len(text) and self._calls(text[body:end]) is None:
                dead = start + 1 if all_dead else dead
                continue
            all_dead = False
            if end == len(text) and not _may_be_calls(text[body:]):
                continue
            self._dead = text[:dead]
            return scan_call_list(text[:end], body, ("arguments",))
        self._dead = text[:dead]
        return []

    def streamer(self) -> Any:
        return BareCallsStream(self)

    def bare_start(self, text: str, sent: int) -> int | None:
        answer = _answer_start(text)
        if sent > answer and text[answer:sent].strip():
            return None  # the answer has begun with content
        lead = _lead(text, max(sent, answer))
        if lead == len(text):
            return -1
        return lead if text[lead] == "[" else None


def _may_be_calls(body: str) -> bool:
    """Whether a list's text so far may still become a list of call objects."""
    body = body.strip()
    if not body:
        return True
    if body[0] != "[":
        return False
    calls = scan_call_list(body, 0, ("arguments",))
    if calls and calls[-1].end is None:
        return True  # a call still arriving
    pos = calls[-1].end if calls else 1
    while pos < len(body) and body[pos] in _SEPARATORS:
        pos += 1
    return pos == len(body) or (bool(calls) and body[pos] == "]")  # closed: its end decides
