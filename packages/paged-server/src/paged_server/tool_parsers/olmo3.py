"""Olmo 3 tool calls (vLLM's `olmo3`): pythonic calls, one or more per line,

    CONTENT<function_calls>
    get_weather(city="Paris", days=3)
    clock(tz=null)
    </function_calls>

or the same lines bare, the whole output (the tags may be special tokens the server skips).
The lines are joined into one list, `[line1, line2, ...]`, and read as pythonic.py reads Llama's
(`ast`, never evaluated; keyword arguments with literal values only), JSON's null / true / false
also accepted as values. The closing </function_calls> is required, as in vLLM. Text before
<function_calls> is the content (vLLM drops it, and streams the whole text as content when any
comes first); text after it is dropped. Bare lines that are not all calls are content.

Streamed, a call is announced whole once its line is complete (Python source is not JSON: there
is no prefix of the arguments to send); bare calls are recognized at the very start of the
output, so content that opens with a word is held back until the word ends (bare_calls.py).
"""

from __future__ import annotations

import ast
import re
from typing import Any

from paged_server.tool_parsers.bare_calls import BareCallsStream
from paged_server.tool_parsers.base import ParsedCall, ToolParser
from paged_server.tool_parsers.pythonic import list_calls
from paged_server.tool_parsers.streaming import PartialCall

OPEN, CLOSE = "<function_calls>", "</function_calls>"
_CALL = re.compile(r"[A-Za-z]\w*\(")  # a bare call opens the output: NAME(
_WORD = re.compile(r"[A-Za-z]\w*")
_JSON_NAMES = {"null": None, "true": True, "false": False}


class _JsonNames(ast.NodeTransformer):
    """null / true / false as the constants they name in JSON."""

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in _JSON_NAMES:
            return ast.copy_location(ast.Constant(_JSON_NAMES[node.id]), node)
        return node


def line_calls(lines: list[str]) -> list[ParsedCall] | None:
    """The calls of the non-empty lines joined into one list; None unless all are calls."""
    source = "[" + ", ".join(s for line in lines if (s := line.strip())) + "]"
    try:
        tree = _JsonNames().visit(ast.parse(source, mode="eval"))
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    return list_calls(ast.unparse(tree))


class Olmo3ToolParser(ToolParser):
    start_markers = (OPEN,)
    blank_is_no_content = True

    def _body(self, text: str) -> tuple[int, int, int | None, bool]:
        """(where the calls start, where their lines start, where the lines end: the closing
        tag, None while it has not arrived or for bare calls, whether the form is complete so
        far as its tags go); start -1 when the text is neither form."""
        start = text.find(OPEN)
        if start >= 0:
            end = text.find(CLOSE, start)
            return start, start + len(OPEN), (end if end >= 0 else None), end >= 0
        if _CALL.match(text.lstrip()):
            return 0, 0, None, True
        return -1, -1, None, False

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        start, body, end, closed = self._body(text)
        if start < 0 or not closed:
            return text, []
        calls = line_calls(text[body:end].splitlines())
        if not calls:
            return text, []
        return self.content_before(text, start), calls

    def partial_calls(self, text: str) -> list[PartialCall]:
        start, body, end, _ = self._body(text)
        if start < 0:
            return []
        lines = text[body:end].splitlines(keepends=True)
        if end is None and lines and lines[-1].splitlines() == [lines[-1]]:
            lines.pop()  # the line still arriving (no line break after it yet)
        calls = line_calls(lines) or []
        return [PartialCall(c.name, c.arguments, True) for c in calls]

    def streamer(self) -> Any:
        return BareCallsStream(self)

    def bare_start(self, text: str, sent: int) -> int | None:
        if sent:
            return None
        body = text.lstrip()
        if _CALL.match(body):
            return len(text) - len(body)
        return -1 if _WORD.fullmatch(body) or not body else None
