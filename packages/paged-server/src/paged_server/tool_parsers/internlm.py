"""InternLM2 / InternLM2.5 / InternLM3 tool calls (vLLM's `internlm`): a plugin action holding
one JSON call object,

    CONTENT<|action_start|><|plugin|>
    {"name": "get_weather", "parameters": {"city": "Paris"}}<|action_end|>

the arguments under "parameters" (or "arguments"). Text before the first action is the content;
text after the calls is dropped. The closing <|action_end|> is not required (vLLM reads to the
end of the text without it), but only whitespace may stand between the marker and the object
and between the object and <|action_end|>; anything else leaves the whole text as content.
Several actions are read in order (vLLM's parser reads exactly one and fails on a second).
<|action_start|><|interpreter|> (code to run) is not a tool call: it stays content. The markers
are special tokens: the server keeps them in the text (`keeps_special_tokens`), as vLLM does.
"""

from __future__ import annotations

import json

from paged_server.tool_parsers.base import ParsedCall, ToolParser
from paged_server.tool_parsers.streaming import PartialCall, scan_call

ACTION = "<|action_start|><|plugin|>"
END = "<|action_end|>"
_ARGS_KEYS = ("parameters", "arguments")


def _brace(text: str, pos: int) -> int:
    """Index of the "{" opening the object at text[pos:] after whitespace; -1 when something
    else stands there, len(text) while nothing but whitespace has arrived."""
    body = len(text) - len(text[pos:].lstrip())
    return body if body == len(text) or text[body] == "{" else -1


class InternLMToolParser(ToolParser):
    start_markers = (ACTION,)
    keeps_special_tokens = True

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        start = text.find(ACTION)
        if start < 0:
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        pos = start
        while pos >= 0:
            brace = _brace(text, pos + len(ACTION))
            if not 0 <= brace < len(text):
                return text, []
            try:
                obj, end = decoder.raw_decode(text, brace)
            except ValueError:
                return text, []
            call = self.call_from(obj, "parameters")
            rest = text[end:].lstrip()
            if call is None or not (rest.startswith(END) or not rest):
                return text, []
            calls.append(call)
            pos = text.find(ACTION, len(text) - len(rest))
        return self.content_before(text, start), calls

    def partial_calls(self, text: str) -> list[PartialCall]:
        calls: list[PartialCall] = []
        pos = text.find(ACTION)
        while pos >= 0:
            brace = _brace(text, pos + len(ACTION))
            if not 0 <= brace < len(text):
                break
            call = scan_call(text, brace, _ARGS_KEYS)
            calls.append(call)
            if call.end is None:
                break
            pos = text.find(ACTION, call.end)
        return calls
