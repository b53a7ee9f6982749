"""Tool-call parsers for tool_choice "auto": the model's own tool-call format -> OpenAI
`tool_calls` (`--tool-call-parser NAME`).

    base.py         ToolParser: the whole text -> (content, calls); streaming by holding back
                    what could start a tool call
    hermes.py       Hermes / Qwen: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    llama3_json.py  Llama 3.x: {"name": ..., "parameters": {...}} (after <|python_tag|>), ";"-joined
"""

from __future__ import annotations

from paged_server.tool_parsers.base import ParsedCall, ToolParser
from paged_server.tool_parsers.hermes import HermesToolParser
from paged_server.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}

__all__ = ["TOOL_PARSERS", "ParsedCall", "ToolParser"]
