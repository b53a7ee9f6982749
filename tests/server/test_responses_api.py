"""`/v1/responses` (OpenAI's Responses API): shapes, errors, stream events, tool calls, reasoning,
store / retrieve / previous_response_id over a ScriptedEngine in this process (the model's text is
set per test), every body and event checked against the installed `openai` package's types; then
the official client against a real tiny llama, where the answer must equal chat completions'."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
from fake_engine import ScriptedEngine
from server_proc import HEADERS, ServerProc, serve_in_process, typed_events

from paged_server.errors import APIError
from paged_server.responses_api import ResponseStore, StoredResponse

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402

STREAM_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
ARGS = ["--max-model-len", "2048", "--served-model-name", "tiny", "--client-timeout", "3"]
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CALL_SCRIPT = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call>"
)


@pytest.fixture(scope="module")
def srv() -> Iterator[SimpleNamespace]:
    engine = ScriptedEngine(max_model_len=2048, step_time=0.0005)
    args = [*ARGS, "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
    with serve_in_process(args, engine) as (http, app):
        yield SimpleNamespace(http=http, engine=engine, app=app)


def _post(srv: SimpleNamespace, script: str, **body) -> tuple[int, dict]:
    srv.engine.script = script
    status, _, payload = srv.http.request("POST", "/v1/responses", body)
    return status, payload


def _create(srv: SimpleNamespace, script: str, **body) -> dict:
    status, payload = _post(srv, script, **body)
    assert status == 200, payload
    Response.model_validate(payload)  # the SDK's own type, validated (not just constructed)
    return payload


def _events(srv: SimpleNamespace, script: str, **body) -> list[dict]:
    """Every event of a stream; checks each against the SDK's types and the sequence numbers
    0, 1, 2, ..."""
    srv.engine.script = script
    events = typed_events(srv.http, "/v1/responses", body)
    for event in events:
        STREAM_EVENT.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def _prompt_len(*messages: tuple[str, str]) -> int:
    """The fake chat template's token count: one token per byte of `<role>content\\n`."""
    return len("".join(f"<{r}>{c}\n" for r, c in messages).encode()) + len("<assistant>")


# ---- the response object -----------------------------------------------------------------
def test_text_response_shape_and_echo(srv: SimpleNamespace) -> None:
    r = _create(
        srv,
        "Hello there.",
        model="tiny",
        input="Hi",
        instructions="Be brief.",
        metadata={"k": "v"},
        temperature=0.5,
        user="u1",
        store=False,
    )
    assert r["id"].startswith("resp_") and r["object"] == "response"
    assert r["status"] == "completed" and r["error"] is None and r["incomplete_details"] is None
    assert r["model"] == "tiny" and isinstance(r["created_at"], int)
    (msg,) = r["output"]
    assert msg["type"] == "message" and msg["id"].startswith("msg_")
    assert (msg["role"], msg["status"]) == ("assistant", "completed")
    assert msg["content"] == [
        {"type": "output_text", "text": "Hello there.", "annotations": [], "logprobs": []}
    ]
    assert Response.model_validate(r).output_text == "Hello there."
    u = r["usage"]
    assert u["input_tokens"] == _prompt_len(("system", "Be brief."), ("user", "Hi"))
    assert u["output_tokens"] == len("Hello there.") + 1  # and the EOS token
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
    assert u["input_tokens_details"]["cached_tokens"] == 0
    assert u["output_tokens_details"] == {"reasoning_tokens": 0}
    echo = {k: r[k] for k in ("instructions", "metadata", "temperature", "top_p", "user")}
    assert echo == {
        "instructions": "Be brief.",
        "metadata": {"k": "v"},
        "temperature": 0.5,
        "top_p": 1.0,
        "user": "u1",
    }
    assert (r["tools"], r["tool_choice"], r["parallel_tool_calls"]) == ([], "auto", True)
    assert r["text"] == {"format": {"type": "text"}} and r["previous_response_id"] is None
    assert r["max_output_tokens"] is None and r["store"] is False
    params = srv.engine.params[r["id"] + "-0"]
    assert params.temperature == 0.5 and params.structured_outputs is None


def test_input_items_become_the_chat_messages(srv: SimpleNamespace) -> None:
    items = [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
        {
            "type": "message",
            "id": "msg_1",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "b", "annotations": []}],
        },
        {"type": "reasoning", "id": "rs_1", "summary": []},  # a past turn's: dropped
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "c"}, {"type": "input_text", "text": "d"}],
        },
    ]
    r = _create(srv, "ok", input=items)
    want = (("system", "Rules."), ("user", "a"), ("assistant", "b"), ("user", "c\nd"))
    assert r["usage"]["input_tokens"] == _prompt_len(*want)


def test_reasoning_items_sent_back_reach_the_template() -> None:
    """A reasoning item (what /v1/responses returns, sent back by agent loops: the Agents SDK,
    Haystack) is the `reasoning_content` of the assistant turn it opens: its message or its
    function calls join it, so a template that keeps the current turn's thinking (Qwen3's)
    renders it as the chat path would; the same through previous_response_id. vLLM reads the
    item's content text too. Encrypted reasoning (never returned here) is a 400."""
    from paged_server.responses_api import _context_items
    from paged_server.responses_request import parse_responses

    def reasoning(text: str) -> dict:
        return {"type": "reasoning", "id": "rs_1", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip

    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    items = [
        {"role": "user", "content": "a"},
        reasoning("plan a"),
        {"role": "assistant", "content": "A."},
        {"role": "user", "content": "b"},
        reasoning("plan b"),
        call,
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "sum"}]},
        reasoning("more"),  # two in a row: one turn's thinking
    ]
    chat = parse_responses({"input": items}, "hermes", ResponseStore()).chat
    got = [(m["role"], m.get("content"), m.get("reasoning_content")) for m in chat.messages]
    assert got == [
        ("user", "a", None),
        ("assistant", "A.", "plan a"),
        ("user", "b", None),
        ("assistant", "", "plan b"),  # (parse_chat: no content is "")
        ("tool", "42", None),
        ("assistant", "", "sum\nmore"),  # the summary's text where there is no content
    ]
    assert chat.messages[3]["tool_calls"][0]["id"] == "c1"
    # previous_response_id: the stored output's reasoning comes back with its turn
    store = ResponseStore()
    output = [reasoning("think"), {"type": "function_call", **call, "id": "fc_1"}]
    context = [{"type": "message", "role": "user", "content": "q"}, *_context_items(output)]
    store.put(StoredResponse({"id": "resp_1", "status": "completed"}, context))
    body = {"previous_response_id": "resp_1", "input": [call | {"type": "function_call_output",
            "output": "1"}]}  # fmt: skip
    body["input"][0].pop("name"), body["input"][0].pop("arguments")
    chat = parse_responses(body, "hermes", store).chat
    assert [(m["role"], m.get("reasoning_content")) for m in chat.messages] == [
        ("user", None), ("assistant", "think"), ("tool", None)
    ]  # fmt: skip
    secret = {
        "input": [{"role": "user", "content": "x"}, {**reasoning(""), "encrypted_content": "e"}]
    }
    with pytest.raises(APIError) as e:
        parse_responses(secret, None, ResponseStore())
    assert e.value.status == 400 and e.value.param == "input[1].encrypted_content"


# ---- errors -------------------------------------------------------------------------------
BAD = [
    ({}, "input"),
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": ["hi"]}, "input[0]"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": 3}]}, "input[0].content"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
        "input[0].content[0]",
    ),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]"),
    (
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
        "input[0].arguments",
    ),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": "x", "bogus": 1}, "bogus"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "background": "yes"}, "background"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "include": ["message.output_text.bogus"]}, "include"),
    ({"input": "x", "include": "reasoning.encrypted_content"}, "include"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
    ({"input": "x", "truncation": "middle"}, "truncation"),  # "auto" and "disabled" are taken
    ({"input": "x", "reasoning": {"effort": "max"}}, "reasoning.effort"),  # low | medium | high
    ({"input": "x", "reasoning": {"summary": "brief"}}, "reasoning.summary"),
    ({"input": "x", "instructions": ["x"]}, "instructions"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata"),
    ({"input": "x", "store": "yes"}, "store"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "x", "tools": [{**WEATHER, "defer_loading": True}]}, "tools[0].defer_loading"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "mcp"}}, "tool_choice"),
    (
        {"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "f"}},
        "tool_choice",
    ),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity"),
    (
        {
            "input": "x",
            "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": 5}}},
        },
        "text.format",
    ),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 5000}, "max_output_tokens"),  # over the context
    ({"input": "x" * 3000}, "input"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
]


@pytest.mark.parametrize(("body", "param"), BAD)
def test_bad_requests_are_400s_naming_the_parameter(
    srv: SimpleNamespace, body: dict, param: str
) -> None:
    status, payload = _post(srv, "x", **body)
    assert status == 400, payload
    assert payload["error"]["param"] == param, payload
    assert payload["error"]["type"] == "invalid_request_error"


def test_unknown_model_and_response_ids_are_404s(srv: SimpleNamespace) -> None:
    status, payload = _post(srv, "x", model="nope", input="x")
    assert status == 404 and payload["error"]["param"] == "model"
    for method in ("GET", "DELETE"):
        status, _, payload = srv.http.request(method, "/v1/responses/resp_nope")
        assert status == 404 and payload["error"]["code"] == "not_found"


# ---- streams ------------------------------------------------------------------------------
def test_a_stream_is_openais_event_sequence(srv: SimpleNamespace) -> None:
    events = _events(srv, "Hello there.", input="Hi", store=False)
    kinds = [e["type"] for e in events]
    n = kinds.count("response.output_text.delta")
    assert n >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * n,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert (
        events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    )
    item_id = events[2]["item"]["id"]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert all(
        (d["item_id"], d["output_index"], d["content_index"]) == (item_id, 0, 0) for d in deltas
    )
    assert "".join(d["delta"] for d in deltas) == "Hello there." == events[-4]["text"]
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"] == [events[-2]["item"]]
    assert final["id"] == events[0]["response"]["id"]
    whole = _create(srv, "Hello there.", input="Hi", store=False)
    assert final["usage"] == whole["usage"]
    assert final["output"][0]["content"] == whole["output"][0]["content"]


def test_incomplete_when_max_output_tokens_cuts_it(srv: SimpleNamespace) -> None:
    r = _create(srv, "Hello there.", input="Hi", max_output_tokens=3)
    assert r["status"] == "incomplete" and r["incomplete_details"] == {
        "reason": "max_output_tokens"
    }
    assert r["output"][0]["status"] == "incomplete" and r["max_output_tokens"] == 3
    assert r["output"][0]["content"][0]["text"] == "Hel" and r["usage"]["output_tokens"] == 3
    events = _events(srv, "Hello there.", input="Hi", max_output_tokens=3)
    final = events[-1]
    assert final["type"] == "response.completed"  # vLLM's (the SDK's stream helper needs it)
    assert final["response"]["status"] == "incomplete"
    assert final["response"]["output"][0]["status"] == "incomplete"


def test_an_engine_failure_mid_stream_is_response_failed(
    srv: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(req, seq) -> int:
        raise RuntimeError("boom")

    monkeypatch.setattr(srv.engine, "_next_token", boom)
    events = _events(srv, "x", input="x")
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.failed",
    ]
    response = events[-1]["response"]
    assert response["status"] == "failed" and response["error"]["code"] == "server_error"
    assert srv.http.request("GET", f"/v1/responses/{response['id']}")[0] == 404
    monkeypatch.undo()
    assert _create(srv, "ok", input="x")["output"][0]["content"][0]["text"] == "ok"


def test_a_disconnected_stream_is_aborted(srv: SimpleNamespace) -> None:
    engine = srv.engine
    engine.script = "z" * 1500
    before = engine.gen_tokens
    conn = srv.http.conn(10)
    conn.request("POST", "/v1/responses", json.dumps({"input": "x", "stream": True}), HEADERS)
    r = conn.getresponse()
    assert r.status == 200 and r.readline()  # the stream began
    conn.close()
    deadline = time.monotonic() + 10
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.has_unfinished_requests()
    assert engine.gen_tokens - before < 1500 and "abort_request" in engine.threads


# ---- tools and reasoning ------------------------------------------------------------------
def test_tool_calls_whole_and_streamed_then_the_round_trip(srv: SimpleNamespace) -> None:
    r = _create(srv, CALL_SCRIPT, input="Weather in Paris?", tools=[WEATHER])
    msg, call = r["output"]
    assert msg["content"][0]["text"] == "Let me look.\n"  # as written (vLLM's hermes)
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    assert json.loads(call["arguments"]) == {"city": "Paris"} and call["status"] == "completed"
    assert r["status"] == "completed" and r["tools"] == [{**WEATHER, "strict": None}]

    events = _events(srv, CALL_SCRIPT, input="Weather in Paris?", tools=[WEATHER])
    kinds = [e["type"] for e in events]
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [a["item"]["type"] for a in added] == ["message", "function_call"]
    assert kinds.index("response.function_call_arguments.delta") > kinds.index(
        "response.output_text.done"
    )  # the message closed before the call opened
    args = "".join(
        e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
    )
    (done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert json.loads(args) == {"city": "Paris"} and done["arguments"] == args
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert final["output"][1]["call_id"] == added[1]["item"]["call_id"]

    # the call and its output go back as input items: an assistant turn, then a tool message
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        call,
        {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"},
    ]
    r = _create(srv, "It is sunny.", input=items, tools=[WEATHER])
    want = (("user", "Weather in Paris?"), ("assistant", ""), ("tool", "sunny"))
    assert r["usage"]["input_tokens"] == _prompt_len(*want)
    assert Response.model_validate(r).output_text == "It is sunny."


def test_forced_tool_calls_and_text_format_constrain_the_output(srv: SimpleNamespace) -> None:
    named = {"type": "function", "name": "get_weather"}
    r = _create(srv, '{"city": "Oslo"}', input="x", tools=[WEATHER], tool_choice=named)
    (call,) = r["output"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Oslo"}
    assert srv.engine.params[r["id"] + "-0"].structured_outputs.json == WEATHER["parameters"]
    assert r["tool_choice"] == named
    script = '[{"name": "get_weather", "parameters": {"city": "Rome"}}]'
    events = _events(srv, script, input="x", tools=[WEATHER], tool_choice="required")
    (call,) = events[-1]["response"]["output"]
    assert json.loads(call["arguments"]) == {"city": "Rome"}
    assert "response.function_call_arguments.delta" in [e["type"] for e in events]

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    r = _create(srv, '{"a": 1}', input="x", text={"format": fmt})
    assert srv.engine.params[r["id"] + "-0"].structured_outputs.json == schema
    assert (
        r["text"]["format"]["name"] == "thing"
        and r["output"][0]["content"][0]["text"] == '{"a": 1}'
    )
    r = _create(srv, "{}", input="x", text={"format": {"type": "json_object"}})
    assert srv.engine.params[r["id"] + "-0"].structured_outputs.json_object is True


def test_reasoning_is_its_own_output_item(srv: SimpleNamespace) -> None:
    script = "<think>plan it</think>The answer."
    r = _create(srv, script, input="x")
    reasoning, msg = r["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "plan it"}]
    assert msg["content"][0]["text"] == "The answer."
    assert r["usage"]["output_tokens_details"]["reasoning_tokens"] == len("plan it")

    events = _events(srv, script, input="x")
    kinds = [e["type"] for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert events[3]["part"]["type"] == "reasoning_text"
    text = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert text == "plan it" and kinds.index("response.reasoning_text.done") < kinds.index(
        "response.output_text.delta"
    )
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert final["output"][1]["content"][0]["text"] == "The answer."


def test_logprobs_of_the_message_text(srv: SimpleNamespace) -> None:
    """include "message.output_text.logprobs" (+ top_logprobs): the message's tokens' logprobs
    (the reasoning's not among them), whole and streamed alike; the other include values
    clients send (encrypted reasoning, built-in tools' extras) are taken and add nothing."""
    include = ["message.output_text.logprobs", "reasoning.encrypted_content"]
    r = _create(srv, "<think>plan</think>Yes.", input="x", include=include, top_logprobs=1)
    assert srv.engine.params[r["id"] + "-0"].logprobs == 1
    assert r["top_logprobs"] == 1
    text = r["output"][1]["content"][0]
    assert text["text"] == "Yes." and [e["token"] for e in text["logprobs"]] == list("Yes.")
    assert all(len(e["top_logprobs"]) == 1 for e in text["logprobs"])
    assert r["output"][0]["type"] == "reasoning"
    events = _events(srv, "<think>plan</think>Yes.", input="x", include=include, top_logprobs=1)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [lp for d in deltas for lp in d["logprobs"]] == text["logprobs"]
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert done["logprobs"] == text["logprobs"]
    assert events[-1]["response"]["output"][1]["content"][0]["logprobs"] == text["logprobs"]
    # without the include value: no logprobs asked of the engine
    r = _create(srv, "Yes.", input="x", top_logprobs=2)
    assert r["output"][0]["content"][0]["logprobs"] == []
    assert srv.engine.params[r["id"] + "-0"].logprobs is None


def test_span_logprobs_takes_the_answers_own_tokens() -> None:
    """The message's tokens are found after the reasoning, even when the reasoning holds the
    same text."""
    from paged_server.chat_output import span_logprobs

    pieces = ["<think>", "Yes", ".", "</think>", "Ye", "s."]
    entries = [{"i": i} for i in range(6)]
    assert span_logprobs(entries, pieces, "Yes.", after="Yes.") == [{"i": 4}, {"i": 5}]
    assert span_logprobs(entries, pieces, "Yes.") == [{"i": 1}, {"i": 2}]  # no anchor: first
    assert span_logprobs(entries, pieces, "es") == [{"i": 1}]
    assert span_logprobs(entries, pieces, "nope") == span_logprobs(entries, pieces, "") == []


# ---- store, retrieve, previous_response_id -------------------------------------------------
def test_a_next_turn_sent_at_once_finds_the_response(srv: SimpleNamespace, monkeypatch) -> None:
    """A response is stored before the client sees it end: a client that sends the next turn
    the moment it has the answer (whole or streamed) finds it, however slowly the server's
    thread winds down after sending."""
    wind_down = srv.app._in_flight

    @contextmanager
    def slow(*args):
        with wind_down(*args):
            yield
        time.sleep(0.3)  # the handler thread, after its last byte went out

    monkeypatch.setattr(srv.app, "_in_flight", slow)
    first = _create(srv, "Blue.", input="Favourite colour?")
    second = _create(srv, "Red.", input="And yours?", previous_response_id=first["id"])
    third = _events(srv, "Green.", input="Why?", previous_response_id=second["id"])[-1]
    _create(srv, "Fine.", input="Ok.", previous_response_id=third["response"]["id"])


def test_store_retrieve_continue_and_delete(srv: SimpleNamespace) -> None:
    first = _create(srv, "Blue.", input="Favourite colour?", instructions="Be brief.")
    status, _, got = srv.http.request("GET", f"/v1/responses/{first['id']}")
    assert status == 200 and got == first and first["store"] is True

    second = _create(srv, "Red.", input="And yours?", previous_response_id=first["id"])
    assert second["previous_response_id"] == first["id"]
    # the first turn's input and output lead; its instructions are not carried over
    want = (("user", "Favourite colour?"), ("assistant", "Blue."), ("user", "And yours?"))
    assert second["usage"]["input_tokens"] == _prompt_len(*want)
    third = _events(srv, "Green.", input="Why?", previous_response_id=second["id"])[-1]["response"]
    want = (*want, ("assistant", "Red."), ("user", "Why?"))
    assert third["usage"]["input_tokens"] == _prompt_len(*want)
    status, _, got = srv.http.request("GET", f"/v1/responses/{third['id']}")
    assert status == 200 and got == third  # streamed ones are stored too

    status, _, payload = srv.http.request("DELETE", f"/v1/responses/{first['id']}")
    assert status == 200 and payload == {"id": first["id"], "object": "response", "deleted": True}
    assert srv.http.request("GET", f"/v1/responses/{first['id']}")[0] == 404
    unstored = _create(srv, "x", input="x", store=False)
    assert srv.http.request("GET", f"/v1/responses/{unstored['id']}")[0] == 404


def test_input_items_cancel_and_input_tokens(srv: SimpleNamespace) -> None:
    """OpenAI's sub-routes, answers validated with the `openai` package's types."""
    from openai.pagination import SyncCursorPage
    from openai.types.responses import ResponseItem
    from openai.types.responses.input_token_count_response import InputTokenCountResponse

    first = _create(srv, "Blue.", input="Favourite colour?")
    items = [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"role": "user", "content": [{"type": "input_text", "text": "So?"}]},
    ]
    second = _create(srv, "Go out.", input=items, previous_response_id=first["id"])
    status, _, page = srv.http.request("GET", f"/v1/responses/{second['id']}/input_items")
    assert status == 200, page
    SyncCursorPage[ResponseItem].model_validate(page)
    data = page["data"]  # this request's input alone, newest first
    assert [d["type"] for d in data] == [
        "message",
        "function_call_output",
        "function_call",
        "message",
    ]
    assert data[0]["content"] == [{"type": "input_text", "text": "So?"}]
    assert data[1]["output"] == "sunny" and data[2]["name"] == "get_weather"
    assert (page["first_id"], page["last_id"], page["has_more"]) == (
        data[0]["id"],
        data[-1]["id"],
        False,
    )
    path = f"/v1/responses/{second['id']}/input_items?order=asc&limit=2"
    status, _, asc = srv.http.request("GET", path)
    assert status == 200 and [d["id"] for d in asc["data"]] == [d["id"] for d in data[::-1][:2]]
    assert asc["has_more"] is True
    status, _, rest = srv.http.request("GET", f"{path}&after={asc['last_id']}")
    assert [d["id"] for d in rest["data"]] == [d["id"] for d in data[::-1][2:]]
    assert rest["has_more"] is False
    for query, param in (("limit=0", "limit"), ("order=up", "order"), ("after=x", "after")):
        status, _, err = srv.http.request(
            "GET", f"/v1/responses/{second['id']}/input_items?{query}"
        )
        assert status == 400 and err["error"]["param"] == param, err
    assert srv.http.request("GET", "/v1/responses/resp_nope/input_items")[0] == 404
    assert srv.http.request("GET", f"/v1/responses/{second['id']}/other")[0] == 404

    status, _, err = srv.http.request("POST", f"/v1/responses/{second['id']}/cancel")
    assert status == 400 and "synchronous" in err["error"]["message"], err
    assert srv.http.request("POST", "/v1/responses/resp_nope/cancel")[0] == 404

    body = {"model": "tiny", "input": "And yours?", "previous_response_id": first["id"]}
    status, _, count = srv.http.request("POST", "/v1/responses/input_tokens", body)
    assert status == 200, count
    InputTokenCountResponse.model_validate(count)
    want = (("user", "Favourite colour?"), ("assistant", "Blue."), ("user", "And yours?"))
    assert count == {"object": "response.input_tokens", "input_tokens": _prompt_len(*want)}
    assert _create(srv, "x", **body)["usage"]["input_tokens"] == count["input_tokens"]
    status, _, err = srv.http.request("POST", "/v1/responses/input_tokens", {"input": 3})
    assert status == 400 and err["error"]["param"] == "input", err


def test_the_store_is_a_bounded_lru() -> None:
    store = ResponseStore(capacity=2)
    for rid in ("a", "b"):
        store.put(StoredResponse({"id": rid}, []))
    assert store.get("a") is not None  # "b" is now the least recently used
    store.put(StoredResponse({"id": "c"}, []))
    assert store.get("b") is None and len(store) == 2
    assert store.get("a") is not None and store.get("c") is not None
    assert store.delete("a") and not store.delete("a") and len(store) == 1


def test_the_store_bounds_the_kept_background_events() -> None:
    """Background streamed responses keep every event for followers (~250 bytes a token): past
    max_event_bytes in all, the least recently used finished runs go first; a running one
    stays (its events still grow; the count bounds it)."""
    from paged_server.response_background import BackgroundRun

    store = ResponseStore(capacity=10, max_event_bytes=1000)

    def put(rid: str, size: int, ended: bool = True) -> None:
        stored = StoredResponse({"id": rid}, [])
        run = stored.run = BackgroundRun(stored, keep_events=True)
        run.send_event({"pad": "x" * size})
        run.ended = ended
        store.put(stored)

    put("running", 400, ended=False)
    put("old", 400)
    put("plain", 0)
    store.put(StoredResponse({"id": "no-run"}, []))
    assert len(store) == 4  # 2 x ~430 bytes: under the bound
    put("new", 400)  # ~1290 bytes: "old" (the LRU finished run) goes, "running" stays
    assert store.get("old") is None
    assert all(store.get(rid) is not None for rid in ("running", "plain", "no-run", "new"))


def test_the_store_bounds_the_kept_conversations() -> None:
    """Stored conversations hold their media's data URLs: past max_context_chars in all (their
    strings' characters), the least recently used go, never the one just stored."""
    store = ResponseStore(capacity=10, max_context_chars=1000)
    image = {"type": "input_image", "image_url": "data:image/png;base64," + "A" * 378}
    for rid in ("a", "b"):
        store.put(StoredResponse({"id": rid}, [{"type": "message", "content": [image]}]))
    assert len(store) == 2 and store.context_chars == 2 * (
        400 + len("input_image") + len("message")
    )
    assert store.get("a") is not None  # "b" is now the least recently used
    store.put(StoredResponse({"id": "c"}, [{"type": "message", "content": [image]}]))
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    huge = StoredResponse({"id": "huge"}, [{"type": "message", "content": "x" * 5000}])
    store.put(huge)  # alone past the bound: kept, everything older goes
    assert [rid for rid in "ac" if store.get(rid)] == [] and store.get("huge") is huge
    assert store.delete("huge") and store.context_chars == 0


# ---- the official client on a real model ---------------------------------------------------
def test_openai_client_on_a_real_model_matches_chat_completions(real_server: ServerProc) -> None:
    client = openai.OpenAI(base_url=real_server.url + "/v1", api_key="EMPTY", max_retries=0)
    prompt = "The capital of France is"
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=8, temperature=0
    )
    want = chat.choices[0].message.content
    r = client.responses.create(model="tiny", input=prompt, max_output_tokens=8, temperature=0)
    assert r.output_text == want
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert client.responses.retrieve(r.id).output_text == want
    (item,) = client.responses.input_items.list(r.id)
    assert item.type == "message" and item.content[0].text == prompt
    lp_chat = (
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=8,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
        )
        .choices[0]
        .logprobs.content
    )
    include = ["message.output_text.logprobs"]
    lp = client.responses.create(
        model="tiny", input=prompt, max_output_tokens=8, temperature=0, include=include,
        top_logprobs=2,
    ).output[0].content[0].logprobs  # fmt: skip
    assert [e.token for e in lp] == [e.token for e in lp_chat]
    assert [e.logprob for e in lp] == pytest.approx([e.logprob for e in lp_chat], abs=1e-5)
    assert [len(e.top_logprobs) for e in lp] == [2] * len(lp)
    count = client.responses.input_tokens.count(model="tiny", input=prompt)
    assert count.input_tokens == chat.usage.prompt_tokens

    with client.responses.stream(
        model="tiny", input=prompt, max_output_tokens=8, temperature=0
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == want
    chunks = client.responses.create(
        model="tiny", input=prompt, max_output_tokens=8, temperature=0, stream=True
    )
    assert [e.type for e in chunks][-1] == "response.completed"
