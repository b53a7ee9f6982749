"""Tool calls as they are generated: OpenAI's streamed `delta.tool_calls`.

    {"index": k, "id": "call_...", "type": "function", "function": {"name": N, "arguments": ""}}
    {"index": k, "function": {"arguments": "<the next piece of the JSON text>"}}  ...

`scan_call` reads one call object of the model's text as far as it has arrived (its name once
the name string is complete; the raw text of its arguments object so far). `ToolCallDeltas`
turns successive scans into those entries: a call is announced once its name is known (calls
in order: a later one waits for the earlier one's name), then each new piece of its arguments
follows. Concatenated, a call's argument pieces are its arguments' JSON text exactly as the
model wrote it (the non-streamed answer re-serializes the same value).

A parser's `partial_calls` reads the whole text; rescanning it on every streamed piece would be
quadratic in a long output (a model writing 200k characters of arguments). `StreamingToolText`
rescans while the text is short, then only once the text has grown by 1/_RESCAN_GROWTH since the
last scan: the scans of an n-character output cost O(n) in all, and long arguments arrive in
pieces of about 1/_RESCAN_GROWTH of the text so far (the rest when the output ends). Text nested
past Python's recursion limit (json.loads of 100k "[" raises RecursionError, not ValueError) is
what any unreadable call is: content (base.py `parse_or_content`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from paged_engine.engine.detokenizer import stop_holdback
from paged_server.tool_parsers.base import ParsedCall, ToolParser, parse_or_content

_RESCAN_ALWAYS = 2048  # characters: a text this short is rescanned on every piece
_RESCAN_GROWTH = 8  # past it, rescanned once it grew by 1/_RESCAN_GROWTH since the last scan


@dataclass(slots=True)
class PartialCall:
    name: str | None = None
    args: str = ""  # raw JSON text of the arguments object so far ("" until it starts)
    args_done: bool = False
    end: int | None = None  # index just past the call object's closing brace, once complete


_IN_STRING = re.compile(r'["\\]')  # what ends or escapes inside a JSON string
_STRUCTURE = re.compile(r'["{}\[\]:,]')  # what the scan acts on outside strings


def scan_call(s: str, start: int, args_keys: tuple[str, ...]) -> PartialCall:
    """The call object starting at s[start] == "{" (JSON strings, escapes and nesting aware).
    Keys and values are tracked at depth 1 only: "name" (a string) and the first of
    `args_keys` whose value is an object. The scan jumps between the characters it acts on
    (regex searches), so rescanning a growing call on every streamed piece stays cheap."""
    call = PartialCall()
    depth, in_str, str_start = 0, False, 0
    last_key: str | None = None  # the last depth-1 string that can still become a key
    key: str | None = None  # the key whose value is being read (None: expecting a key)
    args_start = -1
    i, n = start, len(s)
    while i < n:
        if in_str:
            m = _IN_STRING.search(s, i)
            if m is None:
                break  # the string goes on past what has arrived
            i = m.start()
            if s[i] == "\\":
                i += 2  # the escaped character is never a quote that ends the string
                continue
            in_str = False
            if depth == 1:
                text = _loads(s[str_start : i + 1])
                if key is None:
                    last_key = text
                elif key == "name" and isinstance(text, str):
                    call.name = text
            i += 1
            continue
        m = _STRUCTURE.search(s, i)
        if m is None:
            break
        i = m.start()
        c = s[i]
        if c == '"':
            in_str, str_start = True, i
        elif c in "{[":
            depth += 1
            if depth == 2 and c == "{" and key in args_keys and args_start < 0:
                args_start = i
        elif c in "}]":
            depth -= 1
            if depth == 1 and args_start >= 0 and not call.args_done:
                call.args, call.args_done = s[args_start : i + 1], True
            if depth == 0:
                call.end = i + 1
                break
        elif depth == 1 and c == ":":
            key = last_key if isinstance(last_key, str) else None
        elif depth == 1 and c == ",":
            key = last_key = None
        i += 1
    if args_start >= 0 and not call.args_done:
        call.args = s[args_start:]
    return call


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


@dataclass(slots=True)
class ToolCallDeltas:
    """What of each call was sent: its id once announced, and how much of its arguments."""

    ids: list[str] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)

    def update(self, partial: list[PartialCall]) -> list[dict[str, Any]]:
        out = []
        for k, call in enumerate(partial):
            if call.name is None:
                break  # announce calls in order
            if k == len(self.ids):
                self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
                self.sent.append(0)
                fn = {"name": call.name, "arguments": call.args}
                out.append({"index": k, "id": self.ids[k], "type": "function", "function": fn})
            elif len(call.args) > self.sent[k]:
                out.append({"index": k, "function": {"arguments": call.args[self.sent[k] :]}})
            self.sent[k] = len(call.args)
        return out

    def finish(self, partial: list[PartialCall], calls: list[ParsedCall]) -> list[dict[str, Any]]:
        """The rest of every call once the output is complete. A call whose arguments never
        streamed (not a JSON object in the text, e.g. a JSON string) gets them whole now."""
        out = []
        for k, call in enumerate(calls):
            raw = partial[k].args if k < len(partial) and partial[k].args_done else ""
            if k >= len(self.ids):
                self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
                self.sent.append(0)
                fn = {"name": call.name, "arguments": raw or call.arguments}
                out.append({"index": k, "id": self.ids[k], "type": "function", "function": fn})
            elif self.sent[k] == 0 and not raw:
                out.append({"index": k, "function": {"arguments": call.arguments}})
            elif len(raw) > self.sent[k]:
                out.append({"index": k, "function": {"arguments": raw[self.sent[k] :]}})
        return out


class StreamingToolText:
    """Feeds streamed text through a parser: content while no tool call may have started, then
    the calls piece by piece (`ToolCallDeltas` entries), and the rest when the output ends."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of text already streamed as content
        self.holding = False  # a tool call may have started: no more content streams
        self.deltas = ToolCallDeltas()
        self.scanned = 0  # len(text) at the last partial_calls scan
        self.blank = 0  # text[:blank] is whitespace (_no_content_yet)
        self.longest = max(map(len, parser.start_markers), default=1)  # the longest marker

    def _updates(self) -> list[dict[str, Any]]:
        """The calls' new entries, when a rescan is due (see the module docstring)."""
        n = len(self.text)
        if n > _RESCAN_ALWAYS and (n - self.scanned) * _RESCAN_GROWTH < n:
            return []
        self.scanned = n
        try:
            return self.deltas.update(self.parser.partial_calls(self.text))
        except RecursionError:  # nested past the limit: no call to announce (yet)
            return []

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """(content to show now, tool_calls entries to send now)."""
        text = self.text  # appended in place: the attribute is not holding it meanwhile
        self.text = ""
        text += delta
        self.text = text
        if self.holding:
            return "", self._updates()
        # a marker not found before this delta can only start in its last `longest` - 1
        # characters or in the delta (nothing is read twice: a long stream stays linear)
        markers, longest = self.parser.start_markers, self.longest
        seen = max(self.sent, len(text) - len(delta) - longest + 1)
        start = -1
        for m in markers:  # (a loop: a comprehension over `text` would close over it, and a
            # closed-over `text` is copied by `+=` above instead of grown in place)
            i = text.find(m, seen)
            if i >= 0 and (start < 0 or i < start):
                start = i
        if start >= 0:
            self.holding = True
            end = start
        else:  # the tail that may begin a marker waits
            end = len(text) - stop_holdback(
                text[max(self.sent, len(text) - longest + 1) :], markers
            )
        if self.parser.trim_before_calls:  # a trailing run of them may end the content
            kept = text[self.sent : end].rstrip(self.parser.trim_before_calls)
            end = self.sent + len(kept)
        if not self.sent and self._no_content_yet(end):  # (what may still be none waits)
            return "", self._updates() if self.holding else []
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out, self._updates() if self.holding else []

    def _no_content_yet(self, end: int) -> bool:
        """parser.no_content(text[:end]) while nothing is sent (once content is sent, it never
        is again: no_content's rule). Under the whitespace rule the blank start found so far is
        not read again, so a stream of whitespace alone stays linear."""
        if type(self.parser).no_content is not ToolParser.no_content or not (
            self.parser.blank_is_no_content
        ):
            return self.parser.no_content(self.text[:end])
        if self.text[self.blank : end].strip():
            return False
        self.blank = max(self.blank, end)
        return True

    def finish(self) -> tuple[str, list[dict[str, Any]], list[ParsedCall]]:
        """(content not streamed yet, the calls' remaining entries, the calls) once the output
        is complete. The content streamed in all is the non-streamed answer's: a parser's
        content is a prefix of the text (`ToolParser.content_before`; interleaved.py: it starts
        with all the content streamed), of which the stream has sent `sent` characters; the
        rest of it is sent now (text that was held back because a
        call might have started there and turned out to be content, e.g. a block that was
        not calls before the one that is). Text that turns out not to be well-formed calls is
        content after all (a call already announced stays announced: the stream cannot take
        it back)."""
        content, calls = parse_or_content(self.parser, self.text)
        if not calls:
            return self.text[self.sent :], [], []
        try:
            partial = self.parser.partial_calls(self.text)
        except RecursionError:  # (parse read the calls: their arguments are sent whole)
            partial = []
        return (content or "")[self.sent :], self.deltas.finish(partial, calls), calls
