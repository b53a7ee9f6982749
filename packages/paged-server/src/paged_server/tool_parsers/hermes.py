"""Hermes / Qwen 2.5+ tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
one block per call; text before the first block is the message content."""

from __future__ import annotations

import json
import re

from paged_server.tool_parsers.base import ParsedCall, ToolParser

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
        content = text[:start].strip()
        return content or None, calls
