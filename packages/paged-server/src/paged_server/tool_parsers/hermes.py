"""Hermes / Qwen 2.5+ tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
one block per call; text before the first block is the message content, as written (vLLM's:
`model_output[:start]`, None when empty; streamed the same)."""

from __future__ import annotations

import json
import re

from paged_server.tool_parsers.base import ParsedCall, ToolParser
from paged_server.tool_parsers.streaming import PartialCall, scan_call

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    start_markers = ("<tool_call>",)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        calls = []
        for body in _BLOCK.findall(text[start:]):
            try:
                call = self.call_from(json.loads(body.strip()))
            except ValueError:
                call = None
            if call is None:  # not a well-formed call: the text stays content
                return text, []
            calls.append(call)
        return self.content_before(text, start), calls

    def partial_calls(self, text: str) -> list[PartialCall]:
        calls: list[PartialCall] = []
        pos = text.find("<tool_call>")
        while pos >= 0:
            brace = text.find("{", pos)
            if brace < 0:
                break
            call = scan_call(text, brace, ("arguments",))
            calls.append(call)
            if call.end is None:
                break
            pos = text.find("<tool_call>", call.end)
        return calls


class Ernie45ToolParser(HermesToolParser):
    """ERNIE 4.5 (vLLM's `ernie45`): Hermes' blocks, the newlines before the first block not
    content (vLLM's answer: `model_output[:start].rstrip("\\n")`; its stream also drops them).
    The model writes `\\n\\n<tool_call>` after its thinking: that answer's content is None."""

    trim_before_calls = "\n"
