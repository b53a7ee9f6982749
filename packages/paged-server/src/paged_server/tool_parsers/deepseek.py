"""DeepSeek tool calls (framed.py has the common reading), vLLM's `deepseek_v3` and
`deepseek_v31`:

    deepseek_v3   DeepSeek-V3 / R1 (and their -0324 / -0528 updates): the call's type, then the
                  name on its own line, then the arguments in a ```json fence:
        <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
        ```json
        {"city": "Paris"}
        ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    deepseek_v31  DeepSeek-V3.1: the name, then the arguments right after the separator:
        <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
        <｜tool▁call▁end｜><｜tool▁calls▁end｜>

Several calls follow one another inside the one calls block. A `<｜tool▁call▁begin｜>` without
the block's opening token also starts the calls.
"""

from __future__ import annotations

from paged_server.tool_parsers.framed import FramedToolParser, plain_name

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
SEP = "<｜tool▁sep｜>"


class DeepSeekV3ToolParser(FramedToolParser):
    start_markers = (CALLS_BEGIN, CALL_BEGIN)
    call_begin = CALL_BEGIN

    def header(self, text: str, pos: int) -> tuple[str, str, int] | None:
        sep = text.find(SEP, pos)
        if sep < 0:
            return None
        kind = text[pos:sep].strip()  # "function"
        line_end = text.find("\n", sep + len(SEP))
        if line_end < 0:
            return None
        name = text[sep + len(SEP) : line_end].strip()
        return (name if plain_name(kind) else ""), "", line_end + 1

    def gap_ok(self, gap: str) -> bool:
        return gap.strip() in ("", "```json", "```")


class DeepSeekV31ToolParser(FramedToolParser):
    start_markers = (CALLS_BEGIN, CALL_BEGIN)
    call_begin = CALL_BEGIN

    def header(self, text: str, pos: int) -> tuple[str, str, int] | None:
        sep = text.find(SEP, pos)
        if sep < 0:
            return None
        return text[pos:sep].strip(), "", sep + len(SEP)
