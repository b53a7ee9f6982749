"""DeepSeek tool calls (framed.py has the common reading), vLLM's `deepseek_v3` and
`deepseek_v31`:

    deepseek_v3   DeepSeek-V3 / R1 (and their -0324 / -0528 updates): the call's type, then the
                  name on its own line, then the arguments in a ```json fence:
        <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
        ```json
        {"city": "Paris"}
        ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    deepseek_v31  DeepSeek-V3.1: the name, then the arguments right after the separator:
        <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
        <｜tool▁call▁end｜><｜tool▁calls▁end｜>

Several calls follow one another inside the one calls block. A `<｜tool▁call▁begin｜>` without
the block's opening token also starts the calls.

The content is the text around the calls (interleaved.py): before the calls block as written
(None when empty), then the text between or after the calls unless it is only whitespace, the
block's own tokens left out. vLLM's deepseek_v3 / v31 streams send that text (the block's
begin and end tokens removed) while their answers keep only the text before the block; here
both forms send it, so a client gets the same content streamed or not. A call reaches through
its `<｜tool▁call▁end｜>` (and v3's closing fence) and the `<｜tool▁calls▁end｜>` after it. A
call that cannot be read ends the calls: it and the text after it are content as written, the
calls before it kept (where vLLM's answer turns the whole text into content then, its stream
keeps the calls it sent).
"""

from __future__ import annotations

import json
import re

from paged_server.tool_parsers.base import ParsedCall
from paged_server.tool_parsers.framed import FramedToolParser, json_object, plain_name
from paged_server.tool_parsers.interleaved import Block, InterleavedToolParser
from paged_server.tool_parsers.streaming import PartialCall

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
SEP = "<｜tool▁sep｜>"
CALL_END = "<｜tool▁call▁end｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
# what closes a call after its arguments: v3's fence, then the call's end; then the block's end
_CLOSING = (
    re.compile(r"\s*(?:```\s*)?" + re.escape(CALL_END)),
    re.compile(r"\s*" + re.escape(CALLS_END)),
)
_MAY_CLOSE = re.compile(r"[\s`]*(?:<[^>]{0,31})?")  # a text tail that may still become one


class DeepSeekToolParser(InterleavedToolParser, FramedToolParser):
    start_markers = (CALLS_BEGIN, CALL_BEGIN)
    call_begin = CALL_BEGIN
    _scanned: tuple[str, list[PartialCall], list[int]] | None = None  # (text, its scan)

    def partial_calls(self, text: str) -> list[PartialCall]:
        return self._scan_once(text)[0]

    def _scan_once(self, text: str) -> tuple[list[PartialCall], list[int]]:
        """(the calls, where each begins), once per text: a stream's rescan asks for the
        calls, then for the blocks of the same text."""
        if self._scanned is None or self._scanned[0] is not text:
            calls, _, begins = self._scan(text)
            self._scanned = (text, calls, begins)
        return self._scanned[1], self._scanned[2]

    def blocks(self, text: str, final: bool) -> list[Block]:
        calls, begins = self._scan_once(text)
        out: list[Block] = []
        pos = 0
        for call, begin in zip(calls, begins, strict=True):
            section = text.rfind(CALLS_BEGIN, pos, begin)  # the first call's block opens it
            start = (
                section
                if section >= 0 and not text[section + len(CALLS_BEGIN) : begin].strip()
                else begin
            )
            args = json_object(call.args) if call.args_done else None
            if call.name is None or call.end is None or args is None:
                return [*out, Block(start, None, None)]
            end = call.end
            for closing in _CLOSING:
                if m := closing.match(text, end):
                    end = m.end()
                elif not final and _MAY_CLOSE.fullmatch(text, end):
                    return [*out, Block(start, None, None)]  # its closing may be arriving
                else:
                    break
            out.append(
                Block(start, end, [ParsedCall(call.name, json.dumps(args, ensure_ascii=False))])
            )
            pos = end
        section = text.find(CALLS_BEGIN, pos)  # a block with no call (yet)
        return [*out, Block(section, None, None)] if section >= 0 else out


class DeepSeekV3ToolParser(DeepSeekToolParser):
    def header(self, text: str, pos: int) -> tuple[str, str, int] | None:
        sep = text.find(SEP, pos)
        if sep < 0:
            return None
        kind = text[pos:sep].strip()  # "function"
        line_end = text.find("\n", sep + len(SEP))
        if line_end < 0:
            return None
        name = text[sep + len(SEP) : line_end].strip()
        return (name if plain_name(kind) else ""), "", line_end + 1

    def gap_ok(self, gap: str) -> bool:
        return gap.strip() in ("", "```json", "```")


class DeepSeekV31ToolParser(DeepSeekToolParser):
    def header(self, text: str, pos: int) -> tuple[str, str, int] | None:
        sep = text.find(SEP, pos)
        if sep < 0:
            return None
        return text[pos:sep].strip(), "", sep + len(SEP)
