"""--reasoning-parser (deepseek_r1, qwen3) and the mistral / pythonic / lfm2 tool-call parsers: the
parsers alone (whole text, and streamed with every split point), then requests through the
in-process server over a ScriptedEngine that writes the model's text."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from fake_engine import ScriptedEngine
from server_proc import chat_stream, serve_in_process

from paged_server.reasoning import ThinkSplitter, split_reasoning
from paged_server.tool_parsers import TOOL_PARSERS

# ---- reasoning ----------------------------------------------------------------------------

REASONING_CASES = [
    # (parser, model text, reasoning, content)
    ("deepseek_r1", "plan it</think>The answer.", "plan it", "The answer."),
    ("deepseek_r1", "<think>plan</think>\n\nDone", "plan", "\n\nDone"),
    ("deepseek_r1", "still thinking when cut", "still thinking when cut", ""),
    ("deepseek_r1", "a</think>b</think><think>c", "a", "b</think><think>c"),
    ("deepseek_r1", "x < y </thin k></think>ok", "x < y </thin k>", "ok"),
    ("qwen3", "<think>\nplan\n</think>\n\nAnswer", "\nplan\n", "\n\nAnswer"),
    ("qwen3", "No thinking here, a < b.", None, "No thinking here, a < b."),
    ("qwen3", "</think>stray close stays", None, "</think>stray close stays"),
    ("qwen3", "pre <think>in</think> post", "in", "pre  post"),
    ("qwen3", "<think>cut short while thin", "cut short while thin", ""),
    ("qwen3", "<think></think>only content", None, "only content"),
]


def _streamed(parser: str, pieces: list[str]) -> tuple[str, str]:
    s = ThinkSplitter(parser)
    reasoning = content = ""
    for piece in pieces:
        r, c = s.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = s.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), REASONING_CASES)
def test_reasoning_split_whole_and_at_every_split_point(
    parser: str, text: str, reasoning: str | None, content: str
) -> None:
    assert split_reasoning(parser, text) == (reasoning, content)
    want = (reasoning or "", content)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):  # three pieces: both tags can straddle a cut
            assert _streamed(parser, [text[:i], text[i:j], text[j:]]) == want, (i, j)
    assert _streamed(parser, list(text)) == want


def test_reasoning_streams_before_the_output_ends() -> None:
    s = ThinkSplitter("qwen3")
    assert s.feed("<thi") == ("", "")  # might be the tag: held
    assert s.feed("nk>step one, ") == ("step one, ", "")
    assert s.feed("step two</th") == ("step two", "")
    assert s.feed("ink>The answer") == ("", "The answer")
    assert s.feed(" is </think> 4") == ("", " is </think> 4")  # one block only
    assert s.finish() == ("", "")
    s = ThinkSplitter("deepseek_r1")
    assert s.feed("a</think>b") == ("a", "b")  # the tag inside one piece with other text


def test_an_unknown_reasoning_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="reasoning_parser"):
        ThinkSplitter("r2")


# ---- mistral / pythonic tool calls -------------------------------------------------------

MISTRAL = TOOL_PARSERS["mistral"]()
PYTHONIC = TOOL_PARSERS["pythonic"]()


def test_mistral_calls_and_content() -> None:
    text = (
        'Checking.[TOOL_CALLS][{"name": "forecast", "arguments": {"city": "Oslo", "days": 3}}, '
        '{"name": "clock", "arguments": "{\\"tz\\": \\"utc\\"}"}]'
    )
    content, calls = MISTRAL.parse(text)
    assert content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("forecast", {"city": "Oslo", "days": 3}),
        ("clock", {"tz": "utc"}),
    ]
    for bad in (
        "[TOOL_CALLS][{bad json}]",
        '[TOOL_CALLS]{"name": "f", "arguments": {}}',  # not a list
        '[TOOL_CALLS][{"name": "f", "arguments": {}}] and then text',
        '[TOOL_CALLS][{"arguments": {}}]',  # no name
        "[TOOL_CALLS][]",
        "plain [text] only",
    ):
        assert MISTRAL.parse(bad) == (bad, [])
    ids = {MISTRAL.new_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 9 and i.isalnum() and i.isascii() for i in ids)


def test_pythonic_calls_literals_only() -> None:
    text = '[get_weather(city="Paris", days=2), other(x=[1, 2.5, None], y={"k": (True,)})]'
    content, calls = PYTHONIC.parse(text)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("other", {"x": [1, 2.5, None], "y": {"k": [True]}}),
    ]
    wrapped = '<|python_start|>[f(a="b")]<|python_end|>'
    assert [c.name for c in PYTHONIC.parse(wrapped)[1]] == ["f"]
    for bad in (
        "[f(x=y)]",  # a name, not a literal
        "[f(1)]",  # positional
        "[f(**kw)]",
        "[os.system(cmd='ls')]",  # dotted: not a plain function name
        "[f(x=__import__('os'))]",
        "[f(x={1, 2})]",  # a set has no JSON form
        "[f(x=1)] and some text",
        "Sure: [f(x=1)]",
        "[1, 2, 3]",
        "[]",
        "[f(x=1",
    ):
        assert PYTHONIC.parse(bad) == (bad, []), bad


LFM2 = TOOL_PARSERS["lfm2"]()
TS, TE = "<|tool_call_start|>", "<|tool_call_end|>"


def test_lfm2_framed_pythonic_calls() -> None:
    text = f'Let me check.{TS}[get_weather(city="Paris"), clock(tz="utc")]{TE}It is sunny.'
    content, calls = LFM2.parse(text)
    assert content == "Let me check.It is sunny."  # what follows the calls too (vLLM's stream)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("clock", {"tz": "utc"}),
    ]
    content, calls = LFM2.parse(f"{TS}[f(a=1)]{TE}\n{TS} [g()] {TE}")
    assert content is None and [c.name for c in calls] == ["f", "g"]
    assert [c.name for c in LFM2.parse(f"{TS}[f(a=1)] ")[1]] == ["f"]  # the end marker cut off
    assert LFM2.keeps_special_tokens
    for bad in (
        f"{TS}[f(x=y)]{TE}",  # a name, not a literal
        f"{TS}[f(a=1)",  # cut short by max_tokens
        f"{TS}f(a=1){TE}",  # not a list
        f"{TS}[]{TE}",
        "[f(a=1)]",  # Llama's bare list is not LFM2's
        "plain text",
    ):
        assert LFM2.parse(bad) == (bad, []), bad
    # a frame that cannot be read ends the calls: it and what follows are content
    bad = f"{TS}oops{TE} then"
    for text in (f"Hi.{TS}[f(a=1)]{TE}{bad}", f"Hi.{TS}[f(a=1)]{TE}{bad}{TS}[g()]{TE}"):
        content, calls = LFM2.parse(text)
        assert [c.name for c in calls] == ["f"] and content == "Hi." + text[text.find(bad) :]


def test_lfm2_text_after_the_calls_less_an_echo() -> None:
    """vLLM: LFM2 may echo the list after its frame, capped by an end marker of its own; that
    echo is dropped, the text after it is content; text that opens otherwise is content."""
    call = f"{TS}[f(a=1)]{TE}"
    for text, want in (
        (f"Hi.{call}[f(a=1)]{TE}\nDone.", "Hi.\nDone."),
        (f"Hi.{call} [f(a=1)]{TE}[f(a=1)]{TE}", "Hi."),
        (f"Hi.{call}{TE}Done.", "Hi.Done."),
        (f"Hi.{call}[f(a=1)]", "Hi.[f(a=1)]"),  # no end marker: no echo to drop
        (f"Hi.{call}See [1]{TE}.", f"Hi.See [1]{TE}."),  # prose first: kept as written
        (f"{call}\n [f(a=1)]{TE}\n", None),
        (f"Hi.{call}<b>x</b>", "Hi.<b>x</b>"),
    ):
        content, calls = LFM2.parse(text)
        assert content == want and [c.name for c in calls] == ["f"], text
        for i in range(len(text) + 1):
            shown, streamed = _stream_calls(LFM2, [text[:i], text[i:]])
            assert shown == (want or "") and [c["name"] for c in streamed] == ["f"], (text, i)
        assert _stream_calls(LFM2, list(text))[0] == (want or ""), text
    text = f"Hi.{call} and {call}[f(a=1)]{TE} then {call}"  # the same frame again, an echo
    content, calls = LFM2.parse(text)
    assert content == "Hi. and  then " and [c.name for c in calls] == ["f"] * 3
    for i in range(len(text) + 1):
        shown, streamed = _stream_calls(LFM2, [text[:i], text[i:]])
        assert shown == content and [c["name"] for c in streamed] == ["f"] * 3, i


def _stream_calls(parser, pieces: list[str]) -> tuple[str, list[dict]]:
    """(content shown, the calls as an OpenAI client accumulates delta.tool_calls)."""
    s = parser.streamer()
    shown, entries = "", []
    for piece in pieces:
        out, more = s.feed(piece)
        shown, entries = shown + out, entries + more
    rest, more, _ = s.finish()
    calls: dict[int, dict] = {}
    for e in entries + more:
        c = calls.setdefault(e["index"], {"name": None, "arguments": ""})
        if "id" in e:
            assert c["name"] is None, "a call is announced once"
            c["name"] = e["function"]["name"]
        c["arguments"] += e["function"].get("arguments", "")
    return shown + rest, [calls[k] for k in sorted(calls)]


STREAMED_CALLS = [
    (
        "mistral",
        'Sure.[TOOL_CALLS][{"name": "f", "arguments": {"a": "x]}"}}, {"name": "g", '
        '"arguments": {}}]',
        "Sure.",
    ),
    ("pythonic", '[f(a="x)]", b=[1, {"c": 2}]), g()]', ""),
    ("pythonic", "[f(s='''it's'''), g(t=\"\\\"q\\\"\")]", ""),
    (
        "lfm2",
        'Sure.<|tool_call_start|>[f(a="x)]", b=[1, {"c": 2}])]<|tool_call_end|> '
        "<|tool_call_start|>[g()]<|tool_call_end|>Done.",
        "Sure.Done.",
    ),
]


@pytest.mark.parametrize(("name", "text", "content"), STREAMED_CALLS)
def test_tool_calls_stream_at_every_split_point(name: str, text: str, content: str) -> None:
    parser = TOOL_PARSERS[name]()
    got, whole = parser.parse(text)
    assert (got or "") == content and len(whole) == 2
    want = [{"name": c.name, "arguments": c.arguments} for c in whole]
    for i in range(len(text) + 1):
        shown, calls = _stream_calls(parser, [text[:i], text[i:]])
        assert shown.strip() == content
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            (w["name"], json.loads(w["arguments"])) for w in want
        ], i
    shown, calls = _stream_calls(parser, list(text))
    assert [c["name"] for c in calls] == [c.name for c in whole]


@pytest.mark.parametrize("name", ["mistral", "pythonic", "lfm2"])
def test_malformed_calls_stream_as_content(name: str) -> None:
    text = {
        "mistral": "[TOOL_CALLS][{nope}]",
        "pythonic": "[f(x=y), g(1)] see",
        "lfm2": f"Hm. {TS}[f(x=y), g(1)]{TE}",
    }[name]
    shown, calls = _stream_calls(TOOL_PARSERS[name](), list(text))
    assert calls == [] and shown == text


# ---- through the server ------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
ARGS = ["--max-model-len", "512", "--served-model-name", "tiny", "--client-timeout", "3"]


@pytest.fixture(scope="module")
def r1_hermes() -> Iterator[SimpleNamespace]:
    engine = ScriptedEngine(max_model_len=512, step_time=0.0005)
    args = [*ARGS, "--reasoning-parser", "deepseek_r1", "--tool-call-parser", "hermes"]
    with serve_in_process(args, engine) as (http, _):
        yield SimpleNamespace(http=http, engine=engine)


def _chat(server: SimpleNamespace, script: str, **extra) -> dict:
    server.engine.script = script
    body = {"messages": [{"role": "user", "content": "Hi"}], **extra}
    status, _, payload = server.http.request("POST", "/v1/chat/completions", body)
    assert status == 200, payload
    return payload


R1_SCRIPT = (
    "I should call the tool.</think>Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


def test_reasoning_and_tool_calls_end_to_end(r1_hermes: SimpleNamespace) -> None:
    msg = _chat(r1_hermes, R1_SCRIPT, tools=TOOLS)["choices"][0]
    assert msg["finish_reason"] == "tool_calls"
    m = msg["message"]
    assert m["reasoning_content"] == m["reasoning"] == "I should call the tool."
    assert m["content"] == "Let me look.\n"  # as written, as vLLM's hermes answers it
    (call,) = m["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}

    s = chat_stream(r1_hermes, R1_SCRIPT, tools=TOOLS)
    assert s["reasoning_content"] == s["reasoning"] == "I should call the tool."
    assert s["content"] == "Let me look.\n" and s["finish"] == "tool_calls"
    (call,) = s["calls"].values()
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}


def test_include_reasoning_false_and_completions(r1_hermes: SimpleNamespace) -> None:
    script = "hmm</think>4"
    m = _chat(r1_hermes, script, include_reasoning=False)["choices"][0]["message"]
    assert m["content"] == "4" and "reasoning_content" not in m and "reasoning" not in m
    s = chat_stream(r1_hermes, script, include_reasoning=False)
    assert (s["reasoning_content"], s["content"], s["finish"]) == ("", "4", "stop")
    m = _chat(r1_hermes, "cut</thi")["choices"][0]["message"]
    assert m["reasoning_content"] == "cut</thi" and m["content"] is None
    r1_hermes.engine.script = script  # completions: the text as generated
    _, _, body = r1_hermes.http.request("POST", "/v1/completions", {"prompt": "x"})
    assert body["choices"][0]["text"] == script


def test_qwen3_with_mistral_calls_end_to_end() -> None:
    engine = ScriptedEngine(max_model_len=512, step_time=0.0005)
    args = [*ARGS, "--reasoning-parser", "qwen3", "--tool-call-parser", "mistral"]
    script = '<think>call it</think>[TOOL_CALLS][{"name": "get_weather", "arguments": {}}]'
    with serve_in_process(args, engine) as (http, _):
        server = SimpleNamespace(http=http, engine=engine)
        payload = _chat(server, script, tools=TOOLS)
        m = payload["choices"][0]["message"]
        assert m["reasoning_content"] == "call it" and m["content"] is None
        (call,) = m["tool_calls"]
        assert len(call["id"]) == 9 and call["id"].isalnum()
        assert engine.params[payload["id"] + "-0"].skip_special_tokens is False
        s = chat_stream(server, script, tools=TOOLS)
        assert s["reasoning_content"] == "call it" and s["finish"] == "tool_calls"
        (call,) = s["calls"].values()
        assert len(call["id"]) == 9 and call["name"] == "get_weather"
        plain = _chat(server, "No think tags.")["choices"][0]["message"]
        assert plain["content"] == "No think tags." and "reasoning_content" not in plain


def test_lfm2_end_to_end() -> None:
    """--tool-call-parser lfm2 over a scripted model: content and calls, whole and streamed;
    the framing special tokens are kept in the text the parser reads."""
    engine = ScriptedEngine(max_model_len=512, step_time=0.0002)
    script = f'Checking.{TS}[get_weather(city="Paris", days=2)]{TE}'
    with serve_in_process([*ARGS, "--tool-call-parser", "lfm2"], engine) as (http, _):
        engine.script = script
        body = {"messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS}
        status, _, payload = http.request("POST", "/v1/chat/completions", body)
        assert status == 200, payload
        choice = payload["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == "Checking."
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}
        assert engine.params[payload["id"] + "-0"].skip_special_tokens is False
        s = chat_stream(SimpleNamespace(http=http, engine=engine), script, tools=TOOLS)
        assert s["content"] == "Checking." and s["finish"] == "tool_calls"
        assert [c["name"] for c in s["calls"].values()] == ["get_weather"]
