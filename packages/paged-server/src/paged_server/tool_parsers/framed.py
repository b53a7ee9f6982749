"""Tool calls framed by special tokens, each a header naming the function followed by its
arguments as one JSON object (DeepSeek-V3 / V3.1 in deepseek.py, Kimi K2 in kimi_k2.py):

    CONTENT <section begin> <call begin> HEADER {ARGS} <call end> <call begin> ... <section end>

A subclass says how its header reads (`header`: the name, the call's id as the model wrote it,
where the arguments may start) and what may stand between the header and the arguments' `{`
(`gap_ok`). Text before the first marker is the content; text between or after the calls is
dropped. A call is well formed when its name is a plain word and its arguments are a complete
JSON object; the `<call end>` token itself is not required (the arguments' closing brace ends
the call), so a call whose closing token was cut off by max_tokens still counts. Anything else
leaves the whole text as content.

Streamed, a call is announced once its header is complete, then its arguments follow as the
model writes them (the raw JSON text; the non-streamed answer re-serializes the same value).
The markers are special tokens: the server keeps them in the text (`keeps_special_tokens`).
Slow tokenizers may put spaces around special tokens when decoding; whitespace around the header
and the arguments is ignored.
"""

from __future__ import annotations

import json
from typing import Any

from paged_server.tool_parsers.base import ParsedCall, ToolParser
from paged_server.tool_parsers.streaming import PartialCall, scan_call


def object_end(s: str, start: int) -> int | None:
    """Index just past the JSON object (or array) opening at s[start]; None while it is still
    open (strings and escapes aware: streaming.py's scanner)."""
    return scan_call(s, start, ()).end


def blocks(text: str, open_tag: str, close_tag: str) -> list[tuple[int, int | None]]:
    """(where each open_tag ... close_tag block's body starts, where its close tag starts or
    None while it is open), in order; a block left open ends the list."""
    out: list[tuple[int, int | None]] = []
    pos = text.find(open_tag)
    while pos >= 0:
        body = pos + len(open_tag)
        end = text.find(close_tag, body)
        out.append((body, end if end >= 0 else None))
        if end < 0:
            break
        pos = text.find(open_tag, end + len(close_tag))
    return out


def plain_name(name: str) -> bool:
    """A function name as a header carries it: one word, no markup."""
    return bool(name) and not any(c in '<>{}"' or c.isspace() for c in name)


def json_object(text: str) -> dict[str, Any] | None:
    """`text` read as a JSON object; None when it is not one (or nested past the recursion
    limit: json.loads raises RecursionError, not ValueError, on 100k "[")."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


class FramedToolParser(ToolParser):
    keeps_special_tokens = True
    call_begin: str = ""
    call_ids: list[str] = []  # noqa: RUF012 - the last scan's ids, replaced per scan

    def header(self, text: str, pos: int) -> tuple[str, str, int] | None:
        """The header after a call's begin token (text[pos:]): (function name, the call's id
        as written, where its arguments may start); None until it is complete. A malformed
        header gives a name that is not `plain_name`."""
        raise NotImplementedError

    def gap_ok(self, gap: str) -> bool:
        """Whether `gap` may stand between the header and the arguments' opening brace."""
        return not gap.strip()

    def _start(self, text: str) -> int:
        return min((i for m in self.start_markers if (i := text.find(m)) >= 0), default=-1)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        start = self._start(text)
        if start < 0:
            return text, []
        calls = []
        for call in self.partial_calls(text):
            args = json_object(call.args) if call.args_done else None
            if call.name is None or args is None:  # malformed or cut short: all content
                return text, []
            calls.append(ParsedCall(call.name, json.dumps(args, ensure_ascii=False)))
        if not calls:
            return text, []
        return self.content_before(text, start), calls

    def partial_calls(self, text: str) -> list[PartialCall]:
        calls, self.call_ids, _ = self._scan(text)
        return calls

    def _scan(self, text: str) -> tuple[list[PartialCall], list[str], list[int]]:
        """Every call begun in `text`, the last one as far as it has arrived (a malformed one
        ends the scan, its arguments never done; `end` just past the arguments once done),
        the ids of those whose header is read, and where each call's begin token stands."""
        calls: list[PartialCall] = []
        ids: list[str] = []
        begins: list[int] = []
        start = self._start(text)
        pos = text.find(self.call_begin, start) if start >= 0 else -1
        while pos >= 0:
            call = PartialCall()
            calls.append(call)
            begins.append(pos)
            head = self.header(text, pos + len(self.call_begin))
            if head is None:
                break
            name, call_id, pos = head
            if not plain_name(name):
                break
            call.name = name
            ids.append(call_id)
            brace = text.find("{", pos)
            if brace < 0 or not self.gap_ok(text[pos:brace]):
                break
            end = object_end(text, brace)
            call.args = text[brace:end]
            if end is None:
                break
            call.args_done, call.end = True, end
            pos = text.find(self.call_begin, end)
        return calls, ids, begins
