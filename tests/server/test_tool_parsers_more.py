"""The DeepSeek-V3 / V3.1, Kimi K2 and GLM-4.5 tool-call parsers (vLLM's deepseek_v3,
deepseek_v31, kimi_k2, glm45), the glm45 / kimi_k2 reasoning names: whole outputs, streamed in
every chunking, malformed output, then one request through the in-process server."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from fake_engine import ScriptedEngine
from server_proc import chat_stream, serve_in_process

from paged_server.reasoning import ThinkSplitter, split_reasoning
from paged_server.tool_parsers import TOOL_PARSERS, ToolParser
from paged_server.tool_parsers.glm45 import glm_value
from paged_server.tool_parsers.streaming import StreamingToolText
from paged_server.tools import ToolOutput, parse_tools

TB, CB, SEP, CE, TE = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
)
KS, KC, KA, KE, KZ = (
    "<|tool_calls_section_begin|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|tool_calls_section_end|>",
)
NOTE = 'say "hi" {ok} }'  # braces and quotes inside a JSON string
FORECAST = {"city": "São Paulo", "days": 3, "note": NOTE}
FORECAST_JSON = json.dumps(FORECAST, ensure_ascii=False)
SCHEMAS = {
    "forecast": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "note": {"type": "string"},
        },
    },
    "clock": {"type": "object", "properties": {}},
}

# parser -> (model text with content then two calls, the content)
CASES = {
    "deepseek_v3": (
        f"Let me check.{TB}{CB}function{SEP}forecast\n```json\n{FORECAST_JSON}\n```{CE}\n"
        f'{CB}function{SEP}clock\n```json\n{{"tz": "utc"}}\n```{CE}{TE}',
        "Let me check.",
    ),
    "deepseek_v31": (
        f"Let me check.{TB}{CB}forecast{SEP}{FORECAST_JSON}{CE}"
        f'{CB}clock{SEP}{{"tz": "utc"}}{CE}{TE}',
        "Let me check.",
    ),
    "kimi_k2": (
        f"Let me check.{KS}{KC}functions.forecast:0{KA}{FORECAST_JSON}{KE}"
        f'{KC}functions.clock:1{KA}{{"tz": "utc"}}{KE}{KZ}',
        "Let me check.",
    ),
    "glm45": (
        "Let me check.\n<tool_call>forecast\n<arg_key>city</arg_key>\n<arg_value>São Paulo"
        "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>note"
        f"</arg_key>\n<arg_value>{NOTE}</arg_value>\n</tool_call>\n<tool_call>clock\n"
        "<arg_key>tz</arg_key>\n<arg_value>utc</arg_value>\n</tool_call>",
        "Let me check.\n",  # the content as written, not stripped
    ),
}
WANT = [("forecast", FORECAST), ("clock", {"tz": "utc"})]
MARKERS = re.compile(r"(<｜[^｜]*｜>|<\|[a-z_]+\|>|</?(?:tool_call|arg_key|arg_value)>)")


def make(name: str) -> ToolParser:
    parser = TOOL_PARSERS[name]()
    parser.schemas = SCHEMAS
    return parser


def stream(parser: ToolParser, pieces: list[str]) -> tuple[str, list[list[dict]], list]:
    """(content shown, tool_calls entries per feed and the finish's, the finish's calls)."""
    s = parser.streamer()
    shown, per_feed = "", []
    for piece in pieces:
        out, entries = s.feed(piece)
        shown += out
        per_feed.append(entries)
    rest, entries, calls = s.finish()
    per_feed.append(entries)
    return shown + rest, per_feed, calls


def accumulate(per_feed: list[list[dict]]) -> list[dict]:
    """delta.tool_calls merged by index, as OpenAI clients do; id and name come once, first."""
    calls: dict[int, dict] = {}
    for entries in per_feed:
        for e in entries:
            c = calls.setdefault(e["index"], {"id": None, "name": None, "arguments": ""})
            assert ("id" in e) == (c["id"] is None)
            if "id" in e:
                assert e["type"] == "function" and e["function"]["name"]
                c["id"], c["name"] = e["id"], e["function"]["name"]
            c["arguments"] += e["function"].get("arguments", "")
    return [calls[k] for k in sorted(calls)]


def chunkings(text: str) -> list[list[str]]:
    """One piece; one character at a time; 2, 3 and 7 characters; the special tokens whole
    (as a tokenizer emits them) with the text between them in 3-character pieces."""
    out = [[text], list(text)]
    out += [[text[i : i + n] for i in range(0, len(text), n)] for n in (2, 3, 7)]
    tokens: list[str] = []
    for part in MARKERS.split(text):
        tokens += (
            [part] if MARKERS.fullmatch(part) else [part[i : i + 3] for i in range(0, len(part), 3)]
        )
    return [*out, [t for t in tokens if t]]


@pytest.mark.parametrize("name", sorted(CASES))
def test_whole_output(name: str) -> None:
    text, content = CASES[name]
    got, calls = make(name).parse(text)
    assert got == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == WANT
    plain = "No tools needed: 2 < 3 and {x}."
    assert make(name).parse(plain) == (plain, [])
    _, calls = make(name).parse(text[text.index(content) + len(content) :])  # no content
    assert len(calls) == 2 and make(name).parse(text[len(content) :])[0] is None
    assert TOOL_PARSERS[name].keeps_special_tokens


@pytest.mark.parametrize("name", sorted(CASES))
def test_streamed_in_every_chunking(name: str) -> None:
    """Content streams up to the first marker; each call is announced by name, then its
    arguments follow piece by piece; accumulated they equal the non-streamed calls."""
    text, content = CASES[name]
    _, whole = make(name).parse(text)
    for pieces in chunkings(text):
        shown, per_feed, calls = stream(make(name), pieces)
        assert shown == content, pieces
        got = accumulate(per_feed)
        assert [(c["name"], json.loads(c["arguments"])) for c in got] == WANT, pieces
        assert [(c.name, c.arguments) for c in calls] == [(w.name, w.arguments) for w in whole]
    # two pieces, cut anywhere
    for i in range(len(text) + 1):
        shown, per_feed, _ = stream(make(name), [text[:i], text[i:]])
        assert shown == content, i
        assert [json.loads(c["arguments"]) for c in accumulate(per_feed)] == [w for _, w in WANT]
    # one character at a time: the name goes out first, the arguments over many chunks
    _, per_feed, _ = stream(make(name), list(text))
    first = [e for entries in per_feed for e in entries if e["index"] == 0]
    assert first[0]["function"]["name"] == "forecast" and len(first) >= 4
    assert first[0]["function"]["arguments"] != accumulate(per_feed)[0]["arguments"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_text_that_only_looks_like_a_marker_streams_as_content(name: str) -> None:
    text = "a <｜tool b <|tool_call c <tool d <tool_cal"
    for pieces in ([text], list(text)):
        shown, per_feed, calls = stream(make(name), pieces)
        assert shown == text and calls == [] and accumulate(per_feed) == []
    # the tail that may start a marker waits for the next piece
    s = StreamingToolText(make(name))
    marker = TOOL_PARSERS[name].start_markers[0]
    assert s.feed("Hi " + marker[:5]) == ("Hi ", [])


MALFORMED = {
    "deepseek_v3": [
        f"{TB}{CB}function{SEP}f\n```json\n{{bad json}}\n```{CE}{TE}",
        f"{TB}{CB}function{SEP}f\n```json\n[1, 2]\n```{CE}{TE}",  # not an object
        f"{TB}{CB}function{SEP}f\n```python\n{{}}\n```{CE}{TE}",  # not a json fence
        f"{TB}{CB}function{SEP}\n```json\n{{}}\n```{CE}{TE}",  # no name
        f"{TB}{CB}f\n```json\n{{}}\n```{CE}{TE}",  # no separator
        f'{TB}{CB}function{SEP}f\n```json\n{{"a": 1',  # cut short by max_tokens
        f"Sure.{TB}",
    ],
    "deepseek_v31": [
        f"{TB}{CB}f{SEP}{{bad}}{CE}{TE}",
        f'{TB}{CB}f{SEP}"text"{CE}{TE}',
        f"{TB}{CB}two words{SEP}{{}}{CE}{TE}",
        f"{TB}{CB}f{SEP}x {{}}{CE}{TE}",  # text before the arguments
        f'{TB}{CB}f{SEP}{{"a": [1, 2}}{CE}{TE}',
        f"{TB}{CB}f",
    ],
    "kimi_k2": [
        f"{KS}{KC}functions.f:0{KA}{{broken{KE}{KZ}",
        f"{KS}{KC}functions.f:0{KA}[]{KE}{KZ}",
        f"{KS}{KC}functions.f:0{KE}{KC}functions.g:1{KA}{{}}{KE}{KZ}",  # no arguments marker
        f'{KS}{KC}functions.f:0{KA}{{"a": "b',
        f"{KS}{KC}",
    ],
    "glm45": [
        "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n",  # cut short
        "<tool_call>f\n<arg_key>a</arg_key>\n</tool_call>",  # a key without a value
        "<tool_call>f\n<arg_key>a</arg_key>junk<arg_value>1</arg_value>\n</tool_call>",
        "<tool_call>f\nstray text\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>',  # Hermes JSON, not GLM
        "<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",  # no name
        "<tool_call>",
    ],
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_output_stays_content(name: str) -> None:
    """Not well-formed calls: the whole text is the content, whole or streamed (a call whose
    name was streamed stays announced, as with the other parsers)."""
    assert_stays_content(lambda: make(name), MALFORMED[name])


def assert_stays_content(parser: Callable[[], ToolParser], texts: list[str]) -> None:
    """Each text (and with content before it) is all content and no call, whole and streamed
    whole or a character at a time; `parser()` makes a fresh parser."""
    for text in texts:
        for bad in (text, "Before. " + text):
            assert parser().parse(bad) == (bad, []), bad
            for pieces in ([bad], list(bad)):
                shown, _, calls = stream(parser(), pieces)
                assert shown == bad and calls == [], bad


def test_deepseek_formats_in_detail() -> None:
    # pretty-printed arguments inside the fence; calls separated by a newline or not at all
    v3 = (
        f'{TB}{CB}function{SEP}f\n```json\n{{\n  "a": {{"b": [1, "}}"]}}\n}}\n```{CE}'
        f"{CB}function{SEP}g\n```json\n{{}}\n```{CE}{TE}"
    )
    content, calls = make("deepseek_v3").parse(v3)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("f", {"a": {"b": [1, "}"]}}),
        ("g", {}),
    ]
    # a call begin without the block's opening token still counts; a call cut after its
    # arguments (no closing token, max_tokens) keeps them
    _, calls = make("deepseek_v31").parse(f'Ok {CB}f{SEP}{{"x": 1}}')
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"x": 1}')]
    # V3.1 text read as V3 and the reverse: not calls
    v31 = CASES["deepseek_v31"][0]
    assert make("deepseek_v3").parse(v31) == (v31, [])
    assert make("deepseek_v31").parse(CASES["deepseek_v3"][0])[1] == []


def test_kimi_ids_spaces_and_variants() -> None:
    # a slow tokenizer's spaces around special tokens; the singular section marker; an id
    # without the functions. prefix
    text = (
        f"Hi <|tool_call_section_begin|> {KC} functions.get_weather:0 {KA} "
        f'{{"city": "Paris"}} {KE} {KC} clock:1 {KA} {{}} {KE} <|tool_call_section_end|>'
    )
    parser = make("kimi_k2")
    content, calls = parser.parse(text)
    assert content == "Hi " and [c.name for c in calls] == ["get_weather", "clock"]
    assert [parser.new_call_id() for _ in range(3)][:2] == ["functions.get_weather:0", "clock:1"]
    assert parser.new_call_id().startswith("call_")  # past the model's calls: OpenAI-style


def _kimi_request() -> Any:
    tools = [
        {"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()
    ]
    return parse_tools({"tools": tools}, "kimi_k2")


def test_kimi_call_ids_are_the_models_in_the_answer() -> None:
    """Kimi's template writes the ids back: the answer's ids are functions.NAME:IDX, whole
    and streamed (ToolOutput hands out the parser's ids)."""
    text, _ = CASES["kimi_k2"]
    msg, reason = ToolOutput(_kimi_request(), TOOL_PARSERS["kimi_k2"]()).message(text, "stop")
    assert reason == "tool_calls" and msg["content"] == "Let me check."
    assert [c["id"] for c in msg["tool_calls"]] == ["functions.forecast:0", "functions.clock:1"]
    out = ToolOutput(_kimi_request(), TOOL_PARSERS["kimi_k2"]())
    ids = []
    for i, ch in enumerate(text):
        last = i == len(text) - 1
        entry = out.rewrite(
            {"index": 0, "delta": {"content": ch}, "finish_reason": "stop" if last else None}
        )
        for tc in (entry or {}).get("delta", {}).get("tool_calls", []):
            ids += [tc["id"]] if "id" in tc else []
    assert ids == ["functions.forecast:0", "functions.clock:1"]


@pytest.mark.parametrize(
    ("text", "kind", "want"),
    [
        ("3", {"type": "integer"}, 3),
        ("3", {"type": "string"}, "3"),  # the schema says string: the text as written
        (" padded \n", {"type": "string"}, " padded \n"),
        ("3", None, 3),  # no schema: JSON when it reads
        (" 2.5 ", {"type": "number"}, 2.5),
        ("true", None, True),
        ("True", None, True),  # a Python literal
        ("None", {"type": "null"}, None),
        ('{"a": [1, 2]}', {"type": "object"}, {"a": [1, 2]}),
        ("{'a': (1, 2)}", {"type": "object"}, {"a": [1, 2]}),  # tuples as lists
        ("Paris", None, "Paris"),
        (" Paris ", {"type": ["string", "null"]}, "Paris"),  # only "string" itself keeps text
        ("NaN", {"type": "number"}, "NaN"),  # no JSON form: text
        ("{1, 2}", {"type": "array"}, "{1, 2}"),  # a set: text
        ("[1, 2", {"type": "array"}, "[1, 2"),
    ],
)
def test_glm45_value_types(text: str, kind: Any, want: Any) -> None:
    assert glm_value(text, kind) == want


def test_glm45_typed_calls_and_the_glm47_form() -> None:
    parser = make("glm45")
    text = (
        "<tool_call>forecast\n<arg_key>city</arg_key>\n<arg_value>1984</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value> 3 </arg_value>\n<arg_key>extra</arg_key>\n"
        "<arg_value>[1, 'a']</arg_value>\n</tool_call>"
    )
    _, (call,) = parser.parse(text)
    assert call.arguments == '{"city": "1984", "days": 3, "extra": [1, "a"]}'
    # GLM-4.7: no newline after the name, nor between the tags (or a literal \n); a call
    # without arguments
    glm47 = (
        "<tool_call>forecast<arg_key>days</arg_key>\\n<arg_value>2</arg_value></tool_call>"
        "<tool_call>clock</tool_call>"
    )
    _, calls = TOOL_PARSERS["glm47"]().parse(glm47)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("forecast", {"days": 2}),
        ("clock", {}),
    ]
    assert TOOL_PARSERS["glm47"] is TOOL_PARSERS["glm45"]


def test_glm45_string_values_stream_as_they_come() -> None:
    """A string parameter's text streams before its closing tag (a possible start of the tag
    held back); other values go out whole; the pieces add up to the final arguments."""
    body = "line one\nline </arg two & 'three'"
    text = (
        f"<tool_call>forecast\n<arg_key>note</arg_key>\n<arg_value>{body}</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
    )
    _, per_feed, (call,) = stream(make("glm45"), list(text))
    pieces = [e["function"]["arguments"] for f in per_feed for e in f if e.get("index") == 0]
    assert len(pieces) > len(body) // 2  # the note arrived over many chunks
    assert "".join(pieces) == call.arguments == json.dumps({"note": body, "days": 3})
    # without a string schema, the value waits for its closing tag
    _, per_feed, _ = stream(TOOL_PARSERS["glm45"](), list(text))
    assert len([e for f in per_feed for e in f]) <= 4


def _glm_call(name: str, **args: str) -> str:
    pairs = "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items()
    )
    return f"<tool_call>{name}\n{pairs}</tool_call>"


GLM_CALLS = [("forecast", {"city": "Beijing"}), ("forecast", {"city": "Shanghai"})]
GLM_TWO = [_glm_call(n, **a) for n, a in GLM_CALLS]


@pytest.mark.parametrize(
    ("text", "content"),
    [
        # vLLM's test_extract_tool_calls_mixed_content: its stream sends the text between the
        # calls too, its answer only the text before them; here both send all of it
        (
            f"I will help you.\n\n{GLM_TWO[0]}\n\nAlso Shanghai.\n\n{GLM_TWO[1]}",
            "I will help you.\n\n\n\nAlso Shanghai.\n\n",
        ),
        (f"{GLM_TWO[0]}{GLM_TWO[1]}\nThat is all.", "\nThat is all."),  # after the calls
        (f"Hi.{GLM_TWO[0]}\n \n{GLM_TWO[1]}\n", "Hi."),  # whitespace alone: none
        (f" \n{GLM_TWO[0]}\n{GLM_TWO[1]}  ", None),
        (f"{GLM_TWO[0]} then {GLM_TWO[1]}", " then "),
    ],
)
def test_glm45_text_between_and_after_the_calls(text: str, content: str | None) -> None:
    got, calls = make("glm45").parse(text)
    assert got == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == GLM_CALLS
    for pieces in [*chunkings(text), *([text[:i], text[i:]] for i in range(len(text) + 1))]:
        shown, per_feed, _ = stream(make("glm45"), pieces)
        assert shown == (content or ""), pieces
        assert [(c["name"], json.loads(c["arguments"])) for c in accumulate(per_feed)] == (
            GLM_CALLS
        ), pieces


def test_glm45_a_call_that_cannot_be_read_ends_the_calls() -> None:
    """The calls before it stay calls (as vLLM's answer keeps them); it and the text after it
    are content, whole and streamed."""
    for bad in (
        "<tool_call>f\n<arg_key>a</arg_key>\n</tool_call> and " + GLM_TWO[1],  # key, no value
        "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1",  # cut short by max_tokens
    ):
        text = f"Hi.{GLM_TWO[0]}\nNext:{bad}"
        got, calls = make("glm45").parse(text)
        assert got == "Hi.\nNext:" + bad
        assert [(c.name, json.loads(c.arguments)) for c in calls] == GLM_CALLS[:1]
        for pieces in chunkings(text):
            shown, per_feed, _ = stream(make("glm45"), pieces)
            assert shown == got and accumulate(per_feed)[0]["name"] == "forecast", pieces


def _qwen_call(name: str, bare: bool = False, **args: str) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    fn = f"<function={name}>\n{params}</function>"
    return fn if bare else f"<tool_call>\n{fn}\n</tool_call>"


QWEN_CALLS = [("forecast", {"city": "Paris"}), ("clock", {"tz": "utc"})]
QWEN_TWO = [_qwen_call(n, **a) for n, a in QWEN_CALLS]
QWEN_BARE = [_qwen_call(n, bare=True, **a) for n, a in QWEN_CALLS]


@pytest.mark.parametrize(
    ("text", "content"),
    [
        # vLLM's qwen3_coder stream sends the text between and after the calls (its engine
        # parser's answer too): here both forms send it, as written
        (f"Let me check.\n{QWEN_TWO[0]}\nNow the clock:\n{QWEN_TWO[1]}\nDone.", None),
        (f"{QWEN_TWO[0]}{QWEN_TWO[1]}\nThat is all.", "\nThat is all."),
        (f"Hi.{QWEN_TWO[0]}\n \n{QWEN_TWO[1]}\nBye.", "Hi.\nBye."),  # whitespace alone: none
        (f"\n\n{QWEN_TWO[0]}\n{QWEN_TWO[1]} ok", "\n\n ok"),  # before the calls: as written
        (f"{QWEN_BARE[0]} then {QWEN_BARE[1]}.", " then ."),  # no <tool_call> tags
        # a <tool_call> closed before any function is text, as vLLM reads it
        (
            f"Use <tool_call></tool_call> tags.\n{QWEN_TWO[0]}\n{QWEN_TWO[1]}",
            "Use <tool_call></tool_call> tags.\n",
        ),
        # the </tool_call> after </function> is the block's even when it comes last
        (f"{QWEN_BARE[0]}\n</tool_call> and {QWEN_TWO[1]}", " and "),
    ],
)
def test_qwen3_coder_text_between_and_after_the_calls(text: str, content: str | None) -> None:
    if content is None:  # the text outside the <tool_call> blocks
        content = "".join(re.split(r"<tool_call>\n.*?</tool_call>", text, flags=re.DOTALL))
    got, calls = make("qwen3_coder").parse(text)
    assert got == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == QWEN_CALLS
    for pieces in [*chunkings(text), *([text[:i], text[i:]] for i in range(len(text) + 1))]:
        shown, per_feed, _ = stream(make("qwen3_coder"), pieces)
        assert shown == content, pieces
        assert [(c["name"], json.loads(c["arguments"])) for c in accumulate(per_feed)] == (
            QWEN_CALLS
        ), pieces


def test_qwen3_coder_a_call_that_cannot_be_read_ends_the_calls() -> None:
    """The calls before it stay calls (vLLM keeps the calls it reads); it and the text after
    it are content, whole and streamed."""
    for bad in (
        "<tool_call>\nno function here\n</tool_call> and more",
        "<tool_call>\n<function=clock>\n<parameter=tz>\nut",  # cut short by max_tokens
    ):
        text = f"Hi.{QWEN_TWO[0]}\nNext:{bad}"
        got, calls = make("qwen3_coder").parse(text)
        assert got == "Hi.\nNext:" + bad
        assert [(c.name, json.loads(c.arguments)) for c in calls] == QWEN_CALLS[:1]
        for pieces in chunkings(text):
            shown, per_feed, _ = stream(make("qwen3_coder"), pieces)
            assert shown == got and accumulate(per_feed)[0]["name"] == "forecast", pieces


DS_V3 = [f"{CB}function{SEP}{n}\n```json\n{json.dumps(a)}\n```{CE}" for n, a in QWEN_CALLS]
DS_V31 = [f"{CB}{n}{SEP}{json.dumps(a)}{CE}" for n, a in QWEN_CALLS]


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v31"])
@pytest.mark.parametrize(
    ("form", "content"),
    [
        # vLLM's deepseek streams send the text between and after the calls, the block's own
        # tokens left out (its answer keeps only the text before): here both forms send it
        (
            "Let me check.{TB}{0}\nNow the clock:\n{1}{TE}\nDone.",
            "Let me check.\nNow the clock:\n\nDone.",
        ),
        ("{TB}{0}{TE} then {TB}{1}{TE}", " then "),
        ("Hi.{TB}{0}\n \n{1}{TE}\n\nBye", "Hi.\n\nBye"),  # whitespace alone: none
        ("{TB}{0}\n{1}{TE} ok", " ok"),
        ("{0}{1} and done", " and done"),  # no block tokens
    ],
)
def test_deepseek_text_between_and_after_the_calls(name: str, form: str, content: str) -> None:
    calls = DS_V3 if name == "deepseek_v3" else DS_V31
    text = form.format(*calls, TB=TB, TE=TE)
    got, parsed = make(name).parse(text)
    assert got == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == QWEN_CALLS
    for pieces in [*chunkings(text), *([text[:i], text[i:]] for i in range(len(text) + 1))]:
        shown, per_feed, _ = stream(make(name), pieces)
        assert shown == content, pieces
        assert [(c["name"], json.loads(c["arguments"])) for c in accumulate(per_feed)] == (
            QWEN_CALLS
        ), pieces


def test_deepseek_a_call_that_cannot_be_read_ends_the_calls() -> None:
    for bad in (f"{CB}function{SEP}clock\n```json\n{{not json}}\n```{CE}{TE}", f"{TB}{CB}func"):
        text = f"Hi.{TB}{DS_V3[0]}{TE}\nNext:{bad}"
        got, calls = make("deepseek_v3").parse(text)
        assert got == "Hi.\nNext:" + bad
        assert [(c.name, json.loads(c.arguments)) for c in calls] == QWEN_CALLS[:1]
        for pieces in chunkings(text):
            shown, per_feed, _ = stream(make("deepseek_v3"), pieces)
            assert shown == got and accumulate(per_feed)[0]["name"] == "forecast", pieces


@pytest.mark.parametrize(("alias", "same_as"), [("glm45", "qwen3"), ("kimi_k2", "deepseek_r1")])
def test_reasoning_names(alias: str, same_as: str) -> None:
    for text in (
        "<think>plan</think>\n\nAnswer",
        "plan it</think>The answer.",
        "No thinking here, a < b.",
        "pre <think>in</think> post",
        "<think>cut short while thin",
    ):
        assert split_reasoning(alias, text) == split_reasoning(same_as, text), text
        s, r, c = ThinkSplitter(alias), "", ""
        for ch in text:
            dr, dc = s.feed(ch)
            r, c = r + dr, c + dc
        dr, dc = s.finish()
        assert ((r + dr) or None, c + dc) == split_reasoning(same_as, text)
    from paged_server.cli_args import parse_args

    assert parse_args(["--reasoning-parser", alias]).reasoning_parser == alias


def test_cli_accepts_the_names() -> None:
    from paged_server.cli_args import parse_args

    for name in ("deepseek_v3", "deepseek_v31", "kimi_k2", "glm45", "glm47"):
        assert parse_args(["--tool-call-parser", name]).tool_call_parser == name


# ---- through the server ------------------------------------------------------------------


def test_kimi_k2_end_to_end() -> None:
    """--tool-call-parser kimi_k2 --reasoning-parser kimi_k2 over a scripted model: reasoning,
    content and the calls (with the model's ids), whole and streamed; special tokens kept."""
    engine = ScriptedEngine(max_model_len=512, step_time=0.0002)
    args = ["--max-model-len", "512", "--served-model-name", "tiny", "--client-timeout", "3"]
    args += ["--tool-call-parser", "kimi_k2", "--reasoning-parser", "kimi_k2"]
    script = "Need the weather.</think>" + CASES["kimi_k2"][0].replace("São", "Sao")
    tools = [
        {"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()
    ]
    with serve_in_process(args, engine) as (http, _):
        engine.script = script
        body = {"messages": [{"role": "user", "content": "Hi"}], "tools": tools}
        status, _, payload = http.request("POST", "/v1/chat/completions", body)
        assert status == 200, payload
        choice = payload["choices"][0]
        m = choice["message"]
        assert choice["finish_reason"] == "tool_calls"
        assert m["reasoning_content"] == "Need the weather." and m["content"] == "Let me check."
        assert [(c["id"], c["function"]["name"]) for c in m["tool_calls"]] == [
            ("functions.forecast:0", "forecast"),
            ("functions.clock:1", "clock"),
        ]
        assert json.loads(m["tool_calls"][0]["function"]["arguments"])["days"] == 3
        assert engine.params[payload["id"] + "-0"].skip_special_tokens is False
        s = chat_stream(SimpleNamespace(http=http, engine=engine), script, tools=tools)
        assert s["reasoning_content"] == "Need the weather." and s["finish"] == "tool_calls"
        assert s["content"] == "Let me check."
        assert [(c["id"], c["name"]) for c in s["calls"].values()] == [
            ("functions.forecast:0", "forecast"),
            ("functions.clock:1", "clock"),
        ]
        assert json.loads(s["calls"][1]["arguments"]) == {"tz": "utc"}
