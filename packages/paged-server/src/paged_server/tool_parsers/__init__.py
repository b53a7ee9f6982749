"""Tool-call parsers for tool_choice "auto": the model's own tool-call format -> OpenAI
`tool_calls` (`--tool-call-parser NAME`).

    base.py         ToolParser: the whole text -> (content, calls); streaming by holding back
                    what could start a tool call
    hermes.py       Hermes / Qwen: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    llama3_json.py  Llama 3.x: {"name": ..., "parameters": {...}} (after <|python_tag|>), ";"-joined
    json_list.py    one JSON list after a marker: Mistral [TOOL_CALLS][...] (9-character ids),
                    Granite 3 <|tool_call|>[...], Phi-4-mini functools[...]
    pythonic.py     Llama 3.2 / 4: [f(x=1), g(city="Paris")], read with `ast` (literals only)
    lfm2.py         LFM2: the same lists framed by <|tool_call_start|> ... <|tool_call_end|>
    qwen3_coder.py  Qwen3-Coder: <tool_call><function=f><parameter=x>1</parameter></function>...,
                    values typed by the request's tool schemas
    gpt_oss.py      gpt-oss (openai): Harmony messages to functions.NAME, the body the arguments
    framed.py       calls framed by special tokens: a header naming the function, JSON arguments
    deepseek.py     DeepSeek-V3 / R1: <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME then the
                    arguments in a ```json fence; V3.1: <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
    kimi_k2.py      Kimi K2: <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
                    {...}; the model's ids are the calls' ids
    glm45.py        GLM-4.5 / 4.6 / 4.7: <tool_call>NAME<arg_key>k</arg_key><arg_value>v
                    </arg_value>, values typed as vLLM does (schema "string": text; else JSON)
"""

from __future__ import annotations

from paged_server.tool_parsers.base import ParsedCall, ToolParser
from paged_server.tool_parsers.deepseek import DeepSeekV3ToolParser, DeepSeekV31ToolParser
from paged_server.tool_parsers.glm45 import Glm45ToolParser
from paged_server.tool_parsers.gpt_oss import OpenAIToolParser
from paged_server.tool_parsers.hermes import HermesToolParser
from paged_server.tool_parsers.json_list import (
    GraniteToolParser,
    MistralToolParser,
    Phi4MiniToolParser,
)
from paged_server.tool_parsers.kimi_k2 import KimiK2ToolParser
from paged_server.tool_parsers.lfm2 import Lfm2ToolParser
from paged_server.tool_parsers.llama3_json import Llama3JsonToolParser
from paged_server.tool_parsers.pythonic import PythonicToolParser
from paged_server.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "granite": GraniteToolParser,
    "phi4_mini_json": Phi4MiniToolParser,
    "pythonic": PythonicToolParser,
    "lfm2": Lfm2ToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "qwen3_xml": Qwen3CoderToolParser,  # vLLM's name for the same format
    "openai": OpenAIToolParser,  # gpt-oss's Harmony format (vLLM's name)
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV31ToolParser,
    "kimi_k2": KimiK2ToolParser,
    "glm45": Glm45ToolParser,
    "glm47": Glm45ToolParser,  # vLLM's name for GLM-4.7 (no newline after the name)
}

__all__ = ["TOOL_PARSERS", "ParsedCall", "ToolParser"]
