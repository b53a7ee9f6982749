"""Tool calls written as XML-style elements, one element per call and one per parameter, the
parameters' values plain text typed by the request's tool schemas (Seed-OSS in seed_oss.py,
MiniMax-M2 in minimax_m2.py):

    CONTENT <block> <call NAME> <param KEY>VALUE</param> ... </call> <call ...> ... </block>

A subclass gives the markers, how a name or key is read off its tag (`attr`) and how a value's
text becomes a JSON value (`value`). Text before the first marker is the content; text between
the calls, between the parameters or after the calls is dropped, as vLLM's regexes drop it.
With `blocks_required` a call counts only inside a block that is closed; otherwise the block
tags are optional and a call element alone counts too. A call, a parameter or a required block
left open (max_tokens) or a name that is not one plain word leaves the whole text as content.

Arguments are JSON text built one whole parameter at a time, so what a stream has sent of them
is always a prefix of the final arguments.
"""

from __future__ import annotations

import json
from typing import Any

from paged_server.tool_parsers.base import ParsedCall, ToolParser
from paged_server.tool_parsers.framed import blocks, plain_name
from paged_server.tool_parsers.streaming import PartialCall


def finite_json(value: Any) -> bool:
    """Whether `value` has a JSON form (no NaN or Infinity, no sets or bytes)."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


class XmlCallsToolParser(ToolParser):
    block_open: str = ""
    block_close: str = ""
    call_open: str = ""  # up to the name; the tag ends at the next ">"
    call_close: str = ""
    param_open: str = ""  # up to the key; the tag ends at the next ">"
    param_close: str = "</parameter>"
    blocks_required: bool = False

    def attr(self, raw: str) -> str:
        """A name or key as its tag writes it -> the name."""
        return raw.strip()

    def value(self, raw: str, schema: Any) -> Any:
        """A parameter's text between its tags -> its JSON value (`schema`: the parameter's
        schema in the request's tool, None when the tool does not list it)."""
        raise NotImplementedError

    def _start(self, text: str) -> int:
        markers = (self.block_open,) if self.blocks_required else (self.block_open, self.call_open)
        return min((i for m in markers if (i := text.find(m)) >= 0), default=-1)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        start = self._start(text)
        if start < 0:
            return text, []
        scanned, closed = self._scan(text, start)
        if not scanned or not closed:
            return text, []
        calls = []
        for call in scanned:
            if call.name is None or not call.args_done:  # malformed or cut short: all content
                return text, []
            calls.append(ParsedCall(call.name, call.args))
        return self.content_before(text, start), calls

    def partial_calls(self, text: str) -> list[PartialCall]:
        start = self._start(text)
        return [] if start < 0 else self._scan(text, start)[0]

    def _regions(self, text: str, start: int) -> list[tuple[int, int, bool]]:
        """(start, end, closed) of each stretch of text the calls are read in: the blocks, in
        order (the last one maybe still open), or everything from `start` on."""
        if not self.blocks_required:
            return [(start, len(text), True)]
        return [  # (start is the first block's: _start)
            (body, len(text) if end is None else end, end is not None)
            for body, end in blocks(text, self.block_open, self.block_close)
        ]

    def _scan(self, text: str, start: int) -> tuple[list[PartialCall], bool]:
        """Every call begun in `text`, the last one as far as it has arrived, and whether the
        text is complete as far as the format goes (no block left open). A malformed call ends
        the scan with its arguments never done."""
        calls: list[PartialCall] = []
        for region_start, region_end, closed in self._regions(text, start):
            pos = region_start
            while (at := text.find(self.call_open, pos, region_end)) >= 0:
                call = PartialCall()
                calls.append(call)
                pos = self._read_call(text, at, region_end, call)
                if pos < 0:
                    return calls, False
            if not closed:
                return calls, False
        return calls, True

    def _read_call(self, text: str, at: int, end: int, call: PartialCall) -> int:
        """Reads the call element at text[at] (within text[:end]) into `call`: where the scan
        goes on, or -1 when the call is still arriving or malformed."""
        head = at + len(self.call_open)
        name_end = text.find(">", head, end)
        if name_end < 0:
            return -1
        name = self.attr(text[head:name_end])
        if not plain_name(name):
            return -1
        call.name = name
        schema = self.schemas.get(name, {})
        props = schema.get("properties", {}) if isinstance(schema, dict) else {}
        props = props if isinstance(props, dict) else {}
        fields: list[str] = []
        pos = name_end + 1
        while True:
            close = text.find(self.call_close, pos, end)
            param = text.find(self.param_open, pos, end)
            if param < 0 or 0 <= close < param:
                break
            key_end = text.find(">", param + len(self.param_open), end)
            value_end = text.find(self.param_close, key_end + 1, end) if key_end >= 0 else -1
            if value_end < 0 or 0 <= close < value_end:
                return -1  # still arriving, or a parameter the call closes before its end
            key = self.attr(text[param + len(self.param_open) : key_end])
            if not key:
                return -1
            value = self.value(text[key_end + 1 : value_end], props.get(key))
            fields.append(json.dumps({key: value}, ensure_ascii=False)[1:-1])  # "key": value
            call.args = "{" + ", ".join(fields)
            pos = value_end + len(self.param_close)
        if close < 0:
            return -1
        call.args, call.args_done = "{" + ", ".join(fields) + "}", True
        call.end = close + len(self.call_close)
        return call.end
