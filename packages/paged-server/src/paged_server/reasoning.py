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
    seed_oss      Seed-OSS: deepseek_r1 with `<seed:think>` / `</seed:think>`
    mistral       Magistral / Mistral thinking: qwen3 with `[THINK]` / `[/THINK]` (special tokens,
                  kept in the text); a `[/THINK]` before any `[THINK]` is dropped
    minimax_m2    MiniMax-M2 (its template opens the block): read as deepseek_r1
    minimax_m2_append_think  no reasoning: the whole output is content, `<think>` prepended
                  (the client gets the think block inline)
    olmo3         OLMo 3 Think: read as deepseek_r1 (vLLM's whole-output parser answers all
                  content when `</think>` is missing; its stream, as here, answers reasoning)
    ernie45       ERNIE 4.5 thinking: deepseek_r1, then the newlines after `</think>` are dropped
                  and so is a `<response>` ... `</response>` wrapper around the answer (with
                  the newlines after `</response>`)
    granite       Granite 3.x thinking: reasoning after "Here is my thought process:" (or
                  "Here's"), only as the output's first text, up to "Here is my response:" (or
                  "Here's"); any other start: all content
    hunyuan_a13b  Hunyuan-A13B: qwen3 with `<think>\n` / `\n</think>\n<answer>\n`, the answer
                  ends at `\n</answer>` (dropped; what follows is content)
    deepseek_v3   DeepSeek-V3.1: deepseek_r1 when the request's chat_template_kwargs ask for
                  thinking (`thinking` or `enable_thinking`), else no reasoning (all content)
    openai_gptoss gpt-oss's Harmony messages (harmony.py): the analysis channel is reasoning,
                  final and commentary without a recipient are content, tool calls are the
                  tool parser's (`--tool-call-parser openai`); special tokens are kept in the
                  text, since the markers are special tokens

Think tags: only the first block counts, after its close the text is content, tags included.
vLLM's parsers that work on token ids see the same markers here as text. The response carries
the reasoning twice, as `reasoning_content` (DeepSeek's name) and `reasoning` (vLLM's since
0.11); `include_reasoning: false` drops both. A stream sends it as `delta` pieces of the same
two fields.

`ThinkSplitter` (`HarmonySplitter` for openai_gptoss) is one state machine over the text as it
arrives, driven by the parser's `ThinkFormat`; the whole text is that machine fed once, so a
stream's pieces always join to the non-streamed answer. A tail that could still become a
marker is held back until the next piece (or the end) decides it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from paged_engine.engine.detokenizer import stop_holdback
from paged_server.harmony import HarmonySplitter


@dataclass(frozen=True, slots=True)
class ThinkFormat:
    """One family's markers, matched in the text (see ReasoningRequest.keeps_special_tokens)."""

    opens: tuple[str, ...] = ()  # begin the block; none: the output holds no reasoning
    closes: tuple[str, ...] = ()  # end it
    # The block is open from the first token (the template wrote the opener); an opener the
    # model writes anyway before the close is dropped. False: the model must open it.
    template_opens: bool = False
    opener_first: bool = False  # an opener counts only as the output's first text
    stray_close_dropped: bool = False  # a close before any opener is dropped
    # (opener, closer) around the answer after the block, both dropped; "" opener: the
    # block's close opens it. Without the opener right after the close: no wrapper.
    answer: tuple[str, str] | None = None
    skip: str = ""  # characters dropped right after the close and after the answer's closer
    content_prefix: str = ""  # put before the content
    special_tokens: bool = False  # the markers are special tokens: the text must keep them


_THINK = ("<think>",), ("</think>",)
_R1 = ThinkFormat(*_THINK, template_opens=True)
_QWEN3 = ThinkFormat(*_THINK)
_NO_REASONING = ThinkFormat()
THINK_FORMATS: dict[str, ThinkFormat] = {
    "deepseek_r1": _R1,
    "qwen3": _QWEN3,
    "glm45": _QWEN3,
    "kimi_k2": _R1,
    "seed_oss": ThinkFormat(("<seed:think>",), ("</seed:think>",), template_opens=True),
    "mistral": ThinkFormat(
        ("[THINK]",), ("[/THINK]",), stray_close_dropped=True, special_tokens=True
    ),
    "minimax_m2": _R1,
    "minimax_m2_append_think": ThinkFormat(content_prefix="<think>"),
    "olmo3": _R1,
    "ernie45": ThinkFormat(
        *_THINK, template_opens=True, answer=("<response>", "</response>"), skip="\n"
    ),
    "granite": ThinkFormat(
        ("Here is my thought process:", "Here's my thought process:"),
        ("Here is my response:", "Here's my response:"),
        opener_first=True,
    ),
    "hunyuan_a13b": ThinkFormat(
        ("<think>\n",), ("\n</think>\n<answer>\n",), answer=("", "\n</answer>")
    ),
    "deepseek_v3": _NO_REASONING,  # ReasoningRequest makes it deepseek_r1 for a thinking request
}
THINK_PARSERS = tuple(THINK_FORMATS)
HARMONY = "openai_gptoss"
REASONING_PARSERS = (*THINK_PARSERS, HARMONY)
# content until the opener | reasoning | the answer's opener may follow | in the answer |
# content to the end
_BEFORE, _THINKING, _CLOSED, _ANSWER, _AFTER = range(5)


def thinking_requested(template_kwargs: Mapping[str, Any] | None) -> bool:
    """deepseek_v3: the request's chat_template_kwargs turn thinking on (vLLM's two names)."""
    kw = template_kwargs or {}
    return bool(kw.get("thinking")) or bool(kw.get("enable_thinking"))


class ThinkSplitter:
    """Text pieces in, (reasoning, content) pieces out."""

    def __init__(self, parser: str) -> None:
        if parser not in THINK_FORMATS:
            raise ValueError(f"reasoning_parser must be one of {THINK_PARSERS}, got {parser!r}")
        self.fmt = fmt = THINK_FORMATS[parser]
        self.state = _THINKING if fmt.template_opens else _BEFORE
        self.opened = not fmt.template_opens  # _THINKING reached through the model's opener
        self.pending = ""  # text not yet assigned: a possible start of a marker
        self.skip = ""  # characters still to drop where the next text begins
        self.prefix = fmt.content_prefix  # not sent yet

    def _markers(self) -> tuple[str, ...]:
        fmt = self.fmt
        if self.state == _BEFORE:
            return fmt.opens + fmt.closes if fmt.stray_close_dropped else fmt.opens
        if self.state == _THINKING:
            return fmt.closes if self.opened else fmt.closes + fmt.opens
        if self.state == _ANSWER:
            return (fmt.answer[1],) if fmt.answer else ()
        return ()

    def _leading(self, buf: str, heads: tuple[str, ...]) -> str | None:
        """The head `buf` begins with; "" when it may still become one (held back); None when
        it cannot."""
        for head in heads:
            if buf.startswith(head):
                return head
        return "" if any(head.startswith(buf) for head in heads) else None

    def _closed(self) -> None:
        """The block's close was read."""
        answer = self.fmt.answer
        self.state = _AFTER if answer is None else _CLOSED if answer[0] else _ANSWER
        self.skip = self.fmt.skip

    def feed(self, text: str) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = [self.prefix]
        self.prefix = ""
        buf, self.pending = self.pending + text, ""
        while buf:
            if self.skip:
                buf = buf.lstrip(self.skip)
                if not buf:
                    break
                self.skip = ""
            fmt = self.fmt
            # Heads that count only where the text begins: granite's opener, ernie45's
            # <response> right after the close.
            if self.state == _CLOSED or (self.state == _BEFORE and fmt.opener_first):
                heads = (fmt.answer[0],) if self.state == _CLOSED and fmt.answer else fmt.opens
                head = self._leading(buf, heads)
                if head == "":
                    self.pending = buf
                    break
                if head is None:
                    self.state = _AFTER
                else:
                    buf = buf[len(head) :]
                    self.state = _ANSWER if self.state == _CLOSED else _THINKING
                continue
            out = reasoning if self.state == _THINKING else content
            markers = self._markers()
            hits = [(i, m) for m in markers if (i := buf.find(m)) >= 0]
            if not hits:
                keep = stop_holdback(buf, markers)
                out.append(buf[: len(buf) - keep])
                self.pending = buf[len(buf) - keep :]
                break
            pos, tag = min(hits)
            out.append(buf[:pos])
            buf = buf[pos + len(tag) :]
            if self.state == _ANSWER:
                self.state, self.skip = _AFTER, fmt.skip
            elif tag in fmt.opens:  # the block begins, or a redundant opener: dropped
                self.state, self.opened = _THINKING, True
            elif self.state == _THINKING:
                self._closed()
            # else: a stray close before the block, dropped
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output is complete: no marker after all."""
        rest, self.pending = self.prefix + self.pending, ""
        self.prefix = ""
        return (rest, "") if self.state == _THINKING else ("", rest)


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

    parser: str  # the server's; after __post_init__, the one this request's text goes through
    include: bool = True  # include_reasoning
    # The tool parser of this request reads Harmony (--tool-call-parser openai): the content
    # keeps the messages as written (less the reasoning), for it to find the calls in.
    tool_markup: bool = False
    # The request's chat_template_kwargs: deepseek_v3 reads deepseek_r1 when they ask for
    # thinking (vLLM's DeepSeekV3ReasoningParser), no reasoning otherwise.
    template_kwargs: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.parser == "deepseek_v3" and thinking_requested(self.template_kwargs):
            self.parser = "deepseek_r1"

    @property
    def keeps_special_tokens(self) -> bool:
        """The format's markers are special tokens: the text must keep them."""
        fmt = THINK_FORMATS.get(self.parser)
        return self.parser == HARMONY or (fmt is not None and fmt.special_tokens)

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
