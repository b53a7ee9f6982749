"""Tool calls as a JSON list framed by <tool_calls> tags (vLLM's `hunyuan_a13b` and `jamba`):

    CONTENT <tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]</tool_calls>

    HunyuanA13BToolParser  Hunyuan-A13B
    JambaToolParser        AI21 Jamba; the tags are special tokens, kept in the text
                           (`keeps_special_tokens`) as vLLM's jamba parser keeps them

Text before the first <tool_calls> is the content, as written; whitespace alone is none for
hunyuan_a13b (vLLM's answer), a lone " " for jamba (vLLM's `content != " "`; other whitespace
is content); a stream holds such text back until something else follows, so both forms agree.
Text after the closing tag is dropped. The closing </tool_calls> is required
(vLLM reads only closed blocks); several blocks are read in order (vLLM reads one: jamba the
first, hunyuan_a13b the first that is JSON). A block that is not a non-empty list of call
objects, or one left open, leaves the whole text as content. A call's "arguments" may be an
object or its JSON text (read either way: vLLM's hunyuan_a13b passes such text through unread,
its jamba encodes it once more as a JSON string); a call without "arguments" has none, `{}`
(vLLM's hunyuan_a13b drops it, its jamba answers content).

What vLLM's hunyuan_a13b does besides, and this parser does not: it skips a block inside a
<think> ... </think> span (the reasoning parser's part here), drops an item that is not a call
(here the block is content), and removes the chat template's "助手：" from a content-only
answer (here it stays: a stream could not take it back).
"""

from __future__ import annotations

import json

from paged_server.tool_parsers.base import ParsedCall, ToolParser
from paged_server.tool_parsers.framed import blocks
from paged_server.tool_parsers.json_list import scan_call_list
from paged_server.tool_parsers.streaming import PartialCall

OPEN, CLOSE = "<tool_calls>", "</tool_calls>"


class ToolCallsBlockToolParser(ToolParser):
    start_markers = (OPEN,)
    blank_is_no_content = True  # vLLM's hunyuan_a13b: whitespace-only content is None

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        found = blocks(text, OPEN, CLOSE)
        if not found:
            return text, []
        calls: list[ParsedCall] = []
        for body, end in found:
            if end is None:  # left open
                return text, []
            try:
                items = json.loads(text[body:end])
            except ValueError:
                return text, []
            listed = [self.call_from(item) for item in items] if isinstance(items, list) else []
            if not listed or any(c is None for c in listed):
                return text, []
            calls += [c for c in listed if c is not None]
        return self.content_before(text, text.find(OPEN)), calls

    def partial_calls(self, text: str) -> list[PartialCall]:
        calls: list[PartialCall] = []
        for body, end in blocks(text, OPEN, CLOSE):
            calls += scan_call_list(text if end is None else text[:end], body, ("arguments",))
        return calls


class HunyuanA13BToolParser(ToolCallsBlockToolParser):
    """Hunyuan-A13B: the tags are plain text to vLLM (special tokens are skipped as usual)."""


class JambaToolParser(ToolCallsBlockToolParser):
    keeps_special_tokens = True

    def no_content(self, content: str) -> bool:
        return content in ("", " ")  # vLLM's jamba: a lone space is none, other whitespace is
