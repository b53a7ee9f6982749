"""OpenAI's Harmony format (gpt-oss): the model's output as messages on channels.

The chat template's prompt ends with `<|start|>assistant`; the model then writes messages

    <|channel|>analysis<|message|>User asks weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"location":"Paris"}<|call|>

(one line in the output), each a header ending at `<|message|>` (`<|start|>ROLE`, then
`<|channel|>CHANNEL`; a recipient `to=NAME` in the role part or after the channel; a content
type, after `<|constrain|>` or not), then a body ending at `<|end|>`, `<|return|>` or `<|call|>`.
The last two are EOS tokens, which the engine does not show: the last body usually just ends.
The first message's `<|start|>assistant` is the prompt's, so the output begins inside a header
(`<|channel|>...`, or ` to=functions.f<|channel|>...`); text that cannot be the rest of that
header (a model writing no markers at all) is plain text.

What a message is, by its header (`kind`):

    a recipient                              CALL       functions.NAME: a tool call, its body the
                                                        arguments (JSON text); others: built-in
                                                        tools, not served
    channel final or commentary, or none     CONTENT    commentary without a recipient is a
                                                        preamble for the user (as vLLM has it)
    channel analysis, or any other           REASONING  not meant for the user
    (text outside any message)               CONTENT

The markers are special tokens, so requests read with these parsers keep special tokens in their
text, and no marker ever reaches content or reasoning: one that fits nowhere (a stray `<|end|>`,
a `<|message|>` inside a body) is dropped. The text cannot tell a special token from its
spelling, so a marker is a marker wherever it is, except inside a JSON string of a call to
`functions.NAME` (arguments may well quote one; the call's real end, `<|call|>`, is an EOS token
and not in the text anyway).

`HarmonyScanner` is one state machine over the text as it arrives (pieces in, `Event`s out); the
whole text is that machine fed once, so a stream's pieces always join to the non-streamed answer.
What could still be the start of a marker, and a header until its `<|message|>`, are held back
until decided. Joined, the events' `raw` texts are exactly the text fed (`finish()` included).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL_END = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL_END)
_MARKER = re.compile("|".join(re.escape(m) for m in MARKERS))
_SPLIT = re.compile(f"({_MARKER.pattern})")
_PREFIXES = {m[:k] for m in MARKERS for k in range(1, len(m))}  # what a marker may start as
_LONGEST = max(map(len, MARKERS))
_TERMINATORS = (END, RETURN, CALL_END)
_HEADER_STARTS = (START, CHANNEL)

CONTENT, REASONING, CALL = "content", "reasoning", "call"
_CONTENT_CHANNELS = (None, "final", "commentary")
_FUNCTIONS = "functions."

# The prompt's header, continued: at most ` to=RECIPIENT` before a marker. Prefix-closed, so
# where text stops matching does not depend on how it was split; bounded, so it is decided soon.
_OPENING = re.compile(r"\s*(?:t|to|to=[^\s<]*\s*)?")
_MAX_OPENING = 256

_LOOSE, _HEADER, _BODY = range(3)  # between messages | in a header | in a body


@dataclass(frozen=True, slots=True)
class Header:
    channel: str | None = None
    recipient: str | None = None


@dataclass(frozen=True, slots=True)
class Event:
    """`what`: "open" (`raw` the whole header, `<|message|>` included), "text", "close" (`raw`
    the terminator; "" when the body ended otherwise) or "drop" (a stray marker, or a header
    that never reached `<|message|>`). `header`: the message it belongs to (None: outside)."""

    what: str
    header: Header | None
    raw: str


def kind(header: Header | None) -> str:
    if header is None:
        return CONTENT
    if header.recipient is not None:
        return CALL
    return CONTENT if header.channel in _CONTENT_CHANNELS else REASONING


def function_name(header: Header | None) -> str | None:
    """NAME of a message to `functions.NAME`; None for any other message."""
    recipient = header.recipient if header is not None else None
    if recipient is None or not recipient.startswith(_FUNCTIONS):
        return None
    return recipient[len(_FUNCTIONS) :] or None


def parse_header(raw: str) -> Header:
    """A header's channel (the first word after `<|channel|>`) and recipient (a `to=` word);
    the role and the content type are not needed."""
    channel = recipient = None
    section = None
    for part in _SPLIT.split(raw):
        if part in MARKERS:
            section = part
            continue
        for word in part.split():
            if word.startswith("to="):
                recipient = recipient or word[3:] or None
            elif section == CHANNEL and channel is None:
                channel = word
    return Header(channel, recipient)


class HarmonyScanner:
    """Text pieces in, events out."""

    def __init__(self) -> None:
        self.state = _HEADER  # the prompt opened the first header
        self.opening = True  # still in the prompt's header, no marker seen yet
        self.head: list[str] = []  # the header so far, as written
        self.header: Header | None = None  # the open message's
        self.pending = ""  # a tail that may be the start of a marker
        # A function call's body is JSON: where it is (inside a string, after a backslash).
        self.json, self.in_string, self.escaped = False, False, False

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        buf, self.pending = self.pending + text, ""
        pos = 0
        for m in _MARKER.finditer(buf):
            self._text(buf[pos : m.start()], events)
            if self.json and self.in_string:  # quoted in the arguments: text
                self._text(m.group(), events)
            else:
                self._marker(m.group(), events)
            pos = m.end()
        # A marker's start inside a JSON string is text too (markers hold no quote or backslash,
        # so the string state where the tail ends is the one where a marker in it would start).
        quoted = self.json and _json_state(buf[pos:], self.in_string, self.escaped)[0]
        keep = 0 if quoted else _marker_prefix_len(buf, pos)
        self._text(buf[pos : len(buf) - keep], events)
        self.pending = buf[len(buf) - keep :]
        return events

    def finish(self) -> list[Event]:
        """The rest, once the output is complete: a held tail is text after all, a body ends
        with the output, a header cut short is dropped (the prompt's, without a recipient
        in it, was plain text)."""
        events: list[Event] = []
        self._text(self.pending, events)
        self.pending = ""
        head = "".join(self.head)
        if self.state == _HEADER and head:
            plain = self.opening and "to=" not in head
            events.append(Event("text" if plain else "drop", None, head))
        elif self.state == _BODY:
            events.append(Event("close", self.header, ""))
        self.state, self.opening, self.head, self.header = _LOOSE, False, [], None
        self.json = False
        return events

    def _text(self, text: str, events: list[Event]) -> None:
        if not text:
            return
        if self.state != _HEADER:
            events.append(Event("text", self.header, text))
            if self.json:
                self.in_string, self.escaped = _json_state(text, self.in_string, self.escaped)
            return
        self.head.append(text)
        if self.opening:
            head = "".join(self.head)
            if len(head) > _MAX_OPENING or not _OPENING.fullmatch(head):
                self.state, self.opening, self.head = _LOOSE, False, []  # plain text
                events.append(Event("text", None, head))

    def _marker(self, m: str, events: list[Event]) -> None:
        if self.state == _LOOSE:
            if m in _HEADER_STARTS:
                self._begin_header(m)
            elif m == MESSAGE:  # a body without a header: plain
                self._open(Header(), m, events)
            else:
                events.append(Event("drop", None, m))
        elif self.state == _HEADER:
            if m == MESSAGE:
                raw = "".join(self.head) + m
                self._open(parse_header(raw), raw, events)
            elif m in (CHANNEL, CONSTRAIN):
                self.head.append(m)
                self.opening = False
            else:  # a new header, or a terminator: no message came of this header
                head = "".join(self.head)
                if m == START:
                    if head:
                        events.append(Event("drop", None, head))
                    self._begin_header(m)
                else:
                    events.append(Event("drop", None, head + m))
                    self.state, self.opening, self.head = _LOOSE, False, []
        elif m in _TERMINATORS:
            events.append(Event("close", self.header, m))
            self.state, self.header, self.json = _LOOSE, None, False
        elif m in _HEADER_STARTS:  # the next message began without a terminator
            events.append(Event("close", self.header, ""))
            self.header, self.json = None, False
            self._begin_header(m)
        else:  # <|message|> or <|constrain|> inside a body
            events.append(Event("drop", self.header, m))

    def _begin_header(self, m: str) -> None:
        self.state, self.opening, self.head = _HEADER, False, [m]

    def _open(self, header: Header, raw: str, events: list[Event]) -> None:
        events.append(Event("open", header, raw))
        self.state, self.opening, self.head, self.header = _BODY, False, [], header
        self.json, self.in_string, self.escaped = function_name(header) is not None, False, False


def _json_state(text: str, in_string: bool, escaped: bool) -> tuple[bool, bool]:
    """(inside a string, after a backslash) once `text` follows JSON in that state."""
    if not in_string and '"' not in text:
        return False, False
    for c in text:
        if escaped:
            escaped = False
        elif in_string and c == "\\":
            escaped = True
        elif c == '"':
            in_string = not in_string
    return in_string, escaped


def _marker_prefix_len(text: str, start: int) -> int:
    """Length of the longest tail of text[start:] that is a proper prefix of a marker."""
    for k in range(min(_LONGEST - 1, len(text) - start), 0, -1):
        if text[len(text) - k :] in _PREFIXES:
            return k
    return 0


class HarmonySplitter:
    """`--reasoning-parser openai_gptoss`: text pieces in, (reasoning, content) pieces out, as
    `reasoning.ThinkSplitter`. Reasoning is the REASONING messages' bodies; content is the
    CONTENT messages' bodies and text outside messages (CALL messages are dropped), or, with
    `tool_markup` (the tool parser reads Harmony itself: `--tool-call-parser openai`), the
    text as written less the REASONING messages' headers and bodies. Their terminators stay,
    stray markers to the tool parser, so its scanner sees the messages this one saw."""

    def __init__(self, tool_markup: bool = False) -> None:
        self.scanner = HarmonyScanner()
        self.tool_markup = tool_markup

    def feed(self, text: str) -> tuple[str, str]:
        return self._split(self.scanner.feed(text))

    def finish(self) -> tuple[str, str]:
        return self._split(self.scanner.finish())

    def _split(self, events: list[Event]) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        for e in events:
            k = kind(e.header)
            if k == REASONING:
                if e.what == "text":
                    reasoning.append(e.raw)
                elif e.what == "close" and self.tool_markup:
                    content.append(e.raw)
            elif self.tool_markup or (k == CONTENT and e.what == "text"):
                content.append(e.raw)
        return "".join(reasoning), "".join(content)
