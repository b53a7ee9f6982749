"""One chat answer as the APIs built on the chat path read it (the Responses API, Anthropic's
Messages API): its reasoning split off (--reasoning-parser), then its tool calls parsed
(--tool-call-parser, or the forced calls of tool_choice), whole or as a stream of chat-style
deltas ({"reasoning_content", "content", "tool_calls"})."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from paged_server.openai_responses import StreamChoice
from paged_server.reasoning import ReasoningOutput, ReasoningRequest, split_reasoning
from paged_server.tools import ToolOutput, ToolRequest, make_parser


def tool_output(tools: ToolRequest | None, parser: str | None) -> ToolOutput | None:
    """The request's tool-call logic; None when the output is plain text."""
    if tools is None or tools.choice == "none":
        return None
    return ToolOutput(tools, make_parser(parser))


def split_output(
    text: str,
    finish_reason: str | None,
    reasoning: ReasoningRequest | None,
    tools: ToolOutput | None,
) -> tuple[str | None, str | None, list[dict[str, Any]]]:
    """A finished output -> (its reasoning or None, its content, OpenAI's tool_calls)."""
    thought, answer = None, text
    if reasoning is not None:
        thought, answer = split_reasoning(reasoning.parser, text, reasoning.tool_markup)
    if tools is None:
        return thought, answer, []
    msg, _ = tools.message(answer, finish_reason)
    return thought, msg["content"], msg.get("tool_calls", [])


class ChatDeltas:
    """One choice's DELTA outputs as chat-style deltas, through the reasoning split and the
    tool-call logic (in that order: the tool parser sees the content only)."""

    def __init__(
        self,
        reasoning: ReasoningRequest | None,
        tools: ToolOutput | None,
        decode: Callable[[int], str],
        top_logprobs: int | None = None,
        token_text: Callable[[int], str] | None = None,
    ) -> None:
        self.choice = StreamChoice()
        self.think = None if reasoning is None else ReasoningOutput(reasoning)
        self.tools = tools
        self.decode = decode
        self.top_logprobs = top_logprobs  # None: no logprobs
        self.token_text = token_text or decode  # a token's text, to find the content's tokens
        # Logprob entries (with their token's text) that no delta has accounted for yet: text
        # the rewrites hold back (a partial end tag, a possible tool call) shows in a later delta.
        self.pending: list[tuple[dict[str, Any], str]] = []

    def feed(self, arrived: list[tuple[int, Any]]) -> dict[str, Any] | None:
        """The delta of one batch of (prompt index, output) pairs; None when nothing shows.
        With logprobs, `delta["logprobs"]` holds chat's entries of the tokens that wrote the
        delta's content (the reasoning's and the tool calls' tokens are not among them)."""
        for _, out in arrived:
            for seq in out.outputs:
                self.choice.add(seq, out.finished)
        tids = self.choice.token_ids
        entry = self.choice.chunk(0, "", self.top_logprobs, self.decode, True)
        lp = None if entry is None or entry.get("logprobs") is None else entry["logprobs"]
        if lp is not None and self.think is None and self.tools is None:
            return {**entry["delta"], "logprobs": lp["content"]}  # all of it is content
        if lp is not None:
            self.pending += zip(lp["content"], map(self.token_text, tids), strict=True)
        if entry is not None and self.think is not None:
            entry = self.think.rewrite(entry)
        if entry is not None and self.tools is not None:
            entry = self.tools.rewrite(entry)
        if entry is None:
            return None
        delta = entry["delta"]
        if lp is None:
            return delta
        return {**delta, "logprobs": self._content_logprobs(delta)}

    def _content_logprobs(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """The pending entries of the tokens that wrote `delta`'s content, located by text
        (after the delta's reasoning); entries past the content stay pending, earlier ones go.
        When the text is not found (a character split across tokens), all of them."""
        pieces = [p for _, p in self.pending]
        joined = "".join(pieces)
        thought, content = delta.get("reasoning_content"), delta.get("content")
        begin = 0
        if thought:
            at = joined.find(thought)
            begin = at + len(thought) if at >= 0 else len(joined)
        if not content:  # reasoning or tool calls took the text up to here
            self.pending = [] if delta.get("tool_calls") else _from(self.pending, begin)
            return []
        start = joined.find(content, begin)
        if start < 0:
            out, self.pending = [e for e, _ in self.pending], []
            return out
        end = start + len(content)
        out = _within(self.pending, start, end)
        self.pending = _from(self.pending, end)
        return out

    def stream(self, arrivals: Iterable[list[tuple[int, Any]]]) -> Iterator[dict[str, Any]]:
        """The deltas of the batches as they arrive (those that show something)."""
        for arrived in arrivals:
            delta = self.feed(arrived)
            if delta is not None:
                yield delta

    @property
    def finish_reason(self) -> str | None:
        return self.choice.finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.choice.stop_reason


def _within(
    pairs: Iterable[tuple[dict[str, Any], str]], start: int, end: int
) -> list[dict[str, Any]]:
    """The entries of the (entry, token text) pairs whose text overlaps characters
    [start, end) of the joined text."""
    out, pos = [], 0
    for e, piece in pairs:
        if pos + len(piece) > start and pos < end:
            out.append(e)
        pos += len(piece)
    return out


def _from(pending: list[tuple[dict[str, Any], str]], at: int) -> list[tuple[dict[str, Any], str]]:
    """The entries whose token's text starts at or after character `at` of the joined text."""
    pos, i = 0, 0
    while i < len(pending) and pos < at:
        pos += len(pending[i][1])
        i += 1
    return pending[i:]


def span_logprobs(
    entries: list[dict[str, Any]], pieces: list[str], text: str, after: str | None = None
) -> list[dict[str, Any]]:
    """Chat's logprob entries of the tokens that wrote `text` (`pieces`: each token's text),
    a part of their joined text (the answer after its reasoning `after`, or before its tool
    calls); none when it is not found there (a character split across tokens)."""
    joined = "".join(pieces)
    begin = 0
    if after:  # the answer follows the reasoning: not a copy of it inside the reasoning
        at = joined.find(after)
        begin = at + len(after) if at >= 0 else 0
    start = joined.find(text, begin) if text else -1
    if start < 0:
        return []
    return _within(zip(entries, pieces, strict=True), start, start + len(text))
