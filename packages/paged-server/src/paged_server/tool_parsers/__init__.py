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
    xml_calls.py    XML-style call and parameter elements, values typed by the tool schemas:
                    seed_oss.py   Seed-OSS: <seed:tool_call><function=f><parameter=x>1
                                  </parameter></function></seed:tool_call>
                    minimax_m2.py MiniMax-M2: <minimax:tool_call><invoke name="f"><parameter
                                  name="x">1</parameter></invoke></minimax:tool_call>
    tool_calls_block.py  Hunyuan-A13B, Jamba: <tool_calls>[{"name": ..., "arguments": ...}]
                    </tool_calls>
    internlm.py     InternLM2 / 3: <|action_start|><|plugin|>{"name": ..., "parameters": ...}
                    <|action_end|>
    olmo3.py        Olmo 3: pythonic calls one per line in <function_calls> ... </function_calls>
                    (or bare), JSON's null / true / false accepted
    xlam.py         xLAM: a JSON list of calls, the whole answer or in ```json / [TOOL_CALLS] /
                    <tool_call>
    bare_calls.py   streaming for calls that may open the answer with no marker (olmo3, xlam)
    ERNIE 4.5 (ernie45) writes Hermes' format (hermes.py: the newlines before the calls are
    trimmed); Llama 4 reads as pythonic (llama4_pythonic) or
    llama3_json (llama4_json), the names vLLM registers for them.
"""

from __future__ import annotations

from paged_server.tool_parsers.base import ParsedCall, ToolParser
from paged_server.tool_parsers.deepseek import DeepSeekV3ToolParser, DeepSeekV31ToolParser
from paged_server.tool_parsers.glm45 import Glm45ToolParser
from paged_server.tool_parsers.gpt_oss import OpenAIToolParser
from paged_server.tool_parsers.hermes import Ernie45ToolParser, HermesToolParser
from paged_server.tool_parsers.internlm import InternLMToolParser
from paged_server.tool_parsers.json_list import (
    GraniteToolParser,
    MistralToolParser,
    Phi4MiniToolParser,
)
from paged_server.tool_parsers.kimi_k2 import KimiK2ToolParser
from paged_server.tool_parsers.lfm2 import Lfm2ToolParser
from paged_server.tool_parsers.llama3_json import Llama3JsonToolParser
from paged_server.tool_parsers.minimax_m2 import MinimaxM2ToolParser
from paged_server.tool_parsers.olmo3 import Olmo3ToolParser
from paged_server.tool_parsers.pythonic import PythonicToolParser
from paged_server.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from paged_server.tool_parsers.seed_oss import SeedOssToolParser
from paged_server.tool_parsers.tool_calls_block import HunyuanA13BToolParser, JambaToolParser
from paged_server.tool_parsers.xlam import XlamToolParser

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
    "seed_oss": SeedOssToolParser,
    "minimax_m2": MinimaxM2ToolParser,
    "hunyuan_a13b": HunyuanA13BToolParser,
    "jamba": JambaToolParser,
    "ernie45": Ernie45ToolParser,  # Hermes' <tool_call>{...}</tool_call>, newlines before trimmed
    "olmo3": Olmo3ToolParser,
    "internlm": InternLMToolParser,
    "xlam": XlamToolParser,
    "llama4_pythonic": PythonicToolParser,  # vLLM's names for Llama 4's two formats
    "llama4_json": Llama3JsonToolParser,
}

__all__ = ["TOOL_PARSERS", "ParsedCall", "ToolParser"]
