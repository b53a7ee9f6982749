"""Tool-call parsers for tool_choice "auto": the model's own tool-call format -> OpenAI
`tool_calls` (`--tool-call-parser NAME`).

    base.py         ToolParser: the whole text -> (content, calls); streaming by holding back
                    what could start a tool call
    hermes.py       Hermes / Qwen: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    llama3_json.py  Llama 3.x: {"name": ..., "parameters": {...}} (after <|python_tag|>), ";"-joined
    mistral.py      Mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]; 9-character ids
    pythonic.py     Llama 3.2 / 4: [f(x=1), g(city="Paris")], read with `ast` (literals only)
    qwen3_coder.py  Qwen3-Coder: <tool_call><function=f><parameter=x>1</parameter></function>...,
                    values typed by the request's tool schemas
"""

from __future__ import annotations

from paged_server.tool_parsers.base import ParsedCall, ToolParser
from paged_server.tool_parsers.hermes import HermesToolParser
from paged_server.tool_parsers.llama3_json import Llama3JsonToolParser
from paged_server.tool_parsers.mistral import MistralToolParser
from paged_server.tool_parsers.pythonic import PythonicToolParser
from paged_server.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "qwen3_xml": Qwen3CoderToolParser,  # vLLM's name for the same format
}

__all__ = ["TOOL_PARSERS", "ParsedCall", "ToolParser"]
