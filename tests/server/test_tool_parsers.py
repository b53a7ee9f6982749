"""Tool-call parsers (--tool-call-parser) and the streaming hold-back, without a server."""

from __future__ import annotations

import json

import pytest

from paged_server.errors import APIError
from paged_server.tool_parsers import TOOL_PARSERS
from paged_server.tool_parsers.streaming import StreamingToolText, scan_call
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
    shown = "".join(s.feed(text[i : i + split])[0] for i in range(0, len(text), split))
    rest, _, calls = s.finish()
    assert shown + rest == "Sure " and [c.name for c in calls] == ["a"]


def test_streaming_without_calls_shows_everything() -> None:
    text = "a < b and <tool is not a marker"
    s = StreamingToolText(HERMES)
    shown = "".join(s.feed(ch)[0] for ch in text)
    rest, entries, calls = s.finish()
    assert shown + rest == text and not calls and not entries


def test_auto_needs_a_parser() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    with pytest.raises(APIError) as e:
        parse_tools({"tools": tools}, None)
    assert e.value.param == "tool_choice"
    req = parse_tools(
        {"tools": tools, "tool_choice": "required", "parallel_tool_calls": False}, None
    )
    assert req is not None and req.constraint()["json"]["maxItems"] == 1


def stream_calls(parser, text: str, split: int) -> tuple[str, list[list[dict]]]:
    """Feed `text` in pieces of `split` characters: (content shown, tool_calls entries per
    feed, the finish's last)."""
    s = StreamingToolText(parser)
    shown, per_feed = "", []
    for i in range(0, len(text), split):
        out, entries = s.feed(text[i : i + split])
        shown += out
        per_feed.append(entries)
    rest, entries, _ = s.finish()
    per_feed.append(entries)
    return shown + rest, per_feed


def accumulate(per_feed: list[list[dict]]) -> list[dict]:
    """What OpenAI clients do with delta.tool_calls: merge by index, concatenate arguments."""
    calls: dict[int, dict] = {}
    for entries in per_feed:
        for e in entries:
            c = calls.setdefault(e["index"], {"id": None, "name": None, "arguments": ""})
            assert ("id" in e) == (c["id"] is None), "id and name come once, in the first entry"
            if "id" in e:
                assert e["type"] == "function" and e["function"]["name"]
                c["id"], c["name"] = e["id"], e["function"]["name"]
            c["arguments"] += e["function"].get("arguments", "")
    return [calls[k] for k in sorted(calls)]


PARALLEL = {
    "hermes": (
        'Checking.\n<tool_call>\n{"name": "forecast", "arguments": {"city": "oslo", '
        '"days": 3, "note": "say \\"hi\\" {ok}"}}\n</tool_call>\n<tool_call>\n'
        '{"arguments": {"tz": "utc"}, "name": "clock"}\n</tool_call>',
        "Checking.\n",
    ),
    "llama3_json": (
        '<|python_tag|>{"name": "forecast", "parameters": {"city": "oslo", "days": 3, '
        '"note": "say \\"hi\\" {ok}"}}; {"parameters": {"tz": "utc"}, "name": "clock"}',
        "",
    ),
}


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
@pytest.mark.parametrize("split", [1, 2, 5, 1000])
def test_arguments_stream_piece_by_piece(parser: str, split: int) -> None:
    """The first entry of a call carries id, type and name; then argument pieces follow as
    they are generated; accumulated, they equal the non-streamed calls."""
    p = TOOL_PARSERS[parser]()
    text, content = PARALLEL[parser]
    shown, per_feed = stream_calls(p, text, split)
    assert shown.strip() == content.strip()
    calls = accumulate(per_feed)
    _, whole = p.parse(text)
    assert [c["name"] for c in calls] == [c.name for c in whole] == ["forecast", "clock"]
    for c, w in zip(calls, whole):
        assert json.loads(c["arguments"]) == json.loads(w.arguments)
    if split == 1:  # one character at a time: the arguments arrive over many chunks
        pieces = [e for entries in per_feed for e in entries if e["index"] == 0]
        assert len(pieces) > 10
        # the name goes out before the arguments are complete
        assert pieces[0]["function"]["arguments"] != calls[0]["arguments"]


def test_arguments_given_as_a_json_string_arrive_whole_at_the_end() -> None:
    text = '<tool_call>\n{"name": "b", "arguments": "{\\"y\\": [2]}"}\n</tool_call>'
    _, per_feed = stream_calls(HERMES, text, 3)
    (call,) = accumulate(per_feed)
    assert call["name"] == "b" and json.loads(call["arguments"]) == {"y": [2]}


def test_scan_call_partial_states() -> None:
    text = '{"name": "f", "arguments": {"a": [1, {"b": "}"}], "c": 2}}'
    for cut in range(len(text) + 1):
        call = scan_call(text[:cut], 0, ("arguments",))
        if cut >= len('{"name": "f"'):
            assert call.name == "f"
        assert text.startswith(text[: text.find("{", 1)] + call.args) or not call.args
        assert call.args_done == (cut >= len(text) - 1)
        assert (call.end is not None) == (cut == len(text))
    done = scan_call(text, 0, ("arguments",))
    assert json.loads(done.args) == {"a": [1, {"b": "}"}], "c": 2}
