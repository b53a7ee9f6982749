"""Pythonic tool calls (Llama 3.2 / Llama 4): the whole output is a Python list of calls,
`[get_weather(city="Paris"), other(x=1)]` (Llama 4 may wrap it in <|python_start|> ...
<|python_end|>). Read with `ast`, never evaluated: keyword arguments with literal values only
(strings, numbers, True/False/None, lists, tuples, dicts); anything else is plain content."""

from __future__ import annotations

import ast
import json
import re

from paged_server.tool_parsers.base import ParsedCall, ToolParser
from paged_server.tool_parsers.streaming import PartialCall

_START, _END = "<|python_start|>", "<|python_end|>"
_NAME = re.compile(r"([A-Za-z_]\w*)\s*\(")


def _list_start(text: str) -> int:
    """Index of the list's "[" when the text opens with one (after the optional tag), else -1."""
    body = text.lstrip()
    if body.startswith(_START):
        body = body[len(_START) :].lstrip()
    return len(text) - len(body) if body.startswith("[") else -1


def _call(node: ast.expr) -> ParsedCall | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    args = {}
    for kw in node.keywords:
        if kw.arg is None:  # **mapping
            return None
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    try:  # sets, bytes, complex numbers, inf have no JSON form
        return ParsedCall(node.func.id, json.dumps(args, ensure_ascii=False, allow_nan=False))
    except (TypeError, ValueError):
        return None


def _parse_call(source: str) -> ParsedCall | None:
    try:
        return _call(ast.parse(source, mode="eval").body)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None


_ACTS = re.compile(r"[\"'()\[\]{}]")  # what _close_paren acts on outside strings
# inside a string: an escape (its next character skipped) or the closing quote
_STRING_END = {q: re.compile(r"\\|" + q) for q in ("'", '"', "'''", '"""')}


def _close_paren(s: str, i: int) -> int | None:
    """Index of the ")" closing a call whose arguments start at s[i] (strings and brackets
    aware); None while it has not arrived. It jumps between the characters it acts on (regex
    searches): a stream rescans a growing call."""
    depth = 1
    while (m := _ACTS.search(s, i)) is not None:
        i = m.start()
        c = s[i]
        if c in "'\"":
            quote = c * 3 if s.startswith(c * 3, i) else c
            end = _STRING_END[quote].search(s, i + len(quote))
            while end is not None and end.group() == "\\":
                end = _STRING_END[quote].search(s, end.start() + 2)
            if end is None:
                return None
            i = end.end()
            continue
        if c in "([{":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def list_calls(source: str) -> list[ParsedCall] | None:
    """The calls of a whole Python list of calls (`[f(x=1), g()]`, surrounding whitespace
    allowed); None unless every element is a call with literal keyword arguments."""
    try:
        tree = ast.parse(source.strip(), mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = [_call(e) for e in tree.elts]
    return None if any(c is None for c in calls) else [c for c in calls if c is not None]


def scan_list(text: str, start: int) -> list[PartialCall]:
    """The calls complete so far of the list opening at text[start] == "[", each whole (name
    and arguments as JSON): Python source is not JSON, so there is no prefix of the arguments
    to send, and a call is announced only once it is known to be one (literal arguments), since
    a stream cannot take it back."""
    calls: list[PartialCall] = []
    pos = start + 1
    while True:
        while pos < len(text) and text[pos] in " \n\t\r,":
            pos += 1
        m = _NAME.match(text, pos)
        if m is None:
            return calls
        close = _close_paren(text, m.end())
        call = None if close is None else _parse_call(text[m.start() : close + 1])
        if close is None or call is None:
            return calls
        calls.append(PartialCall(call.name, call.arguments, True, close + 1))
        pos = close + 1


class PythonicToolParser(ToolParser):
    start_markers = ("[", _START)
    blank_is_no_content = True

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        start = _list_start(text)
        if start < 0:
            return text, []
        body = text[start:].rstrip()
        if body.endswith(_END):
            body = body[: -len(_END)]
        calls = list_calls(body)
        if calls is None:
            return text, []  # not calls with literal arguments: the text stays content
        return None, calls

    def partial_calls(self, text: str) -> list[PartialCall]:
        start = _list_start(text)
        return [] if start < 0 else scan_list(text, start)
