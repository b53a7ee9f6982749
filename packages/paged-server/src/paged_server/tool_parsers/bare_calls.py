"""Streaming for formats whose calls may also stand bare, with no marker before them, at the
start of the answer (olmo3.py, xlam.py): StreamingToolText, plus

- the parser's `bare_start(text, sent)` says, while no content past the answer's start has been
  sent, whether the text from `sent` on opens calls (where: content stops there, calls follow),
  may still do so (-1: it is held back until the next piece decides) or does not (None: the
  start markers decide, as usual);
- the parser's `calls_start(text)` says where the calls `parse` read begin: when that is past
  the first marker (a block that turned out not to be calls came first), `finish` sends the
  content in between, so that the stream's content is the non-streamed content.
"""

from __future__ import annotations

from typing import Any

from paged_server.tool_parsers.base import ParsedCall
from paged_server.tool_parsers.streaming import StreamingToolText


class BareCallsStream(StreamingToolText):
    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        if not self.holding:
            text = self.text + delta
            start = self.parser.bare_start(text, self.sent)
            if start is not None:
                self.text = text
                if start < 0:
                    return "", []
                self.holding = True
                out, self.sent = text[self.sent : start], max(self.sent, start)
                return out, self._updates()
        return super().feed(delta)

    def finish(self) -> tuple[str, list[dict[str, Any]], list[ParsedCall]]:
        rest, entries, calls = super().finish()
        if calls:
            rest = self.text[self.sent : self.parser.calls_start(self.text)]
        return rest, entries, calls
