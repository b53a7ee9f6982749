"""Tool calls written as XML-style elements, one element per call and one per parameter, the
parameters' values plain text typed by the request's tool schemas (Seed-OSS in seed_oss.py,
MiniMax-M2 in minimax_m2.py):

    CONTENT <block> <call NAME> <param KEY>VALUE</param> ... </call> <call ...> ... </block> CONTENT

A subclass gives the markers, how a name or key is read off its tag (`attr`) and how a value's
text becomes a JSON value (`value`). With `blocks_required` a call counts only inside a block
that is closed; otherwise the block tags are optional (a block left open reaches to the end of
the output) and a call element alone counts too.

The content is the text around the blocks (interleaved.py): before the first as written (None
when empty), then the text between or after them unless it is only whitespace; the text
between the calls or the parameters inside a block is dropped. vLLM's seed_oss and minimax_m2
(engine parsers: vllm/parser/seed_oss.py, minimax_m2.py) keep the text outside the blocks as
content, streamed as written and answered stripped; here both forms keep it as written, so a
client gets the same content streamed or not. A block that cannot be read (a call, a parameter
or a required block left open by max_tokens, a name that is not one plain word, no call in
it) ends the calls: it and the text after it are content, the calls before it kept.

Arguments are JSON text built one whole parameter at a time, so what a stream has sent of them
is always a prefix of the final arguments.
"""

from __future__ import annotations

import json
from typing import Any

from paged_server.tool_parsers.base import ParsedCall
from paged_server.tool_parsers.framed import plain_name
from paged_server.tool_parsers.interleaved import Block, InterleavedToolParser
from paged_server.tool_parsers.streaming import PartialCall


def finite_json(value: Any) -> bool:
    """Whether `value` has a JSON form (no NaN or Infinity, no sets or bytes)."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


# (where it starts, where it ends or None, its calls, whether they are read)
_Scanned = tuple[int, int | None, list[PartialCall], bool]


class XmlCallsToolParser(InterleavedToolParser):
    block_open: str = ""
    block_close: str = ""
    call_open: str = ""  # up to the name; the tag ends at the next ">"
    call_close: str = ""
    param_open: str = ""  # up to the key; the tag ends at the next ">"
    param_close: str = "</parameter>"
    blocks_required: bool = False
    _scanned: tuple[str, list[_Scanned]] | None = None  # (text, its scan)

    def attr(self, raw: str) -> str:
        """A name or key as its tag writes it -> the name."""
        return raw.strip()

    def value(self, raw: str, schema: Any) -> Any:
        """A parameter's text between its tags -> its JSON value (`schema`: the parameter's
        schema in the request's tool, None when the tool does not list it)."""
        raise NotImplementedError

    def blocks(self, text: str, final: bool) -> list[Block]:
        out: list[Block] = []
        for start, end, calls, readable in self._scan_once(text):
            if not readable:
                return [*out, Block(start, None, None)]
            if end is None:  # an open block: read to the end of the output when optional
                if not final or self.blocks_required:
                    return [*out, Block(start, None, None)]
                end = len(text)
            out.append(Block(start, end, [ParsedCall(c.name or "", c.args) for c in calls]))
        return out

    def partial_calls(self, text: str) -> list[PartialCall]:
        return [call for _, _, calls, _ in self._scan_once(text) for call in calls]

    def _scan_once(self, text: str) -> list[_Scanned]:
        """`_scan(text)`, once per text: a stream's rescan asks for the calls and then for the
        blocks of the same text."""
        if self._scanned is None or self._scanned[0] is not text:
            self._scanned = (text, self._scan(text))
        return self._scanned[1]

    def _scan(self, text: str) -> list[_Scanned]:
        """(where it starts, where it ends or None while open, its calls, whether they are all
        read and there is one) for each block or lone call element, in order, ending with the
        first left open or not read (its last call as far as it has arrived)."""
        out: list[_Scanned] = []
        pos = 0
        while True:
            block = text.find(self.block_open, pos)
            lone = -1 if self.blocks_required else text.find(self.call_open, pos)
            if block < 0 and lone < 0:
                return out
            calls: list[PartialCall] = []
            if block >= 0 and not 0 <= lone < block:
                body = block + len(self.block_open)
                close = text.find(self.block_close, body)
                region_end = len(text) if close < 0 else close
                at = body
                while at >= 0 and (at := text.find(self.call_open, at, region_end)) >= 0:
                    calls.append(call := PartialCall())
                    at = self._read_call(text, at, region_end, call)
                readable = bool(calls) and all(c.args_done for c in calls)
                end = None if close < 0 else close + len(self.block_close)
                out.append((block, end, calls, readable))
            else:
                calls.append(call := PartialCall())
                end = self._read_call(text, lone, len(text), call)
                readable = end >= 0
                out.append((lone, end if readable else None, calls, readable))
            if not readable or end is None:
                return out
            pos = end

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
            try:
                value = self.value(text[key_end + 1 : value_end], props.get(key))
            except RecursionError:  # (json.loads of 100k "["): a call that cannot be read
                return -1
            fields.append(json.dumps({key: value}, ensure_ascii=False)[1:-1])  # "key": value
            call.args = "{" + ", ".join(fields)
            pos = value_end + len(self.param_close)
        if close < 0:
            return -1
        call.args, call.args_done = "{" + ", ".join(fields) + "}", True
        call.end = close + len(self.call_close)
        return call.end
