"""Kimi K2 tool calls (vLLM's `kimi_k2`; framed.py has the common reading):

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The header is the call's id, `functions.NAME:IDX` (or `NAME:IDX`): the name is what stands
between the last "." and the ":" before the index. The section markers are also read in their
singular spelling (`<|tool_call_section_begin|>`), as vLLM does.

Kimi's chat template writes each earlier call's id back into the prompt (and a tool result's
`tool_call_id` with it), so the answer's call ids are the model's own ids, as vLLM's: `new_call_id`
hands out the ids of the calls read last, in order (an OpenAI-style id where there is none, as
for a forced call).
"""

from __future__ import annotations

from paged_server.tool_parsers.base import ToolParser
from paged_server.tool_parsers.framed import FramedToolParser, plain_name

CALL_BEGIN = "<|tool_call_begin|>"
ARGS_BEGIN = "<|tool_call_argument_begin|>"


class KimiK2ToolParser(FramedToolParser):
    start_markers = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>", CALL_BEGIN)
    call_begin = CALL_BEGIN

    def __init__(self) -> None:
        self.call_ids = []
        self.ids_given = 0  # ids handed out so far: call k gets the k-th

    def header(self, text: str, pos: int) -> tuple[str, str, int] | None:
        args = text.find(ARGS_BEGIN, pos)
        if args < 0:
            return None
        call_id = text[pos:args].strip()
        name = call_id.split(":", 1)[0].rsplit(".", 1)[-1] if plain_name(call_id) else ""
        return name, call_id, args + len(ARGS_BEGIN)

    def new_call_id(self) -> str:  # an instance's: its output's ids
        k = self.ids_given
        self.ids_given += 1
        return self.call_ids[k] if k < len(self.call_ids) else ToolParser.new_call_id()
