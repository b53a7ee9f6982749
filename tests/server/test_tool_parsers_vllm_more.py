"""vLLM's tool-call parsers for Seed-OSS, MiniMax-M2, Hunyuan-A13B, Jamba, InternLM, Olmo 3 and
xLAM (and the names ernie45, llama4_pythonic, llama4_json): whole outputs, streamed at every
2-way split and in other chunkings, typed parameters, malformed output, then one request through
the in-process server."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import Any

import pytest
from fake_engine import ScriptedEngine
from server_proc import chat_stream, serve_in_process
from test_tool_parsers_more import accumulate, assert_stays_content, stream

from paged_server.tool_parsers import TOOL_PARSERS, ToolParser
from paged_server.tool_parsers.minimax_m2 import minimax_value, schema_types
from paged_server.tool_parsers.seed_oss import seed_value
from paged_server.tools import ToolOutput, parse_tools

NOTE = 'say "hi" {ok} }'  # braces and quotes inside a string
FORECAST = {
    "city": "1984",  # looks like a number; the schema says string
    "days": 3,
    "ratio": 2.5,
    "hourly": False,
    "units": {"temp": "C", "wind": [1, "}"]},
    "tags": ["a", "b"],
    "note": NOTE,
}
SCHEMAS = {
    "forecast": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "ratio": {"type": "number"},
            "hourly": {"type": "boolean"},
            "units": {"type": "object"},
            "tags": {"type": "array"},
            "note": {"type": "string"},
        },
    },
    "clock": {"type": "object", "properties": {"tz": {"type": "string"}}},
}
WANT = [("forecast", FORECAST), ("clock", {"tz": "utc"})]
CONTENT = "Let me check."


def _text(value: Any) -> str:
    """A value as an XML format writes it: strings bare, the rest as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def _seed(name: str, args: dict) -> str:
    params = "".join(f"<parameter={k}>\n{_text(v)}\n</parameter>\n" for k, v in args.items())
    return f"<seed:tool_call>\n<function={name}>\n{params}</function>\n</seed:tool_call>"


def _minimax(calls: list[tuple[str, dict]]) -> str:
    out = "<minimax:tool_call>\n"
    for name, args in calls:
        params = "".join(f'<parameter name="{k}">{_text(v)}</parameter>\n' for k, v in args.items())
        out += f'<invoke name="{name}">\n{params}</invoke>\n'
    return out + "</minimax:tool_call>"


def _json_calls(calls: list[tuple[str, dict]], key: str = "arguments") -> list[str]:
    return [json.dumps({"name": n, key: a}, ensure_ascii=False) for n, a in calls]


def _olmo_line(name: str, args: dict) -> str:
    return f"{name}({', '.join(f'{k}={json.dumps(v)}' for k, v in args.items())})"


ACTION, ACTION_END = "<|action_start|><|plugin|>", "<|action_end|>"

# parser -> model text: the content, then the two calls
CASES = {
    "seed_oss": f"{CONTENT}\n{_seed(*WANT[0])}\n{_seed(*WANT[1])}",
    "minimax_m2": f"{CONTENT}\n{_minimax(WANT)}",
    "hunyuan_a13b": f"{CONTENT}\n<tool_calls>[{', '.join(_json_calls(WANT))}]</tool_calls>",
    "jamba": f"{CONTENT} <tool_calls>[\n" + ",\n".join(_json_calls(WANT)) + "\n]</tool_calls>",
    "internlm": "".join(
        [CONTENT] + [f"{ACTION}\n{c}{ACTION_END}\n" for c in _json_calls(WANT, "parameters")]
    ).rstrip(),
    "olmo3": f"{CONTENT}\n<function_calls>\n"
    + "\n".join(_olmo_line(n, a) for n, a in WANT)
    + "\n</function_calls>",
    "xlam": f"{CONTENT}\n```json\n[{', '.join(_json_calls(WANT))}]\n```",
}
# text a model may write after its calls: dropped, whole and streamed (content where the
# parser keeps the text around its blocks: KEEPS_AFTER)
AFTER = {
    "seed_oss": "\nDone.",
    "minimax_m2": "\nDone.",
    "hunyuan_a13b": "\nDone.",
    "jamba": " Done.",
    "internlm": "\nDone.",
    "olmo3": "\nDone.",
    "xlam": "\nDone.",
}
NEW = sorted(CASES)
KEEPS_AFTER = {"seed_oss", "minimax_m2"}  # vLLM's engine parsers keep it as content


def _after(name: str) -> str:
    """What of AFTER[name] is content."""
    return AFTER[name] if name in KEEPS_AFTER else ""


# the content of CASES[name]: the text before the calls as written (vLLM: not stripped)
LEAD = {n: CONTENT + {"jamba": " ", "internlm": ""}.get(n, "\n") for n in CASES}
MARKERS = re.compile(
    r"(<\|[a-z_]+\|>|</?(?:seed:tool_call|minimax:tool_call|tool_calls|function_calls|"
    r"function|invoke|parameter)\b[^>]*>|```(?:json)?)"
)


def make(name: str) -> ToolParser:
    parser = TOOL_PARSERS[name]()
    parser.schemas = SCHEMAS
    return parser


def chunkings(text: str) -> list[list[str]]:
    """One piece; one character at a time; 3 and 7 characters; the markers whole (as a
    tokenizer emits special tokens) with the text between them in 2-character pieces."""
    out = [[text], list(text)]
    out += [[text[i : i + n] for i in range(0, len(text), n)] for n in (3, 7)]
    tokens: list[str] = []
    for part in MARKERS.split(text):
        whole = MARKERS.fullmatch(part)
        tokens += [part] if whole else [part[i : i + 2] for i in range(0, len(part), 2)]
    return [*out, [t for t in tokens if t]]


def assert_streams_like_whole(name: str, text: str, want_content: str | None) -> None:
    """Every 2-way split and each chunking: the content shown is the non-streamed content,
    the accumulated calls and the finish's calls are the non-streamed calls."""
    content, whole = make(name).parse(text)
    assert content == want_content
    want = [(c.name, json.loads(c.arguments)) for c in whole]
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for pieces in splits + chunkings(text):
        shown, per_feed, calls = stream(make(name), pieces)
        assert shown == (content or ""), pieces
        got = accumulate(per_feed)
        assert [(c["name"], json.loads(c["arguments"])) for c in got] == want, pieces
        assert [(c.name, c.arguments) for c in calls] == [(w.name, w.arguments) for w in whole]


@pytest.mark.parametrize("name", NEW)
def test_whole_output(name: str) -> None:
    text = CASES[name]
    content, calls = make(name).parse(text)
    assert content == LEAD[name]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == WANT
    # no content; one call; text after the calls dropped (or content: KEEPS_AFTER)
    bare = text[len(LEAD[name]) :]
    assert make(name).parse(bare) == (None, calls)
    assert make(name).parse(text + AFTER[name]) == (LEAD[name] + _after(name), calls)
    plain = "No tools needed: 2 < 3, [x] and {y}."
    assert make(name).parse(plain) == (plain, [])


ONE = {
    "seed_oss": _seed("clock", {"tz": "utc"}),
    "minimax_m2": _minimax([("clock", {"tz": "utc"})]),
    "hunyuan_a13b": '<tool_calls>[{"name": "clock", "arguments": {"tz": "utc"}}]</tool_calls>',
    "jamba": '<tool_calls>[{"name": "clock", "arguments": {"tz": "utc"}}]</tool_calls>',
    "internlm": f'{ACTION}{{"name": "clock", "parameters": {{"tz": "utc"}}}}{ACTION_END}',
    "olmo3": '<function_calls>\nclock(tz="utc")\n</function_calls>',
    "xlam": '```json\n[{"name": "clock", "arguments": {"tz": "utc"}}]\n```',
}


@pytest.mark.parametrize("name", NEW)
def test_one_call(name: str) -> None:
    for text in (ONE[name], "Sure. " + ONE[name]):
        content, calls = make(name).parse(text)
        assert content == ("Sure. " if text.startswith("Sure") else None)
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("clock", {"tz": "utc"})]


@pytest.mark.parametrize("name", NEW)
def test_streamed_at_every_split_and_in_pieces(name: str) -> None:
    assert_streams_like_whole(name, CASES[name] + AFTER[name], LEAD[name] + _after(name))
    # one character at a time: the first call is announced before the output ends
    _, per_feed, _ = stream(make(name), list(CASES[name]))
    announced = [k for k, entries in enumerate(per_feed) for e in entries if "id" in e]
    assert len(announced) == 2 and announced[0] < len(CASES[name]) - 20


@pytest.mark.parametrize("name", ["seed_oss", "minimax_m2"])
def test_xml_arguments_stream_as_prefixes_of_the_final_json(name: str) -> None:
    """Arguments are built a whole parameter at a time: each piece extends a prefix of the
    non-streamed arguments, and the pieces join to them exactly."""
    text = CASES[name]
    _, whole = make(name).parse(text)
    _, per_feed, _ = stream(make(name), list(text))
    got = accumulate(per_feed)
    assert [c["arguments"] for c in got] == [w.arguments for w in whole]
    pieces = [e for entries in per_feed for e in entries if e["index"] == 0]
    assert len(pieces) >= len(FORECAST)


@pytest.mark.parametrize("name", NEW)
def test_text_that_only_looks_like_a_marker_streams_as_content(name: str) -> None:
    text = "a <seed:tool b <minimax c <tool_call d <|action_start|> e <function f"
    for pieces in ([text], list(text)):
        shown, per_feed, calls = stream(make(name), pieces)
        assert shown == text and calls == [] and accumulate(per_feed) == []


MALFORMED = {
    "seed_oss": [
        "<seed:tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n",  # cut short
        "<seed:tool_call><function=f><parameter=a>1",  # cut inside a parameter
        "<seed:tool_call><function=two words></function></seed:tool_call>",
        "<seed:tool_call><function=></function></seed:tool_call>",  # no name
        "<seed:tool_call><function=f><parameter=a>1</function></parameter></seed:tool_call>",
        "<seed:tool_call>",
    ],
    "minimax_m2": [
        '<minimax:tool_call><invoke name="f"></invoke>',  # the block left open
        '<minimax:tool_call><invoke name="f"><parameter name="a">1</parameter>'
        "</minimax:tool_call>",  # the invoke left open
        "<minimax:tool_call>no invoke here</minimax:tool_call>",
        '<minimax:tool_call><invoke name="f"><parameter name="a">1</invoke></minimax:tool_call>',
        '<minimax:tool_call><invoke name="a b"></invoke></minimax:tool_call>',
        "<minimax:tool_call>",
    ],
    "hunyuan_a13b": [
        '<tool_calls>[{"name": "f", "arguments": {}}]',  # not closed
        "<tool_calls>[{bad json}]</tool_calls>",
        '<tool_calls>{"name": "f", "arguments": {}}</tool_calls>',  # not a list
        "<tool_calls>[]</tool_calls>",
        '<tool_calls>[{"name": "f", "arguments": {}}, 7]</tool_calls>',
        '<tool_calls>[{"arguments": {}}]</tool_calls>',  # no name
        "<tool_calls>",
    ],
    "internlm": [
        f'{ACTION}{{"name": "f", "parameters": {{"a": 1}}',  # cut short
        f"{ACTION}{{bad}}{ACTION_END}",
        f'{ACTION}f {{"name": "f", "parameters": {{}}}}{ACTION_END}',  # text before the object
        f'{ACTION}{{"name": "f", "parameters": {{}}}} extra{ACTION_END}',
        f'{ACTION}{{"parameters": {{}}}}{ACTION_END}',  # no name
        f'{ACTION}{{"name": "f", "parameters": "not json"}}{ACTION_END}',
        "<|action_start|><|interpreter|>print(1)<|action_end|>",  # code to run: content
        ACTION,
    ],
    "olmo3": [
        "<function_calls>\nf(a=1)\n",  # not closed
        "<function_calls>\nf(a=1)\nthen some prose\n</function_calls>",
        "<function_calls>\nf(1)\n</function_calls>",  # a positional argument
        "<function_calls>\nf(a=b)\n</function_calls>",  # not a literal
        "<function_calls>\nf(a=1,\nb=2)\n</function_calls>",  # a call over two lines
        "<function_calls>\n</function_calls>",
        "f(a=1) is how you would call it.",
        "g(",
    ],
    "xlam": [
        '```json\n[{"name": "f", "arguments": {}}]\n',  # the fence left open
        '```json\n{"name": "f", "arguments": {}}\n```',  # not a list
        "```json\n[1, 2]\n```",
        "```python\nprint([1])\n```",
        '[{"name": "f", "arguments": {}}] and then prose',
        '<tool_call>[{"name": "f", "arguments": {}}]',
        '[TOOL_CALLS]\n[{"name": "f", "arguments": {}}]',  # the list must be on its line
        "[1] a citation",
    ],
}
MALFORMED["jamba"] = MALFORMED["hunyuan_a13b"]


@pytest.mark.parametrize("name", NEW)
def test_malformed_output_stays_content(name: str) -> None:
    """Not well-formed calls: the whole text is the content, whole or streamed (a call whose
    name was streamed stays announced, as with the other parsers)."""
    assert_stays_content(lambda: make(name), MALFORMED[name])


def _seed_bare(name: str, args: dict) -> str:
    return _seed(name, args).removeprefix("<seed:tool_call>\n").removesuffix("\n</seed:tool_call>")


@pytest.mark.parametrize(
    ("name", "text", "content"),
    [
        # vLLM's engine parsers keep the text outside the blocks, streamed and whole
        ("seed_oss", f"Hi.{_seed(*WANT[0])}\nNow the clock:\n{_seed(*WANT[1])} Bye.", None),
        ("seed_oss", f"{_seed(*WANT[0])}\n \n{_seed(*WANT[1])}\nok", "\nok"),
        ("seed_oss", f"{_seed_bare(*WANT[0])} and {_seed_bare(*WANT[1])}", " and "),
        # an open block reaches to the end: the text after its calls is in it
        ("seed_oss", f"Hi.{_seed(*WANT[0])} then {_seed(*WANT[1])[:-18]}\nin it", "Hi. then "),
        ("minimax_m2", f"Hi.{_minimax(WANT[:1])}\nNow the clock:\n{_minimax(WANT[1:])}!", None),
        ("minimax_m2", f"{_minimax(WANT[:1])}\n\n{_minimax(WANT[1:])}\n\nok", "\n\nok"),
    ],
)
def test_xml_text_between_and_after_the_blocks(name: str, text: str, content: str) -> None:
    if content is None:  # the text outside the blocks
        blocks = r"<(seed|minimax):tool_call>.*?</\1:tool_call>"
        content = "".join(re.split(blocks, text, flags=re.DOTALL)[::2])
    assert_streams_like_whole(name, text, content)
    assert [(c.name, json.loads(c.arguments)) for c in make(name).parse(text)[1]] == WANT


@pytest.mark.parametrize("name", ["seed_oss", "minimax_m2"])
def test_xml_a_block_that_cannot_be_read_ends_the_calls(name: str) -> None:
    """The calls before it stay calls (vLLM keeps the blocks it reads); it and the text after
    it are content, whole and streamed."""
    first = _seed(*WANT[0]) if name == "seed_oss" else _minimax(WANT[:1])
    for bad in (
        "<seed:tool_call><function=two words></function></seed:tool_call> more",
        "<seed:tool_call><function=f><parameter=a>1",  # cut short by max_tokens
        '<minimax:tool_call><invoke name="g">',  # a second block cut short
        "<minimax:tool_call>no invoke here</minimax:tool_call> more",
    ):
        if not bad.startswith(first[:5]):
            continue
        text = f"Hi.{first}\nNext: {bad}"
        got, calls = make(name).parse(text)
        assert got == "Hi.\nNext: " + bad
        assert [c.name for c in calls] == ["forecast"]
        for pieces in chunkings(text):  # (a call whose name was streamed stays announced)
            shown, per_feed, _ = stream(make(name), pieces)
            assert shown == got and accumulate(per_feed)[0]["name"] == "forecast", pieces


# ---- values typed by the tool schemas -----------------------------------------------------


@pytest.mark.parametrize(
    ("text", "schema", "want"),
    [
        ("3", {"type": "integer"}, 3),
        ("3", {"type": "string"}, "3"),  # the schema says string: the text as written
        (" padded ", {"type": "string"}, " padded "),
        ("3", None, "3"),  # not in the schema: text
        ("3", {"description": "no type"}, "3"),
        ("null", {"type": "string"}, None),  # null whatever the type, as vLLM reads it
        ("NULL", None, None),
        ("2.5", {"type": "number"}, 2.5),
        ("2.0", {"type": "number"}, 2),  # whole numbers are written as integers
        ("1e3", {"type": "float"}, 1000),
        ("inf", {"type": "number"}, "inf"),  # no JSON form: text
        ("x", {"type": "integer"}, "x"),
        ("7", {"type": "int64"}, 7),
        ("True", {"type": "boolean"}, True),
        ("yes", {"type": "boolean"}, False),  # vLLM: anything but true is false
        ("enum-ish", {"type": "enum"}, "enum-ish"),
        ('{"a": [1, true]}', {"type": "object"}, {"a": [1, True]}),
        ("{'a': (1, 2)}", {"type": "object"}, {"a": [1, 2]}),  # a Python literal
        ("[1, true, null]", {"type": "array"}, [1, True, None]),  # JSON first
        ("{1, 2}", {"type": "array"}, "{1, 2}"),  # a set: text
        ("[1, 2", {"type": "array"}, "[1, 2"),
        ("3", {"type": ["integer", "null"]}, 3),  # a list of types: a Python literal
        ("Paris", {"type": ["string", "null"]}, "Paris"),
    ],
)
def test_seed_oss_value_types(text: str, schema: Any, want: Any) -> None:
    assert seed_value(text, schema) == want
    assert type(seed_value(text, schema)) is type(want)


@pytest.mark.parametrize(
    ("text", "schema", "want"),
    [
        ("3", {"type": "integer"}, 3),
        (" 3\n", {"type": "integer"}, 3),  # values are stripped
        ("3", {"type": "string"}, "3"),
        ("3", None, "3"),  # not in the schema: a string
        ("nil", {"type": "integer"}, None),
        ("None", {"type": "string"}, None),
        ("2.5", {"type": "number"}, 2.5),
        ("4.0", {"type": "number"}, 4),
        ("NaN", {"type": "number"}, "NaN"),  # no JSON form: text
        ("on", {"type": "boolean"}, True),
        ("0", {"type": "boolean"}, False),
        ("maybe", {"type": "boolean"}, "maybe"),  # falls back to JSON, then text
        ('{"a": 1}', {"type": "object"}, {"a": 1}),
        ("[1, 2]", {"type": "array"}, [1, 2]),
        ("{'a': 1}", {"type": "object"}, "{'a': 1}"),  # JSON only
        ("12", {"type": ["string", "integer"]}, 12),  # integer is tried before string
        ("abc", {"type": ["integer", "string"]}, "abc"),
        ("12", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, 12),
        ("2", {"enum": [1, 2, 3]}, 2),  # the enum values' type
        ("a", {"enum": ["a", "b"]}, "a"),
        ("7", {"type": "null"}, 7),  # no type it reads as: JSON
        ("x y", {"type": "null"}, "x y"),
    ],
)
def test_minimax_m2_value_types(text: str, schema: Any, want: Any) -> None:
    assert minimax_value(text, schema) == want
    assert type(minimax_value(text, schema)) is type(want)


def test_minimax_m2_schema_types() -> None:
    assert schema_types(None) == {"string"}
    assert schema_types({}) == {"string"}
    assert schema_types({"type": ["Integer", "null"]}) == {"integer", "null"}
    nested = {"oneOf": [{"type": "number"}, {"allOf": [{"enum": [True, None, {"a": 1}]}]}]}
    assert schema_types(nested) == {"number", "boolean", "null", "object"}


def test_typed_calls_in_the_xml_formats() -> None:
    seed = _seed("forecast", {"city": "007", "days": " 3 ", "extra": "4", "units": "null"})
    _, (call,) = make("seed_oss").parse(seed)
    assert json.loads(call.arguments) == {"city": "007", "days": 3, "extra": "4", "units": None}
    # MiniMax: quoted or unquoted names and keys, several invocations in one block, none of
    # them with parameters; no schema for the tool: strings
    text = (
        "<minimax:tool_call><invoke name=forecast><parameter name='days'> 5 </parameter>"
        '</invoke><invoke name="unknown"><parameter name="n">5</parameter></invoke>'
        "<invoke name='clock'></invoke></minimax:tool_call>"
    )
    content, calls = make("minimax_m2").parse(text)
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [
        ("forecast", '{"days": 5}'),
        ("unknown", '{"n": "5"}'),
        ("clock", "{}"),
    ]
    # Seed-OSS: the block tags are optional, and so is its closing tag
    _, calls = make("seed_oss").parse("Ok <function=clock>\n</function>")
    assert [(c.name, c.arguments) for c in calls] == [("clock", "{}")]
    _, calls = make("seed_oss").parse("<seed:tool_call><function=clock></function>")
    assert [c.name for c in calls] == ["clock"]


def test_typed_values_through_the_chat_answer() -> None:
    """The request's tool schemas type the values (ToolOutput hands them to the parser)."""
    tools = [
        {"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()
    ]
    for name in ("seed_oss", "minimax_m2"):
        req = parse_tools({"tools": tools}, name)
        msg, reason = ToolOutput(req, TOOL_PARSERS[name]()).message(CASES[name], "stop")
        assert reason == "tool_calls" and msg["content"] == LEAD[name]
        args = [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]]
        assert args == [a for _, a in WANT]
        # without the schemas the values are strings (both parsers' default)
        _, (call, _) = TOOL_PARSERS[name]().parse(CASES[name])
        assert json.loads(call.arguments)["days"] == "3"


# ---- format details -----------------------------------------------------------------------


def test_tool_calls_blocks_in_detail() -> None:
    # arguments as JSON text; several blocks in order; whitespace around the list
    text = (
        'Hi <tool_calls> [{"name": "f", "arguments": "{\\"a\\": 1}"}] </tool_calls>\n'
        '<tool_calls>[{"name": "g", "arguments": {}}]</tool_calls>'
    )
    for name in ("hunyuan_a13b", "jamba"):
        content, calls = make(name).parse(text)
        assert content == "Hi "
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}), ("g", {})]
        assert_streams_like_whole(name, text, "Hi ")
    assert TOOL_PARSERS["jamba"].keeps_special_tokens
    assert not TOOL_PARSERS["hunyuan_a13b"].keeps_special_tokens


def test_internlm_in_detail() -> None:
    # "arguments" also names the arguments; no closing token (max_tokens after the object)
    text = f'Sure{ACTION}\n{{"name": "f", "arguments": {{"a": [1]}}}}'
    content, (call,) = make("internlm").parse(text)
    assert content == "Sure" and (call.name, json.loads(call.arguments)) == ("f", {"a": [1]})
    assert_streams_like_whole("internlm", text, "Sure")
    # a call with no arguments at all
    _, (call,) = make("internlm").parse(f'{ACTION}{{"name": "f"}}{ACTION_END}')
    assert call.arguments == "{}"
    assert TOOL_PARSERS["internlm"].keeps_special_tokens


def test_olmo3_in_detail() -> None:
    # bare lines (the tags skipped as special tokens): the whole output is the calls; several
    # calls on a line; Python and JSON literals; negative numbers
    text = 'forecast(city="Oslo", days=-2, hourly=True)\n\nclock(tz=None), clock(tz=null)\n'
    content, calls = make("olmo3").parse(text)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("forecast", {"city": "Oslo", "days": -2, "hourly": True}),
        ("clock", {"tz": None}),
        ("clock", {"tz": None}),
    ]
    assert_streams_like_whole("olmo3", text, None)
    assert_streams_like_whole("olmo3", "Hmm.\n" + text, "Hmm.\n" + text)  # prose first: content
    # content opening with a word is held back only until the word ends
    s = make("olmo3").streamer()
    assert s.feed("Sure") == ("", [])
    assert s.feed(", I") == ("Sure, I", [])


def test_xlam_in_detail() -> None:
    call = '[{"name": "clock", "arguments": {"tz": "utc"}}]'
    cases = [
        (call, None),  # the whole answer
        (f"<think>plan [a]</think>\n{call}", "<think>plan [a]</think>\n"),  # after the thinking
        (f"Ok\n```\n{call}\n```", "Ok\n"),  # a bare fence
        (f"Ok [TOOL_CALLS] {call}\nrest", "Ok "),
        (f"Ok <tool_call>{call}</tool_call>", "Ok "),
        # a block that is not calls comes first: it is content, sent when the output ends
        (f"See:\n```python\nprint(1)\n```\nNow:\n```json\n{call}\n```", None),
    ]
    for text, content in cases:
        if content is None and text.startswith("See"):
            content = text[: text.index("```json")]
        got, calls = make("xlam").parse(text)
        assert got == content, text
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("clock", {"tz": "utc"})]
        assert_streams_like_whole("xlam", text, content)


def test_aliases_are_vllms_names() -> None:
    assert issubclass(TOOL_PARSERS["ernie45"], TOOL_PARSERS["hermes"])  # newlines trimmed
    assert TOOL_PARSERS["llama4_pythonic"] is TOOL_PARSERS["pythonic"]
    assert TOOL_PARSERS["llama4_json"] is TOOL_PARSERS["llama3_json"]
    # ERNIE 4.5's output (its reasoning parser takes the thinking)
    text = '\n\n<tool_call>\n{"name": "clock", "arguments": {"tz": "utc"}}\n</tool_call>\n'
    assert [c.name for c in make("ernie45").parse(text)[1]] == ["clock"]
    text = '<|python_start|>[clock(tz="utc")]<|python_end|>'
    assert [c.name for c in make("llama4_pythonic").parse(text)[1]] == ["clock"]
    text = '{"name": "clock", "parameters": {"tz": "utc"}}'
    assert [c.name for c in make("llama4_json").parse(text)[1]] == ["clock"]


def test_cli_accepts_the_names() -> None:
    from paged_server.cli_args import parse_args

    for name in [*NEW, "ernie45", "llama4_pythonic", "llama4_json"]:
        assert parse_args(["--tool-call-parser", name]).tool_call_parser == name


# ---- through the server ------------------------------------------------------------------


def test_internlm_end_to_end() -> None:
    """--tool-call-parser internlm over a scripted model: content and the calls, whole and
    streamed; special tokens kept for the request."""
    engine = ScriptedEngine(max_model_len=512, step_time=0.0002)
    args = ["--max-model-len", "512", "--served-model-name", "tiny", "--client-timeout", "3"]
    args += ["--tool-call-parser", "internlm"]
    script = CASES["internlm"]
    tools = [
        {"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()
    ]
    with serve_in_process(args, engine) as (http, _):
        engine.script = script
        body = {"messages": [{"role": "user", "content": "Hi"}], "tools": tools}
        status, _, payload = http.request("POST", "/v1/chat/completions", body)
        assert status == 200, payload
        choice = payload["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == CONTENT
        calls = choice["message"]["tool_calls"]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == (
            WANT
        )
        assert engine.params[payload["id"] + "-0"].skip_special_tokens is False
        s = chat_stream(SimpleNamespace(http=http, engine=engine), script, tools=tools)
        assert s["finish"] == "tool_calls" and s["content"].strip() == CONTENT
        assert [json.loads(c["arguments"]) for c in s["calls"].values()] == [a for _, a in WANT]
