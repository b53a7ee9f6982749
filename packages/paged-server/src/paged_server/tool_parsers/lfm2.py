"""LFM2 / LFM2.5 (Liquid AI; vLLM's `lfm2`): a Python list of calls framed by special tokens,

    CONTENT <|tool_call_start|>[get_weather(city="Paris"), clock()]<|tool_call_end|> ...

each list read as pythonic.py reads Llama's (`ast`, never evaluated; keyword arguments with
literal values only). Several framed lists are read in order. Text before the first
<|tool_call_start|> is the content; text after the calls is dropped (as framed.py does). The
closing <|tool_call_end|> is not required (a complete list ends the call, so a call whose end
marker was cut off by max_tokens still counts); a list that is not well formed or not complete
leaves the whole text as content. The markers are special tokens: the server keeps them in the
text (`keeps_special_tokens`).

The content is the text before the first frame as written. vLLM's answer strips it (and joins
the text after the calls to it) while its stream sends it as written; paged keeps it as written
in both, so that a client gets the same content streamed or not (base.py `content_before`)."""

from __future__ import annotations

from paged_server.tool_parsers.base import ParsedCall, ToolParser
from paged_server.tool_parsers.pythonic import list_calls, scan_list
from paged_server.tool_parsers.streaming import PartialCall

START, END = "<|tool_call_start|>", "<|tool_call_end|>"


def _lists(text: str) -> list[tuple[int, int | None]]:
    """(index of each framed list's "[", index of its END or None) in order; a frame whose
    body does not open with "[" ends the scan (-1 as its start)."""
    out: list[tuple[int, int | None]] = []
    pos = text.find(START)
    while pos >= 0:
        body = pos + len(START)
        start = len(text) - len(text[body:].lstrip())
        end = text.find(END, body)
        if start >= len(text) or text[start] != "[":
            if start < len(text):  # not a list: the frame is malformed
                out.append((-1, end if end >= 0 else None))
            return out
        out.append((start, end if end >= 0 else None))
        if end < 0:
            return out
        pos = text.find(START, end + len(END))
    return out


class Lfm2ToolParser(ToolParser):
    start_markers = (START,)
    keeps_special_tokens = True

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        frames = _lists(text)
        if not frames:
            return text, []
        calls: list[ParsedCall] = []
        for start, end in frames:
            if start < 0:  # not a list
                return text, []
            listed = list_calls(text[start:end])  # end None: the rest of the text
            if listed is None:
                return text, []
            calls += listed
        return self.content_before(text, text.find(START)), calls

    def partial_calls(self, text: str) -> list[PartialCall]:
        calls: list[PartialCall] = []
        for start, end in _lists(text):
            if start < 0:
                break
            calls += scan_list(text if end is None else text[:end], start)
            if end is None:
                break
        return calls
