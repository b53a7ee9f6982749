"""gpt-oss tool calls (`--tool-call-parser openai`, vLLM's name): Harmony messages addressed to
`functions.NAME`, the arguments their body (harmony.py has the format):

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"location": "Paris"}<|call|>

The output is read as Harmony messages: each call's arguments are its body as the model wrote
it (JSON text, not checked: a call cut short by max_tokens keeps what arrived, with
finish_reason "length"); final and commentary-without-recipient bodies (and text outside any
message) are the content; the analysis is not content (`--reasoning-parser openai_gptoss` makes
it the reasoning, and leaves this parser the rest as written); messages to any other recipient
(built-in tools, not served) are dropped.

A stream announces a call once its header is complete (its name known), then sends its body as
argument pieces as they arrive; content streams as it comes, before or between calls.
"""

from __future__ import annotations

from typing import Any

from paged_server.harmony import CALL, CONTENT, Event, HarmonyScanner, function_name, kind
from paged_server.tool_parsers.base import ParsedCall, ToolParser


class HarmonyToolStream:
    """One output's text pieces in: content and OpenAI `delta.tool_calls` entries out."""

    def __init__(self) -> None:
        self.scanner = HarmonyScanner()
        self.names: list[str] = []  # call k's function
        self.args: list[list[str]] = []  # call k's arguments, in pieces

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content to show now, tool_calls entries to send now)."""
        return self._apply(self.scanner.feed(text))

    def finish(self) -> tuple[str, list[dict[str, Any]], list[ParsedCall]]:
        """(the content held back, the last entries, every call) once the output is complete."""
        content, entries = self._apply(self.scanner.finish())
        calls = [ParsedCall(n, "".join(a)) for n, a in zip(self.names, self.args)]
        return content, entries, calls

    def _apply(self, events: list[Event]) -> tuple[str, list[dict[str, Any]]]:
        shown: list[str] = []
        entries: list[dict[str, Any]] = []
        for e in events:
            k = kind(e.header)
            if k == CONTENT and e.what == "text":
                shown.append(e.raw)
            name = function_name(e.header) if k == CALL else None
            if name is None:
                continue
            if e.what == "open":
                self.names.append(name)
                self.args.append([])
                fn = {"name": name, "arguments": ""}
                entries.append(
                    {
                        "index": len(self.names) - 1,
                        "id": ToolParser.new_call_id(),
                        "type": "function",
                        "function": fn,
                    }
                )
            elif e.what == "text":
                self.args[-1].append(e.raw)
                entries.append({"index": len(self.names) - 1, "function": {"arguments": e.raw}})
        return "".join(shown), entries


class OpenAIToolParser(ToolParser):
    keeps_special_tokens = True  # every Harmony marker is a special token
    reads_harmony = True

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        stream = HarmonyToolStream()
        content, _ = stream.feed(text)
        rest, _, calls = stream.finish()
        content += rest
        return (content or None) if calls else content, calls

    def streamer(self) -> HarmonyToolStream:
        return HarmonyToolStream()
