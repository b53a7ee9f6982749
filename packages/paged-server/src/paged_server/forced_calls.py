"""Forced tool calls (tool_choice "required" or a named function), whole or streamed as they
are generated. One reader serves both forms, so a stream's argument pieces of a call join to
exactly the arguments of the non-streamed answer for the same output:

    named       the output is the call's arguments: sent as written, whole and streamed (as
                vLLM sends a named call's text both ways)
    "required"  the output is a JSON list of {"name", "parameters"} objects: a call is announced
                once its name string is complete, its arguments are its "parameters" value as
                json.dumps(..., ensure_ascii=False) writes it (vLLM's non-streamed answer),
                streamed as that text settles

Cut short by max_tokens, a named call is its partial text; "required" gives the calls announced
so far, the last one with the re-serialized prefix of its arguments.

`JsonRewriter` re-serializes JSON text incrementally, token by token: brackets, `", "` and
`": "` separators, a string's characters as soon as no escape is pending (a high surrogate
waits for its low half), a number or literal once it ends. Every split of a text gives pieces
that join to the same text: json.dumps(json.loads(text)) for a document without duplicate keys
(a call's second "parameters" key is left out; an invalid escape, never under a forced
grammar, is kept as written, alone, its string's other escapes decoded).
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from paged_server.tool_parsers.base import ParsedCall

_WHITESPACE = " \t\n\r"
_SPACES = re.compile(r"[ \t\n\r]*")
_SCALAR = re.compile(r'[^ \t\n\r{}\[\]:,"]+')  # a number or literal's characters
_STRING_STOP = re.compile(r'["\\]')  # what can end a string's plain run
# the longest prefix of a string's raw content made of whole characters and escapes (an
# invalid "\u" escape is whole once a character that is no hex digit follows it: raw text
# after it never waits on it)
_COMPLETE = re.compile(
    r"[^\\]*(?:\\(?:[^u]|u[0-9a-fA-F]{4}|u[0-9a-fA-F]{0,3}(?=[^0-9a-fA-F]))[^\\]*)*"
)
# an escape: group 1 set when it is valid JSON (the rest is written as it stands)
_ESCAPE = re.compile(r'\\(?:(["\\/bfnrt]|u[0-9a-fA-F]{4})|.|\Z)', re.DOTALL)
_HIGH_SURROGATE_TAIL = re.compile(r"(?<!\\)(?:\\\\)*\\u[dD][89abAB][0-9a-fA-F]{2}$")


@dataclass(slots=True)
class _Level:
    """One open container: "{" or "["; an object's last key and where it is in a member."""

    kind: str
    key: str | None = None
    phase: str = "key"  # "key" | "colon" | "value" | "after" (an array: "value" | "after")


class JsonRewriter:
    """Feeds JSON text in pieces; `out` collects the re-serialized pieces (`_emit`)."""

    def __init__(self) -> None:
        self.stack: list[_Level] = []
        self.out: list[str] = []
        self.in_string = False
        self.escape = False  # the last piece ended in the backslash of an escape
        self.raw: list[str] = []  # an open string's content not yet decoded (pending escapes)
        self.decoded: list[str] | None = None  # an open key's / shallow string's characters
        self.scalar = ""  # a number or literal being read

    def feed(self, text: str) -> None:
        i, n = 0, len(text)
        while i < n:
            if self.escape:  # the escaped character never ends the string
                self.raw.append(text[i])
                self.escape, i = False, i + 1
                continue
            if self.in_string:
                m = _STRING_STOP.search(text, i)
                if m is None:
                    self.raw.append(text[i:])
                    break
                j = m.start()
                self.raw.append(text[i:j])
                if text[j] == "\\":
                    self.raw.append("\\")
                    self.escape, i = True, j + 1
                    continue
                self._end_string()
                i = j + 1
                continue
            c = text[i]
            if c in '{}[]:,"':
                if self.scalar:
                    self._end_scalar()
                self._structure(c)
                i += 1
            elif c in _WHITESPACE:
                if self.scalar:
                    self._end_scalar()
                i = _SPACES.search(text, i).end()  # (an empty match at worst)
            else:
                m = _SCALAR.match(text, i)
                assert m is not None
                self.scalar += m.group()
                i = m.end()
        if self.in_string:
            self._string_piece(final=False)

    def finish(self) -> None:
        """The output ended: what is pending is written as it stands (a cut-off text)."""
        if self.scalar:
            self._end_scalar()
        if self.in_string:
            self._string_piece(final=True)

    def text(self) -> str:
        return "".join(self.out)

    # ---- tokens -----------------------------------------------------------------------------
    def _structure(self, c: str) -> None:
        top = self.stack[-1] if self.stack else None
        if c == '"':
            self.in_string = True
            keep = len(self.stack) <= 2 or (top is not None and top.phase == "key")
            self.decoded = [] if keep else None
            self._emit('"')
        elif c in "{[":
            self._emit(c)
            self.stack.append(_Level(c, phase="key" if c == "{" else "value"))
        elif c in "}]":
            self._emit(c)
            if self.stack:
                self.stack.pop()
            self._value_done()
        elif c == ":":
            self._emit(": ")
            if top is not None and top.phase == "colon":
                top.phase = "value"
        else:  # ","
            self._emit(", ")
            if top is not None:
                top.phase = "key" if top.kind == "{" else "value"

    def _end_scalar(self) -> None:
        text, self.scalar = self.scalar, ""
        with contextlib.suppress(ValueError):  # not JSON (never under a forced grammar): as is
            text = json.dumps(json.loads(text))
        self._emit(text)
        self._value_done()

    def _string_piece(self, final: bool) -> None:
        """Write the open string's settled characters (all of them when `final`)."""
        raw = "".join(self.raw)
        end = len(raw)
        if not final:
            end = _COMPLETE.search(raw).end()  # (it matches at 0, empty at worst)
            if _HIGH_SURROGATE_TAIL.search(raw, 0, end):
                end -= 6  # its low half may follow
        if end <= 0:
            self.raw = [raw]
            return
        piece, self.raw = raw[:end], [raw[end:]]
        chars = _decode(piece)
        if self.decoded is not None:
            self.decoded.append(chars)
        self._emit(json.dumps(chars, ensure_ascii=False)[1:-1])

    def _end_string(self) -> None:
        self._string_piece(final=True)
        self.in_string = False
        self._emit('"')
        chars = None if self.decoded is None else "".join(self.decoded)
        self.decoded = None
        top = self.stack[-1] if self.stack else None
        if top is not None and top.kind == "{" and top.phase == "key":
            top.key, top.phase = chars, "colon"
            return
        self._string_value(chars)
        self._value_done()

    def _value_done(self) -> None:
        if self.stack and self.stack[-1].phase == "value":
            self.stack[-1].phase = "after"

    # ---- hooks ------------------------------------------------------------------------------
    def _emit(self, piece: str) -> None:
        self.out.append(piece)

    def _string_value(self, chars: str | None) -> None:
        """A string value ended (its characters when at depth <= 2)."""


def _decode(raw: str) -> str:
    """A string's raw content decoded; an invalid escape (never under a forced grammar) stays
    as written, alone, so that how the text was split never changes the result."""
    if "\\" not in raw:  # (raw control characters are allowed: strict=False)
        return raw
    out: list[str] = []
    pos = 0
    for m in _ESCAPE.finditer(raw):
        if m.group(1) is None:
            out += [json.loads(f'"{raw[pos : m.start()]}"', strict=False), m.group()]
            pos = m.end()
    out.append(json.loads(f'"{raw[pos:]}"', strict=False))
    return "".join(out)


@dataclass(slots=True)
class _Call:
    name: str | None = None
    args: list[str] = field(default_factory=list)  # the re-serialized arguments' pieces
    sent: int = 0  # pieces already streamed
    index: int = -1  # in the stream, once announced
    params: int = 0  # "parameters" keys read: the first one's value is the arguments


class _CallList(JsonRewriter):
    """A "required" output, `[{"name": N, "parameters": {...}}, ...]`: each call object's name
    and the re-serialized pieces of its "parameters" value."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[_Call] = []

    def _in_call(self) -> bool:
        s = self.stack
        return len(s) >= 2 and s[0].kind == "[" and s[1].kind == "{"

    def _structure(self, c: str) -> None:
        if c == "{" and len(self.stack) == 1 and self.stack[0].kind == "[":
            self.calls.append(_Call())
        super()._structure(c)

    def _emit(self, piece: str) -> None:
        if not self._in_call():
            return
        call = self.stack[1]  # inside its "parameters" value: a token of the value
        inside = call.key == "parameters" and (len(self.stack) > 2 or call.phase == "value")
        if inside and self.calls[-1].params == 1:  # (a second "parameters" key is left out)
            self.calls[-1].args.append(piece)

    def _end_string(self) -> None:
        super()._end_string()
        if self._in_call() and len(self.stack) == 2:
            call = self.stack[1]
            if call.phase == "colon" and call.key == "parameters":
                self.calls[-1].params += 1

    def _string_value(self, chars: str | None) -> None:
        named = self._in_call() and len(self.stack) == 2 and self.stack[1].key == "name"
        if named and isinstance(chars, str) and self.calls[-1].name is None:
            self.calls[-1].name = chars  # (a second "name" key changes nothing)


class ForcedCalls:
    """One choice's forced output -> tool-call stream entries (`feed` per piece of text, `finish`
    once it ended) and its calls. An entry announcing a call carries a placeholder "id" that
    the caller replaces with its own (tools.ToolOutput)."""

    def __init__(self, named: str | None) -> None:
        self.named = named  # None: "required"
        self.pieces: list[str] = []  # named: the text so far
        self.announced = False
        self.list = _CallList() if named is None else None
        self.done = 0  # calls before this one ended and were sent in full
        self.count = 0  # calls announced

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.list is None:
            if not text:
                return []
            self.pieces.append(text)
            return [self._named_entry(text)]
        self.list.feed(text)
        return self._updates()

    def finish(self) -> tuple[list[dict[str, Any]], list[ParsedCall]]:
        """(the remaining entries, the calls) once the output is complete."""
        if self.list is None:
            rest = [] if self.announced else [self._named_entry("")]
            assert self.named is not None
            return rest, [ParsedCall(self.named, "".join(self.pieces))]
        self.list.finish()
        rest = self._updates()
        calls = [c for c in self.list.calls if c.index >= 0]
        return rest, [ParsedCall(c.name or "", "".join(c.args)) for c in calls]

    def _named_entry(self, args: str) -> dict[str, Any]:
        if self.announced:
            return {"index": 0, "function": {"arguments": args}}
        self.announced = True
        return _announce(0, self.named or "", args)

    def _updates(self) -> list[dict[str, Any]]:
        assert self.list is not None
        out = []
        calls = self.list.calls
        for call in calls[self.done :]:
            if call.name is None:
                continue  # (a later call starts after this one ended: it is never announced)
            args = "".join(call.args[call.sent :])
            call.sent = len(call.args)
            if call.index < 0:
                call.index, self.count = self.count, self.count + 1
                out.append(_announce(call.index, call.name, args))
            elif args:
                out.append({"index": call.index, "function": {"arguments": args}})
        self.done = max(self.done, len(calls) - 1)  # a call starts once the one before ended
        return out


def _announce(index: int, name: str, args: str) -> dict[str, Any]:
    fn = {"name": name, "arguments": args}
    return {"index": index, "id": "", "type": "function", "function": fn}


def forced_calls(text: str, named: str | None) -> list[ParsedCall]:
    """The calls of a whole forced output: what a stream of it announces."""
    reader = ForcedCalls(named)
    reader.feed(text)
    return reader.finish()[1]
