"""Hostile model outputs through forced tool calls (forced_calls.py): whatever the text (a
misconfigured grammar, a cut by max_tokens), a stream's argument pieces join to the whole
answer's arguments, the arguments are one JSON value, and an open string never rescans what
it already read."""

from __future__ import annotations

import json

import pytest

from paged_server.forced_calls import ForcedCalls, forced_calls


def _streamed(text: str, step: int) -> list[tuple[str, str]]:
    """(name, arguments) per call, joined from the stream of `text` in `step`-character pieces."""
    reader = ForcedCalls(None)
    entries = []
    for i in range(0, len(text), step):
        entries += reader.feed(text[i : i + step])
    entries += reader.finish()[0]
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for e in entries:
        if "name" in e["function"]:
            names[e["index"]] = e["function"]["name"]
        args[e["index"]] = args.get(e["index"], "") + e["function"]["arguments"]
    return [(names[k], args[k]) for k in sorted(args)]


def _required(parameters: str) -> str:
    return '[{"name": "f", "parameters": ' + parameters + "}]"


@pytest.mark.parametrize(
    ("parameters", "value"),
    [
        (r'{"a": "ab\ncd\q"}', "ab\ncd\\q"),  # a valid escape, then an invalid one
        (r'{"a": "x\u00e9y\u12zz"}', "xéy\\u12zz"),  # a valid \u escape, then a short one
        (r'{"a": "\ud83d\ude00 \uZZZZ \\ \/"}', "😀 \\uZZZZ \\ /"),
        (r'{"a": "\ud800\u12"}', "\ud800\\u12"),  # a lone high surrogate, a short escape
    ],
)
@pytest.mark.parametrize("step", [1, 2, 3, 5])
def test_invalid_escapes_stream_as_the_whole_answer_reads_them(
    parameters: str, value: str, step: int
) -> None:
    # an invalid escape used to leave the whole decoded piece as written: "\n" decoded when
    # it came in its own piece, kept as "\\n" when the whole text was one piece
    text = _required(parameters)
    whole = [(c.name, c.arguments) for c in forced_calls(text, None)]
    assert json.loads(whole[0][1]) == {"a": value}
    assert _streamed(text, step) == whole


def test_an_invalid_u_escape_does_not_hold_the_string_back() -> None:
    # "\u12" followed by text that is no hex digit can never complete: the raw text after it
    # was kept undecoded and joined again on every piece (quadratic in the string's length)
    reader = ForcedCalls(None)
    reader.feed('[{"name": "f", "parameters": {"a": "\\u12')
    pending = []
    for _ in range(2000):
        reader.feed("xyz")
        assert reader.list is not None
        pending.append(sum(map(len, reader.list.raw)))
    assert max(pending) < 8, max(pending)
    reader.feed('"}]')
    calls = reader.finish()[1]
    assert json.loads(calls[0].arguments) == {"a": "\\u12" + "xyz" * 2000}


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_a_second_parameters_key_is_left_out(step: int) -> None:
    # both values were concatenated: '{"a": 1}{"b": [2]}' is no JSON value
    text = '[{"name": "f", "parameters": {"a": 1}, "parameters": {"b": [2]}}, '
    text += '{"parameters": {"c": 3}, "name": "g", "parameters": 4}]'
    calls = forced_calls(text, None)
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}'), ("g", '{"c": 3}')]
    assert _streamed(text, step) == [("f", '{"a": 1}'), ("g", '{"c": 3}')]
