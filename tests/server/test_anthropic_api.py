"""`/v1/messages` and `/v1/messages/count_tokens` (Anthropic's Messages API): shapes, the
blocks -> chat messages translation, stop reasons, usage, stream events, tool use, thinking and
errors over a ScriptedEngine in this process (the model's text is set per test), every body and
event checked against the installed `anthropic` package's types; then the official client
against a real tiny llama, where the answer must equal chat completions'."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from fake_engine import ScriptedEngine
from server_proc import API_KEY, HEADERS, ServerProc, serve_in_process, typed_events

anthropic = pytest.importorskip("anthropic")
pydantic = pytest.importorskip("pydantic")
from anthropic.types import Message, RawMessageStreamEvent  # noqa: E402

STREAM_EVENT = pydantic.TypeAdapter(RawMessageStreamEvent)
ARGS = ["--max-model-len", "512", "--served-model-name", "tiny", "--client-timeout", "3"]
WEATHER = {
    "name": "get_weather",
    "description": "the weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CALL_SCRIPT = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call>"
)
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def srv() -> Iterator[SimpleNamespace]:
    engine = ScriptedEngine(max_model_len=512, step_time=0.0005)
    args = [*ARGS, "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
    with serve_in_process(args, engine) as (http, app):
        yield SimpleNamespace(http=http, engine=engine, app=app)


def _post(srv: SimpleNamespace, script: str, path: str = "/v1/messages", **body) -> tuple:
    srv.engine.script = script
    body = {"model": "tiny", "max_tokens": 100, "messages": HI, **body}
    status, _, payload = srv.http.request("POST", path, body)
    return status, payload


def _create(srv: SimpleNamespace, script: str, **body) -> dict:
    status, payload = _post(srv, script, **body)
    assert status == 200, payload
    Message.model_validate(payload)  # the SDK's own type, validated (not just constructed)
    return payload


def _error(srv: SimpleNamespace, status: int, path: str = "/v1/messages", **body) -> str:
    got, payload = _post(srv, "x", path, **body)
    assert got == status, payload
    assert payload["type"] == "error" and set(payload["error"]) == {"type", "message"}, payload
    return payload["error"]["message"]


def _events(srv: SimpleNamespace, script: str, **body) -> list[dict]:
    """Every event of a stream, each checked against the SDK's types."""
    srv.engine.script = script
    body = {"model": "tiny", "max_tokens": 100, "messages": HI, **body}
    events = typed_events(srv.http, "/v1/messages", body)
    for event in events:
        if event["type"] not in ("ping", "error"):
            STREAM_EVENT.validate_python(event)
    return events


def _joined(events: list[dict]) -> list[dict]:
    """The content blocks a stream builds (the SDK's accumulation, by hand)."""
    blocks: list[dict] = []
    for e in events:
        if e["type"] == "content_block_start":
            assert e["index"] == len(blocks)
            blocks.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            b, d = blocks[e["index"]], e["delta"]
            if d["type"] == "input_json_delta":
                b["_json"] = b.get("_json", "") + d["partial_json"]
            elif d["type"] == "signature_delta":
                b["signature"] = d["signature"]
            else:
                key = d["type"].removesuffix("_delta")
                b[key] += d[key]
    for b in blocks:
        if "_json" in b:
            b["input"] = json.loads(b.pop("_json"))
    return blocks


def _prompt_len(*messages: tuple[str, str]) -> int:
    """The fake chat template's token count: one token per byte of `<role>content\\n`."""
    return len("".join(f"<{r}>{c}\n" for r, c in messages).encode()) + len("<assistant>")


# ---- the message object --------------------------------------------------------------------
def test_text_message_shape_and_usage(srv: SimpleNamespace) -> None:
    r = _create(srv, "Hello there.", system="Be brief.", temperature=0.5, top_k=4, top_p=0.9)
    assert r["id"].startswith("chatcmpl-") and r["type"] == "message" and r["role"] == "assistant"
    assert r["model"] == "tiny" and r["content"] == [{"type": "text", "text": "Hello there."}]
    assert (r["stop_reason"], r["stop_sequence"]) == ("end_turn", None)
    n = _prompt_len(("system", "Be brief."), ("user", "Hi"))
    assert r["usage"] == {
        "input_tokens": n,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": len("Hello there.") + 1,  # and the EOS token
    }
    params = srv.engine.params[r["id"] + "-0"]
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.5, 4, 0.9, 100)
    count = _post(srv, "", "/v1/messages/count_tokens", system="Be brief.", max_tokens=None)
    assert count == (200, {"input_tokens": n, "context_management": {"original_input_tokens": n}})
    # the SDKs' beta clients add a query string
    status, beta = _post(srv, "Hi.", "/v1/messages?beta=true")
    assert status == 200 and beta["content"] == [{"type": "text", "text": "Hi."}], beta


def test_blocks_become_the_chat_messages(srv: SimpleNamespace) -> None:
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "look it up", "signature": "s"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Checking."},
                call,
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": [{"type": "text", "text": "no such city"}],
                    "is_error": True,
                },
                {"type": "text", "text": "And tomorrow?", "cache_control": {"type": "ephemeral"}},
            ],
        },
    ]
    system = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}]
    r = _create(srv, "Rain.", messages=messages, system=system, tools=[WEATHER])
    got = srv.app.tokenizer.messages
    assert [m["role"] for m in got] == ["system", "user", "assistant", "tool", "tool", "user"]
    assert got[0]["content"] == "Be brief.\nBe kind." and got[1]["content"] == "Weather?"
    assistant = got[2]
    assert assistant["content"] == "Checking." and assistant["reasoning_content"] == "look it up"
    assert assistant["tool_calls"] == [
        {
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
            "id": "toolu_1",
        }
    ]
    assert got[3] == {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"}
    assert got[4]["content"] == "Error: no such city" and got[4]["tool_call_id"] == "toolu_2"
    assert got[5]["content"] == "And tomorrow?"
    assert (
        srv.app.tokenizer.template_vars["tools"][0]["function"]["parameters"]
        == (WEATHER["input_schema"])
    )
    assert r["content"] == [{"type": "text", "text": "Rain."}]


def test_a_final_assistant_turn_is_continued(srv: SimpleNamespace) -> None:
    messages = [*HI, {"role": "assistant", "content": "The answer is ("}]
    r = _create(srv, "B)", messages=messages)
    assert r["content"] == [{"type": "text", "text": "B)"}]
    rendered = srv.engine.prompts[r["id"] + "-0"]["prompt"]
    assert rendered.endswith("<assistant>The answer is (\n")  # no new assistant turn opened
    assert srv.app.tokenizer.template_vars["continue_final_message"] is True
    # an empty one prefills nothing: a fresh assistant turn
    r = _create(srv, "Hi!", messages=[*HI, {"role": "assistant", "content": ""}])
    assert srv.engine.prompts[r["id"] + "-0"]["prompt"] == "<user>Hi\n<assistant>"


def test_stop_reasons(srv: SimpleNamespace) -> None:
    r = _create(srv, "one two three", stop_sequences=["two", "zzz"])
    assert r["content"][0]["text"] == "one "
    assert (r["stop_reason"], r["stop_sequence"]) == ("stop_sequence", "two")
    r = _create(srv, "Hello there.", max_tokens=3)
    assert r["stop_reason"] == "max_tokens" and r["content"][0]["text"] == "Hel"
    # max_tokens over the room the context leaves is cut to it: the window ends the answer
    room = 512 - _prompt_len(("user", "Hi"))
    r = _create(srv, "z" * 600, max_tokens=100_000)
    assert r["stop_reason"] == "model_context_window_exceeded"
    assert r["usage"]["output_tokens"] == room
    events = _events(srv, "z" * 600, max_tokens=100_000)
    assert events[-2]["delta"]["stop_reason"] == "model_context_window_exceeded"
    message = _error(srv, 400, messages=[{"role": "user", "content": "x" * 600}])
    assert message.startswith("prompt is too long: ")  # the words clients look for


def test_thinking_is_its_own_block(srv: SimpleNamespace) -> None:
    script = "<think>plan it</think>The answer."
    r = _create(srv, script)
    thinking, text = r["content"]
    assert thinking["type"] == "thinking" and thinking["thinking"] == "plan it"
    assert isinstance(thinking["signature"], str) and thinking["signature"]
    assert text == {"type": "text", "text": "The answer."}

    events = _events(srv, script)
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    blocks = _joined(events)
    assert [b["type"] for b in blocks] == ["thinking", "text"]
    assert blocks[0]["thinking"] == "plan it" and blocks[0]["signature"]
    assert blocks[1]["text"] == "The answer."

    # thinking on / off reach the chat template; a budget is the engine's thinking budget
    r = _create(srv, "x", thinking={"type": "enabled", "budget_tokens": 1024})
    assert srv.app.tokenizer.template_vars["enable_thinking"] is True
    assert srv.engine.params[r["id"] + "-0"].thinking_token_budget == 1024
    _create(srv, "x", thinking={"type": "disabled"})
    assert srv.app.tokenizer.template_vars["enable_thinking"] is False
    # display "omitted": the block stays (its signature too), its text does not
    omitted = {"type": "adaptive", "display": "omitted"}
    r = _create(srv, script, thinking=omitted)
    assert r["content"][0]["thinking"] == "" and r["content"][1]["text"] == "The answer."
    blocks = _joined(_events(srv, script, thinking=omitted))
    assert blocks[0]["thinking"] == "" and blocks[0]["signature"]
    assert blocks[1]["text"] == "The answer."


def test_a_stream_is_anthropics_event_sequence(srv: SimpleNamespace) -> None:
    events = _events(srv, "Hello there.", stop_sequences=["there"])
    kinds = [e["type"] for e in events]
    n = kinds.count("content_block_delta")
    assert n >= 1
    assert kinds == [
        "message_start",
        "ping",
        "content_block_start",
        *["content_block_delta"] * n,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0]["message"]
    assert (
        start["content"] == []
        and start["stop_reason"] is None
        and start["id"].startswith("chatcmpl-")
    )
    assert _joined(events) == [{"type": "text", "text": "Hello "}]
    delta = events[-2]
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "there"}
    whole = _create(srv, "Hello there.", stop_sequences=["there"])
    assert delta["usage"] == whole["usage"]


def test_tool_use_whole_and_streamed(srv: SimpleNamespace) -> None:
    r = _create(srv, CALL_SCRIPT, tools=[WEATHER])
    text, call = r["content"]
    assert text == {"type": "text", "text": "Let me look.\n"}  # as written (vLLM's hermes)
    assert call["type"] == "tool_use" and call["name"] == "get_weather"
    assert call["input"] == {"city": "Paris"} and call["id"]
    assert r["stop_reason"] == "tool_use"

    events = _events(srv, CALL_SCRIPT, tools=[WEATHER])
    blocks = _joined(events)
    assert [b["type"] for b in blocks] == ["text", "tool_use"]
    assert blocks[1]["input"] == {"city": "Paris"} and blocks[1]["name"] == "get_weather"
    assert events[-2]["delta"]["stop_reason"] == "tool_use"

    # tool_choice "tool" and "any" force the call (structured outputs)
    r = _create(
        srv,
        '{"city": "Oslo"}',
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    (call,) = r["content"]
    assert call["input"] == {"city": "Oslo"} and r["stop_reason"] == "tool_use"
    assert srv.engine.params[r["id"] + "-0"].structured_outputs.json == WEATHER["input_schema"]
    script = '[{"name": "get_weather", "parameters": {"city": "Rome"}}]'
    choice = {"type": "any", "disable_parallel_tool_use": True}
    events = _events(srv, script, tools=[WEATHER], tool_choice=choice)
    (call,) = _joined(events)
    assert call["input"] == {"city": "Rome"}
    forced = srv.engine.params[events[0]["message"]["id"] + "-0"].structured_outputs.json
    assert forced["minItems"] == forced["maxItems"] == 1  # disable_parallel_tool_use: one call
    # tool_choice "none": the text stays text
    r = _create(srv, CALL_SCRIPT, tools=[WEATHER], tool_choice={"type": "none"})
    assert r["content"] == [{"type": "text", "text": CALL_SCRIPT}]
    assert r["stop_reason"] == "end_turn"


def test_output_format_constrains_the_output(srv: SimpleNamespace) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "schema": schema}
    for body in ({"output_config": {"format": fmt, "effort": "max"}}, {"output_format": fmt}):
        r = _create(srv, '{"a": 1}', **body)
        assert srv.engine.params[r["id"] + "-0"].structured_outputs.json == schema
        assert r["content"] == [{"type": "text", "text": '{"a": 1}'}]


# ---- errors --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, "'document'"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].source.type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
            "messages[0].content[0].tool_use_id",
        ),
        ({"stop_sequences": "x"}, "stop_sequences"),
        ({"temperature": -1}, "temperature"),
        ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
        ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
        ({"output_config": {"format": {"type": "text"}}}, "output_config.format"),
        ({"mcp_servers": []}, "mcp_servers"),
        ({"frequency_penalty": 1}, "frequency_penalty"),
    ],
)
def test_bad_requests_are_anthropic_400s(srv: SimpleNamespace, body: dict, words: str) -> None:
    assert words in _error(srv, 400, **body)


def test_unknown_models_routes_and_methods_are_anthropic_errors(srv: SimpleNamespace) -> None:
    assert "claude-x" in _error(srv, 404, model="claude-x")
    status, _, payload = srv.http.request("GET", "/v1/messages")
    assert status == 405 and payload["error"]["type"] == "invalid_request_error"
    status, _, payload = srv.http.request("POST", "/v1/messages/nope", {})
    assert status == 404 and payload == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "route /v1/messages/nope not found"},
    }
    status, _, payload = srv.http.request("POST", "/v1/messages", b"{oops")
    assert status == 400 and payload["type"] == "error"


def test_an_engine_failure_mid_stream_is_an_error_event(
    srv: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def boom(req, seq) -> int:
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("boom")
        return ord("a") + 3

    monkeypatch.setattr(srv.engine, "_next_token", boom)
    events = _events(srv, "x")
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "error"
    assert events[-1]["error"]["type"] == "api_error" and "message_stop" not in [
        e["type"] for e in events
    ]
    monkeypatch.undo()
    assert _create(srv, "ok")["content"][0]["text"] == "ok"


def test_a_disconnected_stream_is_aborted(srv: SimpleNamespace) -> None:
    engine = srv.engine
    engine.script = "z" * 400
    before = engine.gen_tokens
    conn = srv.http.conn(10)
    body = {"model": "tiny", "max_tokens": 400, "messages": HI, "stream": True}
    conn.request("POST", "/v1/messages", json.dumps(body), HEADERS)
    r = conn.getresponse()
    assert r.status == 200 and r.readline()  # the stream began
    conn.close()
    deadline = time.monotonic() + 10
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.has_unfinished_requests()
    assert engine.gen_tokens - before < 400 and "abort_request" in engine.threads


def test_images_on_a_text_model_are_400s_naming_the_block(srv: SimpleNamespace) -> None:
    png = base64.b64encode(b"\x89PNG").decode()
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "What?"}, image]}]
    assert "messages[0].content[1]" in _error(srv, 400, messages=messages)
    result = {"type": "tool_result", "tool_use_id": "t", "content": [image]}
    messages = [{"role": "user", "content": [result]}]
    assert "messages[0].content[0].content[0]" in _error(srv, 400, messages=messages)


def test_images_become_image_parts_in_order() -> None:
    """On a model that takes images: a tool result's images open the user message after the
    tool messages (a tool message holds text only); each image keeps its block's name."""
    from paged_server.anthropic_request import parse_messages

    def image(url: str) -> dict:
        return {"type": "image", "source": {"type": "url", "url": url}}

    turn = [
        {"type": "tool_result", "tool_use_id": "a", "content": [image("https://x/1.png")]},
        {"type": "tool_result", "tool_use_id": "b", "content": "no picture"},
        image("https://x/2.png"),
        {"type": "text", "text": "Compare them."},
    ]
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": turn}]}
    req = parse_messages(body, None, images=True, budget_ok=False)
    chat = req.chat.messages
    assert [m["role"] for m in chat] == ["tool", "tool", "user"]
    assert chat[0]["content"] == "" and chat[1]["content"] == "no picture"
    assert [p["type"] for p in chat[2]["content"]] == ["image", "image", "text"]
    want = ["messages[0].content[0].content[0]", "messages[0].content[2]"]
    assert [r.param for r in req.chat.media_refs] == want
    assert [r.url for r in req.chat.media_refs] == ["https://x/1.png", "https://x/2.png"]


# ---- the official client on a real model ---------------------------------------------------
def test_anthropic_client_on_a_real_model_matches_chat_completions(
    guarded_server: ServerProc,
) -> None:
    """The official `anthropic` client (its `x-api-key` header), whole and streamed, against a
    real engine: the answer, its usage and stop reason equal chat completions'."""
    openai = pytest.importorskip("openai")
    url = guarded_server.url
    chat_client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    prompt = "Paris is in France. " * 6 + "The capital of France is"
    chat = chat_client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=8, temperature=0
    )
    want = chat.choices[0].message.content
    client = anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0)
    kwargs = {
        "model": "tiny",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": prompt}],
        "extra_body": {"temperature": 0},  # (not in this SDK's signature; older ones send it)
    }
    m = client.messages.create(**kwargs)
    assert m.content[0].text == want
    usage = m.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    finish = chat.choices[0].finish_reason
    assert m.stop_reason == ("max_tokens" if finish == "length" else "end_turn")
    count = client.messages.count_tokens(model="tiny", messages=kwargs["messages"])
    assert count.input_tokens == chat.usage.prompt_tokens
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == want and final.stop_reason == m.stop_reason
    # the same prompt again: the prefix cache served its full blocks, counted apart
    again = final.usage
    assert again.cache_read_input_tokens > 0
    assert again.input_tokens + again.cache_read_input_tokens == chat.usage.prompt_tokens

    bad = anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        bad.messages.create(**kwargs)
    assert err.value.body["error"]["type"] == "authentication_error"
    assert [model.id for model in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").max_input_tokens > 0
    # Anthropic's own header for the key (older SDKs and other clients send it)
    body = {"model": "tiny", "messages": kwargs["messages"]}
    for key, status in ((API_KEY, 200), ("wrong", 401)):
        got, _, payload = guarded_server.request(
            "POST", "/v1/messages/count_tokens", body, headers={"x-api-key": key}
        )
        assert got == status, payload
    assert payload["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(**{**kwargs, "model": "claude-opus-4-1"})


def test_hostile_bodies_are_4xx_never_500(srv: SimpleNamespace) -> None:
    """Any JSON in any field (lone surrogates too) is answered 200 or an Anthropic 4xx; the
    server goes on serving."""
    hypothesis = pytest.importorskip("hypothesis")
    from fuzz_text import any_json

    st = hypothesis.strategies
    values = any_json()
    block_types = st.sampled_from(["text", "image", "tool_use", "tool_result", "thinking", "x"])
    blocks = st.fixed_dictionaries({"type": block_types}, optional={
        "text": values, "source": values, "id": values, "name": values, "input": values,
        "tool_use_id": values, "content": values, "is_error": values, "thinking": values,
    })  # fmt: skip
    message = st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "tool"])},
        optional={"content": st.text(max_size=5) | st.lists(blocks, max_size=3) | values},
    )
    fields = st.fixed_dictionaries({}, optional={
        "messages": st.lists(message, max_size=3) | values, "system": values, "tools": values,
        "tool_choice": values, "thinking": values, "stop_sequences": values, "metadata": values,
        "output_config": values, "max_tokens": values, "stream": values, "top_k": values,
    })  # fmt: skip

    @hypothesis.settings(max_examples=80, deadline=None, database=None)
    @hypothesis.given(fields)
    def check(body: dict) -> None:
        body = {"model": "tiny", "max_tokens": 4, "messages": HI, **body}
        status, _, payload = srv.http.request("POST", "/v1/messages", body)
        assert status == 200 or (400 <= status < 500 and payload["type"] == "error"), payload

    srv.engine.script = "ok"
    check()
    assert _create(srv, "fine")["content"][0]["text"] == "fine"


def test_models_in_anthropics_shape_for_anthropic_clients(srv: SimpleNamespace) -> None:
    """With the `anthropic-version` header (Anthropic's SDKs send it) the model routes answer
    Anthropic's shape, validated against the SDK's types; without it, OpenAI's."""
    from anthropic.types import ModelInfo

    version = {"anthropic-version": "2023-06-01"}
    status, _, page = srv.http.request("GET", "/v1/models", headers=version)
    assert status == 200 and page["has_more"] is False, page
    (model,) = page["data"]
    ModelInfo.model_validate(model)
    assert model["id"] == page["first_id"] == page["last_id"] == "tiny"
    assert model["max_input_tokens"] == 512
    status, _, one = srv.http.request("GET", "/v1/models/tiny", headers=version)
    assert status == 200 and one == model
    status, _, missing = srv.http.request("GET", "/v1/models/claude-x", headers=version)
    assert status == 404 and missing["error"]["type"] == "not_found_error", missing
    for query in ("?limit=0", "?after_id=nope"):
        status, _, bad = srv.http.request("GET", "/v1/models" + query, headers=version)
        assert status == 400 and bad["type"] == "error", bad
    status, _, page = srv.http.request("GET", "/v1/models?after_id=tiny", headers=version)
    assert page == {"data": [], "has_more": False, "first_id": None, "last_id": None}
    assert srv.http.request("GET", "/v1/models")[2]["object"] == "list"  # OpenAI's
