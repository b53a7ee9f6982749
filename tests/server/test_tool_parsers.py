"""Tool-call parsers (--tool-call-parser) and the streaming hold-back, without a server."""

from __future__ import annotations

import json

import pytest

from paged_server.errors import APIError
from paged_server.tool_parsers import TOOL_PARSERS
from paged_server.tool_parsers.base import StreamingToolText
from paged_server.tools import parse_tools

HERMES = TOOL_PARSERS["hermes"]()
LLAMA = TOOL_PARSERS["llama3_json"]()


def test_hermes_calls_and_content() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": "{\\"y\\": [2]}"}\n</tool_call>'
    )
    content, calls = HERMES.parse(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("a", {"x": 1}),
        ("b", {"y": [2]}),
    ]
    assert HERMES.parse("no tools here") == ("no tools here", [])
    bad = "<tool_call>{not json}</tool_call>"
    assert HERMES.parse(bad) == (bad, [])  # malformed: the text stays content


def test_llama3_json_calls() -> None:
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    content, calls = LLAMA.parse(text)
    assert content is None and [c.name for c in calls] == ["a", "b"]
    assert json.loads(calls[0].arguments) == {"x": 1}
    assert LLAMA.parse("The answer is 4.") == ("The answer is 4.", [])
    assert LLAMA.parse('{"answer": 4}') == ('{"answer": 4}', [])  # JSON, but not a call


@pytest.mark.parametrize("split", [1, 3, 7])
def test_streaming_holds_back_a_possible_marker(split: int) -> None:
    text = 'Sure <tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>'
    s = StreamingToolText(HERMES)
    shown = "".join(s.feed(text[i : i + split]) for i in range(0, len(text), split))
    rest, calls = s.finish()
    assert shown + rest == "Sure " and [c.name for c in calls] == ["a"]


def test_streaming_without_calls_shows_everything() -> None:
    text = "a < b and <tool is not a marker"
    s = StreamingToolText(HERMES)
    shown = "".join(s.feed(ch) for ch in text)
    rest, calls = s.finish()
    assert shown + rest == text and not calls


def test_auto_needs_a_parser() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    with pytest.raises(APIError) as e:
        parse_tools({"tools": tools}, None)
    assert e.value.param == "tool_choice"
    req = parse_tools(
        {"tools": tools, "tool_choice": "required", "parallel_tool_calls": False}, None
    )
    assert req is not None and req.constraint()["json"]["maxItems"] == 1
