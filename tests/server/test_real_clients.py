"""The official `openai` and `anthropic` SDKs, unchanged, through their own typed parsing and
stream helpers (`chat.completions.stream` / `.parse`, `responses.stream` / `.parse`,
`messages.stream` / `.parse`, `pydantic_function_tool`, typed exceptions): what users write,
against a ScriptedEngine in this process (the model's text set per test) and, for logprobs and
seeded sampling, the real tiny llama. The helpers raise on streams they cannot accumulate and
announce `*.done` events only where OpenAI's chunk order lets them."""

from __future__ import annotations

import enum
import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Literal

import pytest
from fake_engine import ScriptedEngine
from server_proc import ServerProc, serve_in_process

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pydantic = pytest.importorskip("pydantic")

ARGS = ["--max-model-len", "2048", "--served-model-name", "tiny", "--client-timeout", "3"]
HI = [{"role": "user", "content": "Hi"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
RESPONSES_WEATHER = {"type": "function", "name": "get_weather", "parameters": CITY, "strict": False}
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "weather", "input_schema": CITY}


def hermes(*cities: str) -> str:
    """The text of a Hermes model calling get_weather once per city."""
    return "\n".join(
        f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{c}"}}}}\n</tool_call>'
        for c in cities
    )


class Color(str, enum.Enum):
    red = "red"
    blue = "blue"


class Step(pydantic.BaseModel):
    explanation: str
    output: int | None


class Plan(pydantic.BaseModel):  # $defs, $ref, anyOf with null, enum, Literal: the SDK's schema
    steps: list[Step]
    color: Color
    kind: Literal["a", "b"]


PLAN = '{"steps": [{"explanation": "e", "output": null}], "color": "red", "kind": "a"}'


@pytest.fixture(scope="module")
def srv() -> Iterator[SimpleNamespace]:
    engine = ScriptedEngine(max_model_len=2048, step_time=0.0005)
    args = [*ARGS, "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
    with serve_in_process(args, engine) as (http, _):
        yield SimpleNamespace(
            engine=engine,
            oai=openai.OpenAI(base_url=http.url + "/v1", api_key="x", max_retries=0),
            ant=anthropic.Anthropic(base_url=http.url, api_key="x", max_retries=0),
        )


def _helper_calls(srv: SimpleNamespace, **kw) -> tuple[list[tuple[str, str]], object]:
    """`chat.completions.stream`: the (name, arguments) of its arguments.done events and the
    final completion."""
    with srv.oai.chat.completions.stream(model="tiny", messages=HI, **kw) as stream:
        done = [
            (e.name, e.arguments) for e in stream if e.type == "tool_calls.function.arguments.done"
        ]
        return done, stream.get_final_completion()


# ---- tool calls ----------------------------------------------------------------------------
def test_parallel_tool_calls_false_keeps_the_first_call(srv: SimpleNamespace) -> None:
    """vLLM's maybe_filter_parallel_tool_calls: a parsed output's first call only, whole and
    streamed; the Responses API's parallel_tool_calls and Anthropic's disable_parallel_tool_use
    the same."""
    srv.engine.script = hermes("Paris", "Rome")
    kw = {"model": "tiny", "messages": HI, "tools": [WEATHER]}
    both = srv.oai.chat.completions.create(**kw).choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["city"] for c in both] == ["Paris", "Rome"]
    choice = srv.oai.chat.completions.create(**kw, parallel_tool_calls=False).choices[0]
    (call,) = choice.message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.finish_reason == "tool_calls"
    done, final = _helper_calls(srv, tools=[WEATHER], parallel_tool_calls=False)
    assert done == [("get_weather", '{"city": "Paris"}')]
    assert len(final.choices[0].message.tool_calls) == 1
    r = srv.oai.responses.create(
        model="tiny", input="x", tools=[RESPONSES_WEATHER], parallel_tool_calls=False
    )
    assert [(o.type, json.loads(o.arguments)) for o in r.output] == [
        ("function_call", {"city": "Paris"})
    ]
    m = srv.ant.messages.create(
        model="tiny", max_tokens=300, messages=HI, tools=[ANTHROPIC_WEATHER],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
    )  # fmt: skip
    assert [(b.type, b.input) for b in m.content] == [("tool_use", {"city": "Paris"})]


def test_stream_helper_announces_every_forced_call(srv: SimpleNamespace) -> None:
    """Forced calls stream as they are generated; their finish comes in a chunk of its own (as
    OpenAI's), so the SDK's helper sends arguments.done for each call, the last one too."""
    srv.engine.script = '{"city": "Paris"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    done, final = _helper_calls(srv, tools=[WEATHER], tool_choice=named)
    assert done == [("get_weather", '{"city": "Paris"}')]
    assert final.choices[0].finish_reason == "stop"  # vLLM's, for a named tool_choice
    srv.engine.script = json.dumps(
        [{"name": "get_weather", "parameters": {"city": c}} for c in ("Paris", "Rome")]
    )
    done, final = _helper_calls(srv, tools=[WEATHER], tool_choice="required", n=2)
    assert sorted(json.loads(a)["city"] for _, a in done) == ["Paris", "Paris", "Rome", "Rome"]
    assert [c.finish_reason for c in final.choices] == ["tool_calls"] * 2
    chunks = list(
        srv.oai.chat.completions.create(
            model="tiny", messages=HI, tools=[WEATHER], tool_choice="required", stream=True
        )
    )
    (last,) = chunks[-1].choices
    assert last.finish_reason == "tool_calls" and last.delta.tool_calls is None


def test_parsed_tool_calls_and_their_round_trip(srv: SimpleNamespace) -> None:
    class GetWeather(pydantic.BaseModel):
        city: str

    srv.engine.script = hermes("Paris").replace("get_weather", "GetWeather")
    tool = openai.pydantic_function_tool(GetWeather)
    r = srv.oai.chat.completions.parse(model="tiny", messages=HI, tools=[tool])
    (call,) = r.choices[0].message.tool_calls
    assert call.function.parsed_arguments == GetWeather(city="Paris")
    srv.engine.script = "It is sunny."
    reply = [
        *HI,
        r.choices[0].message.model_dump(include={"role", "content", "tool_calls"}),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    answer = srv.oai.chat.completions.create(model="tiny", messages=reply, tools=[tool])
    assert answer.choices[0].message.content == "It is sunny."
    srv.engine.script = hermes("Paris", "Rome")
    done, final = _helper_calls(srv, tools=[WEATHER])  # auto: streamed as parsed
    assert [json.loads(a)["city"] for _, a in done] == ["Paris", "Rome"]
    assert final.choices[0].finish_reason == "tool_calls"


# ---- chat streams and structured outputs ---------------------------------------------------
def test_chat_stream_usage_choices_and_logprobs(srv: SimpleNamespace) -> None:
    srv.engine.script = "abc"
    chunks = list(
        srv.oai.chat.completions.create(
            model="tiny", messages=HI, n=2, stream=True, logprobs=True, top_logprobs=2,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * 4  # + EOS
    text: dict[int, str] = {}
    tokens: dict[int, str] = {}
    for c in chunks[:-1]:
        for ch in c.choices:
            text[ch.index] = text.get(ch.index, "") + (ch.delta.content or "")
            for t in ch.logprobs.content if ch.logprobs else []:
                tokens[ch.index] = tokens.get(ch.index, "") + t.token
                assert len(t.top_logprobs) == 2
    assert text == tokens == {0: "abc", 1: "abc"}
    with srv.oai.chat.completions.stream(model="tiny", messages=HI, n=2) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_completion()
    assert [c.message.content for c in final.choices] == ["abc", "abc"]
    assert types.count("content.done") == 2


def test_structured_outputs_through_the_sdk_helpers(srv: SimpleNamespace) -> None:
    srv.engine.script = PLAN
    want = Plan(steps=[Step(explanation="e", output=None)], color=Color.red, kind="a")
    r = srv.oai.chat.completions.parse(model="tiny", messages=HI, response_format=Plan)
    assert r.choices[0].message.parsed == want
    with srv.oai.chat.completions.stream(model="tiny", messages=HI, response_format=Plan) as s:
        assert s.get_final_completion().choices[0].message.parsed == want
    assert srv.oai.responses.parse(model="tiny", input="x", text_format=Plan).output_parsed == want
    m = srv.ant.messages.parse(model="tiny", max_tokens=300, messages=HI, output_format=Plan)
    assert m.parsed_output == want


# ---- the Responses API -------------------------------------------------------------------------
def test_responses_stream_helper_text_then_call_then_the_output(srv: SimpleNamespace) -> None:
    srv.engine.script = "<think>hmm</think>Let me look.\n" + hermes("Paris")
    with srv.oai.responses.stream(model="tiny", input="x", tools=[RESPONSES_WEATHER]) as s:
        types = [e.type for e in s]
        r = s.get_final_response()
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert types.index("response.function_call_arguments.done") > types.index(
        "response.output_text.done"
    )
    call = r.output[-1]
    srv.engine.script = "Sunny."
    nxt = srv.oai.responses.create(
        model="tiny", previous_response_id=r.id, tools=[RESPONSES_WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )  # fmt: skip
    assert nxt.output_text == "Sunny." and nxt.status == "completed"


# ---- Anthropic's Messages API --------------------------------------------------------------
def test_anthropic_stream_helper_thinking_text_and_tool_use(srv: SimpleNamespace) -> None:
    srv.engine.script = "<think>hmm</think>Let me look.\n" + hermes("Paris")
    kw = {"model": "tiny", "max_tokens": 300, "messages": HI, "tools": [ANTHROPIC_WEATHER]}
    with srv.ant.messages.stream(**kw, thinking={"type": "enabled", "budget_tokens": 1024}) as s:
        text = "".join(s.text_stream)
        m = s.get_final_message()
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    assert m.content[0].thinking == "hmm" and m.content[1].text == text
    assert m.stop_reason == "tool_use" and m.content[2].input == {"city": "Paris"}
    srv.engine.script = "Sunny."
    turn = [{"type": "tool_result", "tool_use_id": m.content[2].id, "content": "sunny"}]
    messages = [*HI, {"role": "assistant", "content": m.content}, {"role": "user", "content": turn}]
    again = srv.ant.messages.create(**{**kw, "messages": messages})
    assert again.content[0].text == "Sunny." and again.stop_reason == "end_turn"


def test_anthropic_stop_sequences_and_the_beta_routes(srv: SimpleNamespace) -> None:
    srv.engine.script = "abcdef"
    kw = {"model": "tiny", "max_tokens": 100, "messages": HI}
    with srv.ant.messages.stream(**kw, stop_sequences=["cd"]) as s:
        m = s.get_final_message()
    assert (m.content[0].text, m.stop_reason, m.stop_sequence) == ("ab", "stop_sequence", "cd")
    # the beta client posts to /v1/messages?beta=true with an anthropic-beta header
    beta = srv.ant.beta.messages.create(**kw, betas=["interleaved-thinking-2025-05-14"])
    assert beta.content[0].text == "abcdef"
    beta_count = srv.ant.beta.messages.count_tokens(model="tiny", messages=HI).input_tokens
    assert beta_count == srv.ant.messages.count_tokens(model="tiny", messages=HI).input_tokens > 0


# ---- errors --------------------------------------------------------------------------------
def test_errors_are_the_sdks_typed_exceptions(srv: SimpleNamespace, monkeypatch) -> None:
    oai, ant = srv.oai, srv.ant
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("nope")
    with pytest.raises(openai.BadRequestError) as e:  # refused before the stream begins
        oai.chat.completions.create(model="tiny", messages=HI, stream=True, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(anthropic.NotFoundError):
        ant.messages.create(model="nope", max_tokens=5, messages=HI)
    seen: list[int] = []

    def boom(req, seq) -> int:  # the engine fails after two tokens
        seen.append(1)
        if len(seen) % 3 == 0:
            raise RuntimeError("boom")
        return ord("a") + 3

    monkeypatch.setattr(srv.engine, "_next_token", boom)
    with pytest.raises(openai.APIError, match="internal engine error"):
        list(oai.chat.completions.create(model="tiny", messages=HI, stream=True))
    failing = ant.messages.stream(model="tiny", max_tokens=5, messages=HI)
    with pytest.raises(anthropic.APIStatusError) as err, failing as stream:
        "".join(stream.text_stream)
    assert err.value.body["error"]["type"] == "api_error"


# ---- the real model ------------------------------------------------------------------------
def test_real_streamed_logprobs_and_seeded_choices_equal_whole_ones(
    real_server: ServerProc,
) -> None:
    client = openai.OpenAI(base_url=real_server.url + "/v1", api_key="x", max_retries=0)
    kw = {"model": "tiny", "messages": HI, "max_tokens": 6, "temperature": 0, "logprobs": True}
    whole = client.chat.completions.create(**kw, top_logprobs=3).choices[0].logprobs.content
    chunks = client.chat.completions.create(**kw, top_logprobs=3, stream=True)
    streamed = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in whole]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in whole], abs=1e-4)
    kw = {"model": "tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 0, "logprobs": 2}
    lp = client.completions.create(**kw).choices[0].logprobs
    pieces = [c.choices[0].logprobs for c in client.completions.create(**kw, stream=True)]
    assert [t for p in pieces if p for t in p.tokens] == lp.tokens
    assert [o for p in pieces if p for o in p.text_offset] == lp.text_offset
    kw = {"model": "tiny", "messages": HI, "max_tokens": 6, "n": 3, "seed": 7}
    texts = [c.message.content for c in client.chat.completions.create(**kw).choices]
    joined = {i: "" for i in range(3)}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            joined[ch.index] += ch.delta.content or ""
    assert list(joined.values()) == texts
