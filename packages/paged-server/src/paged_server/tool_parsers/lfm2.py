"""LFM2 / LFM2.5 (Liquid AI; vLLM's `lfm2`): a Python list of calls framed by special tokens,

    CONTENT <|tool_call_start|>[get_weather(city="Paris"), clock()]<|tool_call_end|> CONTENT

each list read as pythonic.py reads Llama's (`ast`, never evaluated; keyword arguments with
literal values only). Several framed lists are read in order (vLLM reads the first). The
closing <|tool_call_end|> is not required at the end of the output (a complete list ends the
call, so a call whose end marker was cut off by max_tokens still counts). A frame that is not a
well-formed, complete list ends the calls: it and the text after it are content (none read:
the whole text). The markers are special tokens: the server keeps them in the text
(`keeps_special_tokens`).

The content is the text around the frames (interleaved.py): before the first as written, and
the text after each frame unless it is only whitespace. LFM2 may echo a call's list after its
frame, capped by an <|tool_call_end|> of its own: text after a frame that opens (past
whitespace) with "[" or <|tool_call_end|> is such an echo, dropped through its last
<|tool_call_end|> (vLLM drops the text after its frame through the last <|tool_call_end|>
whatever it opens with; its stream holds back text that opens with "[" or "<" the same way).
vLLM's answer strips the text before and after and joins them with a newline while its stream
sends them as written; paged sends them as written in both, so that a client gets the same
content streamed or not.
"""

from __future__ import annotations

from paged_server.tool_parsers.base import ParsedCall
from paged_server.tool_parsers.interleaved import Block, InterleavedToolParser
from paged_server.tool_parsers.pythonic import list_calls, scan_list
from paged_server.tool_parsers.streaming import PartialCall

START, END = "<|tool_call_start|>", "<|tool_call_end|>"


def _frames(text: str) -> list[tuple[int, int, int | None]]:
    """(index of each START, of its list's "[" or -1 (not a list, or not arrived), of its END
    or None) in order, ending with the first frame that is not a list or not closed."""
    out: list[tuple[int, int, int | None]] = []
    pos = text.find(START)
    while pos >= 0:
        body = pos + len(START)
        lst = body
        while lst < len(text) and text[lst].isspace():
            lst += 1
        lst = lst if lst < len(text) and text[lst] == "[" else -1
        end = text.find(END, body)
        out.append((pos, lst, end if end >= 0 else None))
        if lst < 0 or end < 0:
            break
        pos = text.find(START, end + len(END))
    return out


def _echo(gap: str) -> bool:
    """Whether text after a frame opens as an echo of a list (or may still do so)."""
    head = gap.lstrip()
    return head.startswith(("[", END)) or (bool(head) and END.startswith(head))


class Lfm2ToolParser(InterleavedToolParser):
    start_markers = (START,)
    keeps_special_tokens = True
    _read: tuple[str, list[list[ParsedCall] | None]] | None = None
    _lists_read: dict[str, list[ParsedCall] | None] = {}  # noqa: RUF012 - the class's never mutated

    def _closed_lists(self, text: str) -> list[list[ParsedCall] | None]:
        """The calls of each closed frame's list (None: not read), once per text (a stream's
        rescan asks for the calls, then for the blocks), each list read once per stream."""
        if self._read is None or self._read[0] is not text:
            known, self._lists_read, read = self._lists_read, {}, []
            for _, lst, end in _frames(text):
                if lst >= 0 and end is not None:
                    source = text[lst:end]
                    got = known[source] if source in known else list_calls(source)
                    self._lists_read[source] = got
                    read.append(got)
            self._read = (text, read)
        return self._read[1]

    def blocks(self, text: str, final: bool) -> list[Block]:
        out = []
        closed = self._closed_lists(text)
        for k, (start, lst, end) in enumerate(_frames(text)):
            if lst < 0 or (end is None and not final):
                return [*out, Block(start, None, None)]
            calls = closed[k] if end is not None else list_calls(text[lst:])
            stop = len(text) if end is None else end + len(END)
            out.append(Block(start, stop if calls else None, calls))
            if calls is None:
                break
        return out

    def gap_content(self, gap: str) -> str:
        if _echo(gap) and (cut := gap.rfind(END)) >= 0:
            gap = gap[cut + len(END) :]
        return gap if gap.strip() else ""

    def gap_settled(self, gap: str) -> str:
        return "" if _echo(gap) else self.gap_content(gap)  # an echo's end: known at the gap's

    def partial_calls(self, text: str) -> list[PartialCall]:
        calls: list[PartialCall] = []
        closed = self._closed_lists(text)
        for k, (_, lst, end) in enumerate(_frames(text)):
            if lst < 0:
                break
            calls += scan_list(text if end is None else text[:end], lst)
            if end is None or closed[k] is None:  # the calls end here
                break
        return calls
