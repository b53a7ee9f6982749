"""`ToolParser`: turns a model's text into content plus tool calls.

`parse(text)` -> (content or None, calls); `partial_calls(text)` -> the calls as far as they
have arrived, for streaming (streaming.py: content streams until the text might be starting a
tool call, `start_markers`; from there the calls stream as `delta.tool_calls`). A parser whose
format interleaves content and calls streams with its own `streamer()` (gpt_oss.py).

The content of an answer with calls is the text before them exactly as the model wrote it, not
stripped (`content_before`; None when empty), as vLLM's hermes, mistral, deepseek, kimi_k2,
internlm and qwen3_coder parsers answer it, and a stream's content pieces join to exactly
that (streaming.py), so a client gets the same content streamed or not. Two per-parser
refinements, each applied alike to both forms:
    `blank_is_no_content`  whitespace alone before the calls is no content (None): where calls
                           may open the answer with no marker (llama3_json, pythonic, olmo3,
                           xlam: vLLM answers None there) and where vLLM's answer turns
                           whitespace-only content into None (glm45, hunyuan_a13b; jamba
                           overrides `no_content`: vLLM's makes only "" and " " None); a
                           stream holds leading whitespace back until something else follows.
    `trim_before_calls`    these characters are trimmed off the end of the content before the
                           calls (ernie45: newlines, as vLLM's `rstrip("\n")`); a stream holds
                           a trailing run of them back until something else follows.
Where vLLM strips its non-streamed content but streams it unstripped (lfm2, xlam, qwen3_coder,
seed_oss, minimax_m2), paged keeps the text as written, so that both forms agree. Parsers whose
content goes on between and after the calls (glm45, lfm2, qwen3_coder, deepseek_v3 / v31,
seed_oss, minimax_m2) build on interleaved.py.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolParser:
    start_markers: tuple[str, ...] = ()
    # The request's tools: function name -> its parameters' JSON schema (set per request by
    # tools.ToolOutput; a parser whose format carries untyped values reads their types here).
    schemas: dict[str, Any] = {}  # noqa: RUF012 - replaced per instance, never mutated
    # The marker that opens a call is a special token (Mistral's [TOOL_CALLS]): the request's
    # skip_special_tokens defaults to False so the text keeps it.
    keeps_special_tokens: bool = False
    # The parser reads Harmony messages (gpt-oss) itself: a Harmony reasoning parser leaves it
    # the text as written, less the reasoning (reasoning.py).
    reads_harmony: bool = False
    # Whitespace alone before the calls is no content (`content_before`, streaming.py).
    blank_is_no_content: bool = False
    # Characters trimmed off the end of the content before the calls (`content_before`).
    trim_before_calls: str = ""

    @staticmethod
    def new_call_id() -> str:
        """A tool call's id, OpenAI-style; a parser whose model checks ids overrides it."""
        return f"call_{uuid.uuid4().hex[:24]}"

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        raise NotImplementedError

    def content_before(self, text: str, start: int) -> str | None:
        """The content of an answer whose calls start at text[start]: the text before them as
        written, less `trim_before_calls` at its end; None when that is empty, or only
        whitespace and `blank_is_no_content`. Always a prefix of `text`: a stream sends the
        same characters (streaming.py)."""
        content = text[:start].rstrip(self.trim_before_calls)  # (rstrip("") strips nothing)
        return None if self.no_content(content) else content

    def no_content(self, content: str) -> bool:
        """Whether this content text is no content (None): when empty, or only whitespace and
        `blank_is_no_content`. Once False for a text, False for every text it starts (a
        stream holds leading text back while this is True, streaming.py)."""
        return not content.strip() if self.blank_is_no_content else not content

    def streamer(self) -> Any:
        """What streams one output through this parser: `feed(text)` -> (content, tool_calls
        entries), `finish()` -> (content, entries, calls). By default streaming.py's
        StreamingToolText over `partial_calls`: content until a call may start, then calls."""
        from paged_server.tool_parsers.streaming import StreamingToolText  # it imports this

        return StreamingToolText(self)

    def partial_calls(self, text: str) -> list[Any]:
        """streaming.PartialCall per call begun in `text` (the last one may be incomplete)."""
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


def parse_or_content(parser: ToolParser, text: str) -> tuple[str | None, list[ParsedCall]]:
    """`parser.parse(text)`, where text nested past Python's recursion limit (the model's
    output is untrusted: json.loads and ast raise RecursionError, not ValueError, on 100k "[")
    is content, as any call that cannot be read."""
    try:
        return parser.parse(text)
    except RecursionError:
        return text, []
