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
    assert content == "Let me check.\n"  # as written, as vLLM's hermes answers it
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
    "mistral": (
        'Checking.[TOOL_CALLS][{"name": "forecast", "arguments": {"city": "oslo", "days": 3, '
        '"note": "say \\"hi\\" {ok}"}}, {"arguments": {"tz": "utc"}, "name": "clock"}]',
        "Checking.",
    ),
    "granite": (
        'Checking.<|tool_call|>[{"name": "forecast", "arguments": {"city": "oslo", "days": 3, '
        '"note": "say \\"hi\\" {ok}"}}, {"arguments": {"tz": "utc"}, "name": "clock"}]',
        "Checking.",
    ),
    "phi4_mini_json": (
        'functools[{"name": "forecast", "arguments": {"city": "oslo", "days": 3, "note": '
        '"say \\"hi\\" {ok}"}}, {"name": "clock", "parameters": {"tz": "utc"}}]',
        "",
    ),
}


@pytest.mark.parametrize("parser", sorted(PARALLEL))
@pytest.mark.parametrize("split", [1, 2, 5, 1000])
def test_arguments_stream_piece_by_piece(parser: str, split: int) -> None:
    """The first entry of a call carries id, type and name; then argument pieces follow as
    they are generated; accumulated, they equal the non-streamed calls."""
    p = TOOL_PARSERS[parser]()
    text, _ = PARALLEL[parser]
    shown, per_feed = stream_calls(p, text, split)
    assert shown == (p.parse(text)[0] or "")  # the non-streamed content exactly
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


QWEN3_CODER = (
    "I'll check both.\n<tool_call>\n<function=forecast>\n<parameter=city>\nSão Paulo\n"
    "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=hourly>\nfalse\n</parameter>\n"
    "<parameter=units>\n{'temp': 'C', \"wind\": [1, 2]}\n</parameter>\n<parameter=note>\n"
    'line one\nsay "hi" <b>\n</parameter>\n<parameter=extra>\n7\n</parameter>\n</function>\n'
    "</tool_call>\n<tool_call>\n<function=clock>\n</function>\n</tool_call>"
)
QWEN3_SCHEMAS = {
    "forecast": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "hourly": {"type": "boolean"},
            "units": {"type": "object"},
            "note": {"type": ["string", "null"]},
        },
    },
    "clock": {"type": "object", "properties": {}},
}


def test_qwen3_coder_calls_typed_by_the_tool_schemas() -> None:
    parser = TOOL_PARSERS["qwen3_coder"]()
    parser.schemas = QWEN3_SCHEMAS
    content, calls = parser.parse(QWEN3_CODER)
    assert content == "I'll check both.\n"  # as written (vLLM: model_output[:start])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        (
            "forecast",
            {
                "city": "São Paulo",
                "days": 3,
                "hourly": False,
                "units": {"temp": "C", "wind": [1, 2]},  # a Python literal, read
                "note": 'line one\nsay "hi" <b>',  # inner newlines stay
                "extra": "7",  # not in the schema: text
            },
        ),
        ("clock", {}),
    ]
    assert calls[0].arguments == json.dumps(json.loads(calls[0].arguments), ensure_ascii=False)
    # without schemas every value is text; a call without the <tool_call> wrapper still counts
    bare = TOOL_PARSERS["qwen3_xml"]()
    _, calls = bare.parse("<function=f>\n<parameter=n>\n5\n</parameter>\n</function>")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"n": "5"})]
    cut = QWEN3_CODER[: QWEN3_CODER.index("</function>")]  # max_tokens cut the call short
    assert parser.parse(cut) == (cut, [])
    assert parser.parse("no calls") == ("no calls", [])


@pytest.mark.parametrize(
    ("text", "schema", "want"),
    [
        ("12", {"type": "integer"}, 12),
        ("1.5", {"type": "number"}, 1.5),
        ("2", {"type": "number"}, 2),
        ("nan", {"type": "number"}, "nan"),  # JSON has no NaN: stays text
        ("twelve", {"type": "integer"}, "twelve"),
        ("null", {"type": ["integer", "null"]}, None),
        ("True", {"type": "boolean"}, True),
        ("[1, 'a']", {"type": "array"}, [1, "a"]),
        ("{oops", {"type": "object"}, "{oops"),
        (" 12 ", {}, " 12 "),  # no type: the text as written
    ],
)
def test_qwen3_coder_value_types(text: str, schema: dict, want: object) -> None:
    from paged_server.tool_parsers.qwen3_coder import typed_value

    assert typed_value(text, schema) == want


@pytest.mark.parametrize("split", [1, 4, 1000])
def test_qwen3_coder_streams_parameters_as_json_prefixes(split: int) -> None:
    """Streamed, each call is announced by name first, then its arguments grow a parameter at
    a time; accumulated they are exactly the non-streamed arguments."""
    parser = TOOL_PARSERS["qwen3_coder"]()
    parser.schemas = QWEN3_SCHEMAS
    shown, per_feed = stream_calls(parser, QWEN3_CODER, split)
    assert shown == "I'll check both.\n"
    calls = accumulate(per_feed)
    _, whole = parser.parse(QWEN3_CODER)
    assert [(c["name"], c["arguments"]) for c in calls] == [(w.name, w.arguments) for w in whole]
    if split == 1:
        pieces = [e["function"]["arguments"] for f in per_feed for e in f if e["index"] == 0]
        assert pieces[0] == "" and len(pieces) >= 7  # name, six parameters, the closing brace


def test_qwen3_coder_through_the_chat_answer() -> None:
    """tool_choice auto: the request's tools reach the parser, so the message's arguments are
    typed, and the finish reason is tool_calls."""
    from paged_server.tools import ToolOutput

    tools = [
        {"type": "function", "function": {"name": n, "parameters": s}}
        for n, s in QWEN3_SCHEMAS.items()
    ]
    req = parse_tools({"tools": tools}, "qwen3_coder")
    assert req is not None
    msg, reason = ToolOutput(req, TOOL_PARSERS["qwen3_coder"]()).message(QWEN3_CODER, "stop")
    assert reason == "tool_calls" and msg["content"] == "I'll check both.\n"
    args = json.loads(msg["tool_calls"][0]["function"]["arguments"])
    assert args["days"] == 3 and args["hourly"] is False
    from paged_server.cli_args import parse_args

    for name in ("qwen3_coder", "qwen3_xml"):  # vLLM's launch flags
        assert parse_args(["--tool-call-parser", name]).tool_call_parser == name


def test_json_list_parsers_refuse_what_is_not_a_list_of_calls() -> None:
    for name, marker in (("granite", "<|tool_call|>"), ("phi4_mini_json", "functools")):
        p = TOOL_PARSERS[name]()
        for text in (
            f"{marker}[]",  # no call
            f'{marker}{{"name": "a", "arguments": {{}}}}',  # not a list
            f'{marker}[{{"name": "a", "arguments": {{}}}}] and more',  # trailing text
            f'{marker}[{{"name": "a", "arguments": "{{oops"}}]',  # arguments not JSON
            "import functools" if name == "phi4_mini_json" else "plain text",
        ):
            assert p.parse(text) == (text, []), (name, text)
    _, calls = TOOL_PARSERS["granite"]().parse('<tool_call>[{"name": "a", "arguments": {}}]')
    assert [c.name for c in calls] == ["a"]  # the marker spelled out, not the special token
    assert TOOL_PARSERS["granite"].keeps_special_tokens


def test_forced_outputs_cut_short_keep_what_was_announced() -> None:
    """max_tokens ended a forced output: "required" keeps the calls whose names were complete
    (the last with its partial arguments, as a stream announced them), a named call its partial
    arguments; the JSON never becomes content, whole or streamed (test_forced_calls.py)."""
    from paged_server.tools import ToolOutput, ToolRequest

    required = ToolRequest(tools=[], choice="required")
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parame'
    msg, reason = ToolOutput(required, None).message(text, "length")
    assert msg["content"] is None and reason == "length"
    assert [c["function"] for c in msg["tool_calls"]] == [
        {"name": "a", "arguments": '{"x": 1}'},
        {"name": "b", "arguments": ""},
    ]
    msg, _ = ToolOutput(required, None).message('[{"name": "a', "length")
    assert msg == {"role": "assistant", "content": None}
    named = ToolRequest(tools=[], choice="named", named="f")
    msg, reason = ToolOutput(named, None).message('{"city": "Pa', "length")
    assert msg["content"] is None and reason == "length"
    assert [c["function"] for c in msg["tool_calls"]] == [
        {"name": "f", "arguments": '{"city": "Pa'}
    ]
    out = ToolOutput(required, None)
    chunks = [out.rewrite({"index": 0, "delta": {"content": p}, "finish_reason": None}) for p in (
        '[{"name": "a", "par', 'ameters": {}}, {"na')]  # fmt: skip
    assert chunks[0] is not None and chunks[0]["delta"]["tool_calls"][0]["function"] == {
        "name": "a",
        "arguments": "",
    }
    assert chunks[1] is not None and chunks[1]["delta"]["tool_calls"] == [
        {"index": 0, "function": {"arguments": "{}"}}
    ]
    last = out.rewrite({"index": 0, "delta": {"content": "me"}, "finish_reason": "length"})
    assert last == {"index": 0, "delta": {}, "finish_reason": "length"}
