"""Reasoning parsers (`--reasoning-parser NAME`, vLLM's): a thinking model's reasoning goes to
`reasoning_content`, the rest stays `content` (chat completions and the Responses API).

    deepseek_r1   the chat template may have opened the block already (R1 distills): everything
                  up to the first `</think>` is reasoning, a `<think>` before it is dropped;
                  no `</think>` at all: the whole output is reasoning (cut short while thinking)
    qwen3         reasoning only after an explicit `<think>`, up to `</think>` (or the end: cut
                  short while thinking, as vLLM's qwen3 parser answers since it treats a missing
                  `</think>` as truncation); text before `<think>` and after `</think>` is content;
                  no `<think>`: all content
    glm45         GLM-4.5 / 4.6 (they write their own `<think>`): read as qwen3 (vLLM's glm4_moe
                  parser, also explicit-`<think>`; GLM-4.7's template opens the block in the
                  prompt: deepseek_r1 reads that)
    kimi_k2       Kimi K2 Thinking: read as deepseek_r1 (vLLM maps kimi_k2 to its R1 parser)
    openai_gptoss gpt-oss's Harmony messages (harmony.py): the analysis channel is reasoning,
                  final and commentary without a recipient are content, tool calls are the
                  tool parser's (`--tool-call-parser openai`); special tokens are kept in the
                  text, since the markers are special tokens

Think tags: only the first block counts, after `</think>` the text is content, tags included.
The response carries the reasoning twice, as `reasoning_content` (DeepSeek's name) and
`reasoning` (vLLM's since 0.11); `include_reasoning: false` drops both. A stream sends it as
`delta` pieces of the same two fields.

`ThinkSplitter` (`HarmonySplitter` for openai_gptoss) is one state machine over the text as it
arrives; the whole text is that machine fed once, so a stream's pieces always join to the
non-streamed answer. A tail that could still become a tag is held back until the next piece (or
the end) decides it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paged_server.harmony import HarmonySplitter

OPEN, CLOSE = "<think>", "</think>"
THINK_PARSERS = ("deepseek_r1", "qwen3", "glm45", "kimi_k2")
_TEMPLATE_OPENS = ("deepseek_r1", "kimi_k2")  # the others: the model writes its own <think>
HARMONY = "openai_gptoss"
REASONING_PARSERS = (*THINK_PARSERS, HARMONY)
_BEFORE, _THINKING, _AFTER = range(3)  # content until <think> | reasoning | content to the end


class ThinkSplitter:
    """Text pieces in, (reasoning, content) pieces out."""

    def __init__(self, parser: str) -> None:
        if parser not in THINK_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {THINK_PARSERS}, got {parser!r}")
        # deepseek_r1: the template opened the block; qwen3: the model must open it
        self.state = _THINKING if parser in _TEMPLATE_OPENS else _BEFORE
        self.opened = self.state == _BEFORE  # qwen3 reaches _THINKING only through its <think>
        self.pending = ""  # text not yet assigned: a possible start of a tag

    def _markers(self) -> tuple[str, ...]:
        if self.state == _BEFORE:
            return (OPEN,)
        if self.state == _THINKING:
            return (CLOSE,) if self.opened else (CLOSE, OPEN)
        return ()

    def feed(self, text: str) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        buf, self.pending = self.pending + text, ""
        while buf:
            out = reasoning if self.state == _THINKING else content
            markers = self._markers()
            hits = [(i, m) for m in markers if (i := buf.find(m)) >= 0]
            if not hits:
                keep = _tag_prefix_len(buf, markers)
                out.append(buf[: len(buf) - keep])
                self.pending = buf[len(buf) - keep :]
                break
            pos, tag = min(hits)
            out.append(buf[:pos])
            buf = buf[pos + len(tag) :]
            if tag == OPEN:  # qwen3: the block begins; deepseek_r1: a redundant opener
                self.state, self.opened = _THINKING, True
            else:
                self.state = _AFTER
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output is complete: no tag after all."""
        rest, self.pending = self.pending, ""
        return (rest, "") if self.state == _THINKING else ("", rest)


def _tag_prefix_len(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


def make_splitter(parser: str, tool_markup: bool = False) -> ThinkSplitter | HarmonySplitter:
    """`tool_markup`: the tool parser reads the Harmony messages itself (HarmonySplitter)."""
    return HarmonySplitter(tool_markup) if parser == HARMONY else ThinkSplitter(parser)


def split_reasoning(parser: str, text: str, tool_markup: bool = False) -> tuple[str | None, str]:
    """The whole output -> (reasoning or None when there is none, content)."""
    s = make_splitter(parser, tool_markup)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    reasoning = r1 + r2
    return reasoning or None, c1 + c2


@dataclass(slots=True)
class ReasoningRequest:
    """One chat request's reasoning handling: the server's parser, the client's choice."""

    parser: str
    include: bool = True  # include_reasoning
    # The tool parser of this request reads Harmony (--tool-call-parser openai): the content
    # keeps the messages as written (less the reasoning), for it to find the calls in.
    tool_markup: bool = False

    @property
    def keeps_special_tokens(self) -> bool:
        """The format's markers are special tokens: the text must keep them."""
        return self.parser == HARMONY

    def fields(self, reasoning: str) -> dict[str, str]:
        return {"reasoning_content": reasoning, "reasoning": reasoning} if self.include else {}


class ReasoningOutput:
    """One choice's stream: splits each chunk entry's `delta.content` into reasoning and
    content (before the tool-call logic, which sees the content only)."""

    def __init__(self, req: ReasoningRequest) -> None:
        self.req = req
        self.splitter = make_splitter(req.parser, req.tool_markup)

    def rewrite(self, entry: dict[str, Any]) -> dict[str, Any] | None:
        """The entry with its delta split; None when it carries nothing any more (an entry
        with logprobs or token ids is kept, with an empty delta)."""
        delta = entry.get("delta", {})
        reasoning, content = self.splitter.feed(delta.get("content", ""))
        finished = entry.get("finish_reason") is not None
        if finished:
            r, c = self.splitter.finish()
            reasoning, content = reasoning + r, content + c
        new_delta: dict[str, Any] = self.req.fields(reasoning) if reasoning else {}
        if content:
            new_delta["content"] = content
        if not (new_delta or finished or entry.get("logprobs") or entry.get("token_ids")):
            return None
        return {**entry, "delta": new_delta}
