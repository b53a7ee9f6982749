"""Tool calls in blocks with content around them (glm45.py, lfm2.py, qwen3_coder.py, deepseek.py,
xml_calls.py):

    CONTENT <block> CONTENT <block> CONTENT

The content is the text before the first block as written, then the text after each block
(`gap_content`: as written, none when only whitespace; lfm2 drops an echo besides); the
answer's content is None when `no_content` (base.py). A block that cannot be read (malformed,
or cut off by max_tokens) ends the calls: from the text just after the last block read, all
of it is content as written. No block read: the whole text is content.

Streamed, the text before the first block streams as StreamingToolText streams it; from there
each rescan sends what of the content is `settled`: the content as far as more text can no
longer change it. The same code reads both forms (`content_and_calls`), each settled content
starts with the one before, and the whole answer's content starts with every one of them, so
the streamed pieces join to exactly the whole answer's content.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paged_engine.engine.detokenizer import stop_holdback
from paged_server.tool_parsers.base import ParsedCall, ToolParser
from paged_server.tool_parsers.streaming import StreamingToolText


@dataclass(slots=True)
class Block:
    start: int  # index of the marker that opens it
    end: int | None  # index just past it; None while it is open, or when it cannot be read
    calls: list[ParsedCall] | None  # None: not read (yet)


class InterleavedToolParser(ToolParser):
    def blocks(self, text: str, final: bool) -> list[Block]:
        """The blocks begun in `text`, in order, ending with the first that is not read.
        `final`: `text` is the whole output (a block still open is read as far as it goes)."""
        raise NotImplementedError

    def gap_content(self, gap: str) -> str:
        """The content of the text between two blocks read, or after the last one."""
        return gap if gap.strip() else ""

    def gap_settled(self, gap: str) -> str:
        """What of `gap_content` of any text starting with `gap` is known already; a prefix of
        `gap` as well (the gap is content as written when the block after it is not read)."""
        return self.gap_content(gap)

    def content_and_calls(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        """(the content, the calls read); not `final`: the settled content."""
        blocks = self.blocks(text, final)
        if not blocks:
            return text, []
        content, calls, pos = text[: blocks[0].start], [], blocks[0].start
        for block in blocks:
            if block.calls is None or block.end is None:  # the calls end here
                rest = text[pos:] if final else self.gap_settled(text[pos : block.start])
                return content + rest, calls
            content += self.gap_content(text[pos : block.start])
            calls += block.calls
            pos = block.end
        tail = text[pos:]
        if final:
            return content + self.gap_content(tail), calls
        tail = tail[: len(tail) - stop_holdback(tail, self.start_markers)]
        return content + self.gap_settled(tail), calls

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        content, calls = self.content_and_calls(text, final=True)
        if not calls:
            return text, []
        return (None if self.no_content(content) else content), calls

    def streamer(self) -> Any:
        return InterleavedStream(self)


class InterleavedStream(StreamingToolText):
    parser: InterleavedToolParser

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        out, entries = super().feed(delta)
        if not self.holding or self.scanned != len(self.text):  # no rescan this time
            return out, entries
        try:
            settled, _ = self.parser.content_and_calls(self.text, final=False)
        except RecursionError:  # nested past the limit (json.loads): nothing more settled yet
            return out, entries
        if self.parser.no_content(settled):  # may still be no content: held back
            return out, entries
        # `sent` counts the content sent: a prefix of `settled` (see the module docstring)
        out, self.sent = out + settled[self.sent :], max(self.sent, len(settled))
        return out, entries
