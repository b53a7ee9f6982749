"""`ToolParser`: turns a model's text into content plus tool calls.

`parse(text)` -> (content or None, calls). Streaming (`StreamingToolText`): content streams as
it arrives until the text might be starting a tool call (`start_markers`); from there it is held
and parsed whole when the output ends (OpenAI clients accumulate `delta.tool_calls`, so one
chunk with complete arguments is a valid stream).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolParser:
    start_markers: tuple[str, ...] = ()

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        raise NotImplementedError

    @staticmethod
    def call_from(obj: Any, args_key: str = "arguments") -> ParsedCall | None:
        """{"name": str, args_key: object | JSON text} -> a call; None if it is not one."""
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get(args_key, obj.get("arguments", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


class StreamingToolText:
    """Feeds streamed text through a parser: what may be shown now, and the calls at the end."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of text already streamed as content
        self.holding = False  # a tool call may have started: nothing more streams

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.holding:
            return ""
        starts = [self.text.find(m, self.sent) for m in self.parser.start_markers]
        starts = [s for s in starts if s >= 0]
        if starts:
            self.holding = True
            end = min(starts)
        else:
            end = len(self.text) - self._partial_marker_len()
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def _partial_marker_len(self) -> int:
        """Length of the longest text tail that is a proper prefix of a start marker."""
        best = 0
        for m in self.parser.start_markers:
            for k in range(min(len(m) - 1, len(self.text) - self.sent), 0, -1):
                if self.text.endswith(m[:k]):
                    best = max(best, k)
                    break
        return best

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """(content not streamed yet, calls) once the output is complete. Content before a tool
        call streamed already: holding starts where the call does."""
        _, calls = self.parser.parse(self.text)
        return ("", calls) if calls else (self.text[self.sent :], [])
