"""gpt-oss's Harmony output: `--reasoning-parser openai_gptoss` and `--tool-call-parser openai`
(the parsers alone on whole texts, streamed at every split point and at random ones through the
same chunk rewriters the server uses, random marker soups), then requests through the in-process
server over a ScriptedEngine that writes the model's text; and `reasoning_effort` reaching the
chat template."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from fake_engine import ScriptedEngine
from hypothesis import given, settings
from hypothesis import strategies as st
from server_proc import chat_stream, serve_in_process

from paged_server.errors import APIError
from paged_server.harmony import MARKERS, HarmonyScanner
from paged_server.openai_protocol import parse_chat
from paged_server.reasoning import ReasoningOutput, ReasoningRequest, split_reasoning
from paged_server.tool_parsers import TOOL_PARSERS
from paged_server.tools import ToolOutput, ToolRequest

GPTOSS = "openai_gptoss"
OPENAI = TOOL_PARSERS["openai"]
WEATHER_CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"location":"Paris"}'
)

# (id, the model's text, reasoning, content, [(function, arguments)])
CASES = [
    (
        "reasoning+final",
        "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final"
        "<|message|>Hello!<|return|>",
        "Simple.",
        "Hello!",
        [],
    ),
    (
        "final, EOS not shown",
        "<|channel|>analysis<|message|>a < b, so<|end|><|start|>assistant<|channel|>final"
        "<|message|>It is <|ok|> to say a < b.",
        "a < b, so",
        "It is <|ok|> to say a < b.",
        [],
    ),
    (
        "reasoning+call (constrain)",
        "<|channel|>analysis<|message|>User asks weather. Call tool.<|end|>"
        + WEATHER_CALL
        + "<|call|>",
        "User asks weather. Call tool.",
        None,
        [("get_weather", '{"location":"Paris"}')],
    ),
    (
        "call without constrain",
        "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.f<|message|>{"a": 1}',
        "x",
        None,
        [("f", '{"a": 1}')],
    ),
    (
        "recipient before the channel",
        "<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.get_weather"
        '<|channel|>commentary json<|message|>{"location": "Oslo"}<|call|>',
        "x",
        None,
        [("get_weather", '{"location": "Oslo"}')],
    ),
    (
        "first message: the prompt's <|start|>assistant, recipient first",
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"location": "Rome"}',
        None,
        None,
        [("get_weather", '{"location": "Rome"}')],
    ),
    (
        "two calls",
        "<|channel|>analysis<|message|>Two lookups.<|end|><|start|>assistant<|channel|>"
        'commentary to=functions.a <|constrain|>json<|message|>{"x": 1}<|call|><|start|>'
        'assistant<|channel|>commentary to=functions.b<|message|>{"y": [2, {"z": "}"}]}<|call|>',
        "Two lookups.",
        None,
        [("a", '{"x": 1}'), ("b", '{"y": [2, {"z": "}"}]}')],
    ),
    (
        "commentary preamble + call",
        "<|channel|>analysis<|message|>plan<|end|><|start|>assistant<|channel|>commentary"
        "<|message|>Checking the weather.<|end|>" + WEATHER_CALL,
        "plan",
        "Checking the weather.",
        [("get_weather", '{"location":"Paris"}')],
    ),
    (
        "cut short in the analysis",
        "<|channel|>analysis<|message|>The user wa",
        "The user wa",
        None,
        [],
    ),
    (
        "cut short in a header",
        "<|channel|>analysis<|message|>done<|end|><|start|>assistant<|channel|>fin",
        "done",
        None,
        [],
    ),
    (
        "cut short in the final",
        "<|channel|>analysis<|message|>r<|end|><|start|>assistant<|channel|>final<|message|>Hel",
        "r",
        "Hel",
        [],
    ),
    (
        "cut short in a call's arguments",
        "<|channel|>analysis<|message|>r<|end|>" + WEATHER_CALL[:-5],
        "r",
        None,
        [("get_weather", '{"location":"Pa')],
    ),
    ("cut short in the prompt's header", " to=functions.get_wea", None, None, []),
    ("no markers at all", "Just text, a < b <| c.", None, "Just text, a < b <| c.", []),
    ("plain text that starts like a recipient", "to be, or not", None, "to be, or not", []),
    ("a body without a header", "<|message|>Hi", None, "Hi", []),
    (
        "text outside messages, after the first",  # not the prompt's header any more
        "<|channel|>analysis<|message|>r<|end|> to=functions.f",
        "r",
        " to=functions.f",
        [],
    ),
    (
        "markers quoted in a call's JSON strings",
        '<|channel|>commentary to=functions.f<|message|>{"q": "a <|end|> \\"<|call|>", "r": 1}',
        None,
        None,
        [("f", '{"q": "a <|end|> \\"<|call|>", "r": 1}')],
    ),
    (
        "a marker outside the JSON strings ends the call",
        '<|channel|>commentary to=functions.f<|message|>{"q": 1}<|end|>stray "}"',
        None,
        'stray "}"',
        [("f", '{"q": 1}')],
    ),
    (
        "unknown channel: reasoning, never the answer",
        "<|channel|>scratch<|message|>notes<|end|><|start|>assistant<|channel|>final<|message|>ok",
        "notes",
        "ok",
        [],
    ),
    (
        "stray markers",
        "<|end|><|channel|>analysis<|message|>a<|message|>b<|end|><|end|><|return|>"
        "<|start|>assistant<|channel|>final<|message|>c<|constrain|>d<|end|><|call|>",
        "ab",
        "cd",
        [],
    ),
    (
        "a header that never reached <|message|>",
        "<|start|>assistant<|channel|>final<|end|><|start|>assistant<|start|>assistant"
        "<|channel|>final<|message|>fine",
        None,
        "fine",
        [],
    ),
    (
        "a new header without a terminator",
        "<|channel|>analysis<|message|>think<|channel|>final<|message|>say",
        "think",
        "say",
        [],
    ),
    (
        "built-in tool calls are dropped",
        "<|channel|>analysis to=python code<|message|>print(1)<|call|><|start|>assistant"
        "<|channel|>commentary to=functions.<|message|>{}",
        None,
        None,
        [],
    ),
]
IDS = [c[0] for c in CASES]


def whole(text: str) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """The server's non-streamed answer with both parsers: the reasoning parser leaves the tool
    parser the Harmony text less the reasoning."""
    reasoning, rest = split_reasoning(GPTOSS, text, tool_markup=True)
    content, calls = OPENAI().parse(rest)
    return reasoning, content or None, [(c.name, c.arguments) for c in calls]


def streamed(pieces: list[str], tools: bool = True) -> dict:
    """The pieces as a stream's chunk entries through the server's rewriters (reasoning, then
    tool calls), the deltas joined as a client joins them."""
    think = ReasoningOutput(ReasoningRequest(GPTOSS, tool_markup=tools))
    tool_req = ToolRequest(tools=[], choice="auto")
    calls_out = ToolOutput(tool_req, OPENAI()) if tools else None
    out: dict = {"reasoning_content": "", "reasoning": "", "content": "", "calls": {}}
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        entry: dict | None = {
            "index": 0,
            "delta": {"content": piece},
            "logprobs": None,
            "finish_reason": "stop" if last else None,
        }
        entry = think.rewrite(entry)
        if entry is not None and calls_out is not None:
            entry = calls_out.rewrite(entry)
        if entry is None:
            continue
        delta = entry["delta"]
        for key in ("reasoning_content", "reasoning", "content"):
            out[key] += delta.get(key, "")
        for tc in delta.get("tool_calls", []):
            call = out["calls"].setdefault(tc["index"], {"arguments": ""})
            if "id" in tc:
                assert "name" not in call, "a call is announced once"
                call["id"], call["name"] = tc["id"], tc["function"]["name"]
            call["arguments"] += tc["function"].get("arguments", "")
        out["finish"] = entry["finish_reason"]
    return out


def check_stream(text: str, pieces: list[str]) -> None:
    assert "".join(pieces) == text
    reasoning, content, calls = whole(text)
    s = streamed(pieces)
    assert s["reasoning_content"] == s["reasoning"] == (reasoning or ""), pieces
    assert s["content"] == (content or ""), pieces
    got = [(c["name"], c["arguments"]) for _, c in sorted(s["calls"].items())]
    assert got == calls, pieces
    assert all(c["id"].startswith("call_") for c in s["calls"].values())
    assert s["finish"] == ("tool_calls" if calls else "stop")
    s = streamed(pieces, tools=False)  # no tool parsing: the calls are not content
    r, c = split_reasoning(GPTOSS, text)
    assert (s["reasoning_content"], s["content"], s["calls"]) == (r or "", c, {}), pieces


def no_marker(text: str | None) -> bool:
    return not any(m in (text or "") for m in MARKERS)


# ---- whole texts ------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "text", "reasoning", "content", "calls"), CASES, ids=IDS)
def test_whole_outputs(name, text, reasoning, content, calls) -> None:
    assert whole(text) == (reasoning, content, calls)
    # each parser alone: the reasoning parser drops the calls, the tool parser the reasoning
    assert split_reasoning(GPTOSS, text) == (reasoning, content or "")
    alone, alone_calls = OPENAI().parse(text)
    assert (alone or None, [(c.name, c.arguments) for c in alone_calls]) == (content, calls)
    assert no_marker(reasoning) and no_marker(content)
    for _, args in calls:
        if "cut short" not in name:
            json.loads(args)


def test_events_join_to_the_text_and_headers_parse() -> None:
    text = CASES[2][1]
    s = HarmonyScanner()
    events = s.feed(text) + s.finish()
    assert "".join(e.raw for e in events) == text
    opened = [e.header for e in events if e.what == "open"]
    assert [(h.channel, h.recipient) for h in opened] == [
        ("analysis", None),
        ("commentary", "functions.get_weather"),
    ]


# ---- streaming --------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "text", "reasoning", "content", "calls"), CASES, ids=IDS)
def test_streams_join_to_the_whole_answer(name, text, reasoning, content, calls) -> None:
    for i in range(len(text) + 1):
        check_stream(text, [text[:i], text[i:]])
    check_stream(text, list(text))
    rng = random.Random(name)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(2, 8))))
        check_stream(text, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])


def test_text_streams_as_soon_as_it_is_decided() -> None:
    think = ReasoningOutput(ReasoningRequest(GPTOSS))

    def feed(text: str, last: bool = False) -> dict:
        entry = {"index": 0, "delta": {"content": text}, "finish_reason": "stop" if last else None}
        got = think.rewrite(entry)
        return {} if got is None else got["delta"]

    assert feed("<|channel|>analys") == {}  # a header: held until <|message|>
    assert feed("is<|message|>Think") == {"reasoning_content": "Think", "reasoning": "Think"}
    assert feed("ing<|e")["reasoning"] == "ing"  # "<|e" may be a marker
    assert feed("nd|><|start|>assistant<|channel|>final<|message|>Hi") == {"content": "Hi"}
    assert feed(" <", last=True) == {"content": " <"}  # the end: "<" was text after all

    tools = OPENAI().streamer()
    content, entries = tools.feed("<|channel|>commentary to=functions.get_wea")
    assert (content, entries) == ("", [])
    content, entries = tools.feed('ther<|message|>{"location": "Pa')
    assert entries[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert entries[1]["function"] == {"arguments": '{"location": "Pa'}
    content, entries = tools.feed('ris"}')
    assert entries == [{"index": 0, "function": {"arguments": 'ris"}'}}]


# Fragments whose joins cannot spell a marker unless one is there: none starts with ">" or "|>".
FRAGMENTS = [
    *MARKERS,
    "assistant",
    "analysis",
    "final",
    "commentary",
    "scratch",
    " to=functions.f",
    " to=python",
    "json",
    " ",
    "\n",
    "to",
    "Hi",
    "a b",
    '{"k": "',
    '"',
    "\\",
    "}",
    "<",
    "<|",
    "<|en",
    "<|call|",
]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.sampled_from(FRAGMENTS), max_size=24),
    st.lists(st.integers(0, 10_000), max_size=6),
)
def test_random_marker_soup(fragments: list[str], cuts: list[int]) -> None:
    text = "".join(fragments)
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    s = HarmonyScanner()
    events = [e for p in pieces for e in s.feed(p)] + s.finish()
    assert "".join(e.raw for e in events) == text
    reasoning, content, calls = whole(text)
    assert no_marker(reasoning) and no_marker(content)
    # both parsers together == each parser alone
    r, c = split_reasoning(GPTOSS, text)
    assert (r, c or None) == (reasoning, content)
    alone, alone_calls = OPENAI().parse(text)
    assert (alone or None, [(c.name, c.arguments) for c in alone_calls]) == (content, calls)
    check_stream(text, pieces)


# ---- through the server -----------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
ARGS = ["--max-model-len", "1024", "--served-model-name", "tiny", "--client-timeout", "3"]
CALL_SCRIPT = CASES[2][1][: -len("<|call|>")]  # the engine does not show the EOS token
FINAL_SCRIPT = CASES[0][1]


@pytest.fixture(scope="module")
def gptoss() -> Iterator[SimpleNamespace]:
    engine = ScriptedEngine(max_model_len=1024, step_time=0.0002)
    args = [*ARGS, "--reasoning-parser", GPTOSS, "--tool-call-parser", "openai"]
    with serve_in_process(args, engine) as (http, app):
        yield SimpleNamespace(http=http, engine=engine, app=app)


def _chat(server: SimpleNamespace, script: str, **extra) -> dict:
    server.engine.script = script
    body = {"messages": [{"role": "user", "content": "Hi"}], **extra}
    status, _, payload = server.http.request("POST", "/v1/chat/completions", body)
    assert status == 200, payload
    return payload


def _kept_special_tokens(server: SimpleNamespace, payload_id: str) -> bool:
    return server.engine.params[payload_id + "-0"].skip_special_tokens is False


def test_chat_reasoning_and_a_tool_call(gptoss: SimpleNamespace) -> None:
    payload = _chat(gptoss, CALL_SCRIPT, tools=TOOLS)
    assert _kept_special_tokens(gptoss, payload["id"])
    (choice,) = payload["choices"]
    assert choice["finish_reason"] == "tool_calls"
    m = choice["message"]
    assert m["reasoning_content"] == m["reasoning"] == "User asks weather. Call tool."
    assert m["content"] is None
    (call,) = m["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"location":"Paris"}'}

    s = chat_stream(gptoss, CALL_SCRIPT, tools=TOOLS)
    assert s["reasoning_content"] == s["reasoning"] == "User asks weather. Call tool."
    assert s["content"] == "" and s["finish"] == "tool_calls"
    (call,) = s["calls"].values()
    assert call["id"].startswith("call_")
    assert (call["name"], call["arguments"]) == ("get_weather", '{"location":"Paris"}')


def test_chat_reasoning_and_final(gptoss: SimpleNamespace) -> None:
    for extra in ({}, {"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "none"}):
        payload = _chat(gptoss, FINAL_SCRIPT, **extra)
        assert _kept_special_tokens(gptoss, payload["id"])  # the reasoning parser asks too
        (choice,) = payload["choices"]
        m = choice["message"]
        assert (m["reasoning_content"], m["content"], choice["finish_reason"]) == (
            "Simple.",
            "Hello!",
            "stop",
        )
        assert "tool_calls" not in m or not m["tool_calls"]
        s = chat_stream(gptoss, FINAL_SCRIPT, **extra)
        assert (s["reasoning"], s["content"], s["calls"], s["finish"]) == (
            "Simple.",
            "Hello!",
            {},
            "stop",
        )
    m = _chat(gptoss, FINAL_SCRIPT, include_reasoning=False)["choices"][0]["message"]
    assert m["content"] == "Hello!" and "reasoning_content" not in m


def test_chat_preamble_call_and_cut_short(gptoss: SimpleNamespace) -> None:
    _, script, reasoning, content, calls = CASES[7]
    m = _chat(gptoss, script, tools=TOOLS)["choices"][0]["message"]
    assert (m["reasoning_content"], m["content"]) == (reasoning, content)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]] == calls
    s = chat_stream(gptoss, script, tools=TOOLS)
    assert (s["reasoning"], s["content"], s["finish"]) == (reasoning, content, "tool_calls")

    # max_tokens inside the analysis: reasoning so far, no content
    cut = len("<|channel|>analysis<|message|>User asks")
    choice = _chat(gptoss, CALL_SCRIPT, tools=TOOLS, max_tokens=cut)["choices"][0]
    assert choice["finish_reason"] == "length"
    assert (choice["message"]["reasoning_content"], choice["message"]["content"]) == (
        "User asks",
        None,
    )
    assert not choice["message"].get("tool_calls")
    s = chat_stream(gptoss, CALL_SCRIPT, tools=TOOLS, max_tokens=cut)
    assert (s["reasoning"], s["content"], s["calls"], s["finish"]) == (
        "User asks",
        "",
        {},
        "length",
    )
    # inside the call's arguments: the call as far as it came, finish_reason "length"
    choice = _chat(gptoss, CALL_SCRIPT, tools=TOOLS, max_tokens=len(CALL_SCRIPT) - 3)["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"location":"Pari'


def test_chat_keeps_a_clients_skip_special_tokens(gptoss: SimpleNamespace) -> None:
    payload = _chat(gptoss, "plain", skip_special_tokens=True)
    assert gptoss.engine.params[payload["id"] + "-0"].skip_special_tokens is True
    assert payload["choices"][0]["message"]["content"] == "plain"


def test_responses_api_reasoning_and_call(gptoss: SimpleNamespace) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": {}}
    gptoss.engine.script = CALL_SCRIPT
    body = {"input": "Weather in Paris?", "tools": [tool]}
    status, _, r = gptoss.http.request("POST", "/v1/responses", body)
    assert status == 200, r
    reasoning, call = r["output"]
    assert reasoning["content"] == [
        {"type": "reasoning_text", "text": "User asks weather. Call tool."}
    ]
    assert (call["type"], call["name"], call["arguments"]) == (
        "function_call",
        "get_weather",
        '{"location":"Paris"}',
    )
    conn = gptoss.http.conn(30)
    headers = {"Content-Type": "application/json"}
    conn.request("POST", "/v1/responses", json.dumps({**body, "stream": True}), headers)
    lines = conn.getresponse().read().decode().splitlines()
    conn.close()
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: ")]
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    assert [i["type"] for i in final["output"]] == ["reasoning", "function_call"]
    assert final["output"][1]["arguments"] == '{"location":"Paris"}'
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == "User asks weather. Call tool."


# ---- reasoning_effort -------------------------------------------------------------------------


def test_reasoning_effort_is_checked() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    assert parse_chat({"messages": msgs}).reasoning_effort is None
    for effort in ("low", "medium", "high"):
        assert parse_chat({"messages": msgs, "reasoning_effort": effort}).reasoning_effort == effort
    for bad in ("max", "", 3, ["low"]):
        with pytest.raises(APIError) as e:
            parse_chat({"messages": msgs, "reasoning_effort": bad})
        assert (e.value.status, e.value.param) == (400, "reasoning_effort")


def test_reasoning_effort_reaches_the_template(gptoss: SimpleNamespace) -> None:
    rendered = gptoss.app.tokenizer  # the routes' own tokenizer (a copy of the engine's)
    _chat(gptoss, "ok", reasoning_effort="high")
    assert rendered.template_vars["reasoning_effort"] == "high"
    _chat(gptoss, "ok", chat_template_kwargs={"reasoning_effort": "low"})
    assert rendered.template_vars["reasoning_effort"] == "low"
    _chat(gptoss, "ok", reasoning_effort="medium", chat_template_kwargs={"reasoning_effort": "x"})
    assert rendered.template_vars["reasoning_effort"] == "medium"  # the field wins
    _chat(gptoss, "ok")
    assert "reasoning_effort" not in rendered.template_vars  # the template's own default
    body = {"messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": "extreme"}
    status, _, payload = gptoss.http.request("POST", "/v1/chat/completions", body)
    assert status == 400 and payload["error"]["param"] == "reasoning_effort"

    gptoss.engine.script = "ok"  # the Responses API: reasoning.effort
    body = {"input": "Hi", "reasoning": {"effort": "low", "summary": None}}
    status, _, r = gptoss.http.request("POST", "/v1/responses", body)
    assert status == 200, r
    assert r["reasoning"]["effort"] == "low"
    assert rendered.template_vars["reasoning_effort"] == "low"
    for reasoning, param in (
        ({"effort": "max"}, "reasoning.effort"),
        ({"summary": "brief"}, "reasoning.summary"),  # auto / concise / detailed are served
    ):
        status, _, r = gptoss.http.request(
            "POST", "/v1/responses", {"input": "Hi", "reasoning": reasoning}
        )
        assert status == 400 and r["error"]["param"] == param, r


def _template_app(template: str):
    """The app over a one-token tokenizer and `template`: renders as the server renders every
    template (transformers' Jinja), without an engine."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from paged_server.app import OpenAIApp

    vocab = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    return OpenAIApp(
        SimpleNamespace(),
        PreTrainedTokenizerFast(tokenizer_object=vocab),
        served_model_names=["t"],
        model_path="t",
        max_model_len=64,
        chat_template=template,
    )


def test_reasoning_effort_in_a_real_template() -> None:
    """gpt-oss's template reads `reasoning_effort` (default "medium") into its system message:
    rendered by transformers' Jinja, as the server renders every template."""
    app = _template_app(
        "{%- if reasoning_effort is not defined %}{%- set reasoning_effort = 'medium' %}"
        "{%- endif %}<|start|>system<|message|>Reasoning: {{ reasoning_effort }}<|end|>"
        "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>"
        "{% endfor %}<|start|>assistant"
    )
    msgs = [{"role": "user", "content": "hi"}]
    text = app._render_chat(parse_chat({"messages": msgs, "reasoning_effort": "high"}))
    assert text == (
        "<|start|>system<|message|>Reasoning: high<|end|><|start|>user<|message|>hi<|end|>"
        "<|start|>assistant"
    )
    assert "Reasoning: medium" in app._render_chat(parse_chat({"messages": msgs}))


def test_reasoning_sent_back_reaches_the_template() -> None:
    """A tool loop sends the assistant's earlier turn back with its reasoning: under any of
    the names clients use, it reaches the template as gpt-oss's `thinking` and Qwen3's
    `reasoning_content` (rendered by transformers' Jinja); other roles may not carry it."""
    from paged_server.errors import APIError

    app = _template_app(
        "{% for m in messages %}<|start|>{{ m.role }}"
        "{% if m.thinking %}<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}"
        "{% if m.reasoning_content %}[{{ m.reasoning_content }}]{% endif %}"
        "<|message|>{{ m.content }}<|end|>{% endfor %}"
    )
    for key in ("reasoning_content", "reasoning", "thinking"):
        msgs = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo", key: "think"},
        ]
        text = app._render_chat(parse_chat({"messages": msgs}))
        assert text.endswith(
            "<|start|>assistant<|channel|>analysis<|message|>think<|end|>[think]"
            "<|message|>yo<|end|>"
        ), key
    for msgs, param in (
        ([{"role": "user", "content": "hi", "reasoning": "r"}], "messages[0]"),
        ([{"role": "assistant", "content": "x", "thinking": 1}], "messages[0].thinking"),
    ):
        with pytest.raises(APIError) as e:
            parse_chat({"messages": msgs})
        assert e.value.param == param
