"""Streaming for formats whose calls may also stand bare, with no marker before them, at the
start of the answer (olmo3.py, xlam.py): StreamingToolText, plus the parser's
`bare_start(text, sent)`, which says, while no content past the answer's start has been sent,
whether the text from `sent` on opens calls (where: content stops there, calls follow), may
still do so (-1: it is held back until the next piece decides) or does not (None: the start
markers decide, as usual). Whitespace alone before bare calls is no content (the parsers'
`calls_open_answer`): it is not sent. What is sent at the end, when the calls `parse` read
start past the first marker, is StreamingToolText.finish's (the rest of the parse's content).
"""

from __future__ import annotations

from typing import Any

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
                if self.parser.blank_is_no_content and not text[:start].strip():  # none
                    return "", self._updates()
                out, self.sent = text[self.sent : start], max(self.sent, start)
                return out, self._updates()
        return super().feed(delta)
