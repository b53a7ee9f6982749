"""`/v1/responses` with `truncation: "auto"`: a conversation that does not fit the context loses
its oldest turns (never the instructions or the opening system / developer messages, never a
function call without its output) and runs; "disabled" (the default) refuses it. Over a
ScriptedEngine in this process with a small context; the fake chat template takes one token
per byte of `<role>content\\n`, so every expected prompt is written out here."""

from __future__ import annotations

import math
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from fake_engine import ScriptedEngine
from server_proc import serve_in_process, typed_events

openai = pytest.importorskip("openai")
from openai.types.responses import Response  # noqa: E402

MAX_LEN = 256
ARGS = ["--max-model-len", str(MAX_LEN), "--served-model-name", "tiny", "--client-timeout", "3"]


@pytest.fixture(scope="module")
def srv() -> Iterator[SimpleNamespace]:
    engine = ScriptedEngine(max_model_len=MAX_LEN, step_time=0.0005)
    with serve_in_process(ARGS, engine) as (http, app):
        yield SimpleNamespace(http=http, engine=engine, app=app)


def _post(srv: SimpleNamespace, **body) -> tuple[int, dict]:
    srv.engine.script = "ok"
    status, _, payload = srv.http.request("POST", "/v1/responses", body)
    return status, payload


def _create(srv: SimpleNamespace, **body) -> dict:
    status, payload = _post(srv, **body)
    assert status == 200, payload
    Response.model_validate(payload)
    return payload


def _text(messages: list[tuple[str, str]]) -> str:
    """The fake chat template's prompt."""
    return "".join(f"<{r}>{c}\n" for r, c in messages) + "<assistant>"


def _sent(srv: SimpleNamespace, rid: str) -> str:
    """The prompt the engine was given for response `rid`."""
    return srv.engine.prompts[f"{rid}-0"]["prompt"]


def _turns(n: int, pad: int = 20) -> list[tuple[str, str]]:
    """n user / assistant exchanges, as (role, content)."""
    out = []
    for i in range(n):
        out += [("user", f"question {i} " + "q" * pad), ("assistant", f"answer {i} " + "a" * pad)]
    return out


def _items(messages: list[tuple[str, str]]) -> list[dict]:
    return [{"role": r, "content": c} for r, c in messages]


def _longest_tail(head: list[tuple[str, str]], turns: list[tuple[str, str]], budget: int) -> int:
    """Where the longest tail of whole turns (from a user message on) starts such that
    head + tail takes at most `budget` tokens."""
    starts = [i for i, (r, _) in enumerate(turns) if r == "user"]
    fitting = [i for i in starts if len(_text(head + turns[i:]).encode()) <= budget]
    return fitting[0]


# ---- a conversation that fits is untouched ------------------------------------------------
def test_a_conversation_that_fits_is_untouched(srv: SimpleNamespace) -> None:
    convo = [("developer", "Rules."), *_turns(2), ("user", "last")]
    rendered = [("system", "Be brief."), ("system", "Rules."), *convo[1:]]  # developer: system
    assert len(_text(rendered).encode()) < MAX_LEN
    r = _create(srv, input=_items(convo), instructions="Be brief.", truncation="auto")
    assert r["truncation"] == "auto" and r["status"] == "completed"
    assert _sent(srv, r["id"]) == _text(rendered)
    assert r["usage"]["input_tokens"] == len(_text(rendered))
    plain = _create(srv, input=_items(convo), instructions="Be brief.")
    assert plain["truncation"] == "disabled"
    assert plain["usage"]["input_tokens"] == r["usage"]["input_tokens"]


# ---- the oldest turns go, the opening messages stay ---------------------------------------
def test_the_oldest_turns_are_dropped_the_opening_messages_kept(srv: SimpleNamespace) -> None:
    head = [("system", "Be brief."), ("system", "Rules.")]  # as rendered (developer: system)
    turns = [*_turns(8), ("user", "last question")]
    assert len(_text(head + turns).encode()) >= MAX_LEN  # does not fit whole
    body = {"input": _items([("developer", "Rules."), *turns]), "instructions": "Be brief."}
    r = _create(srv, **body, truncation="auto")
    assert r["truncation"] == "auto"
    start = _longest_tail(head, turns, MAX_LEN - 1)  # max_output_tokens unset: shorter than it
    assert 0 < start < len(turns) - 1
    assert _sent(srv, r["id"]) == _text(head + turns[start:])
    assert r["usage"]["input_tokens"] == len(_text(head + turns[start:]))
    # an output budget leaves less room for the prompt
    r = _create(srv, **body, truncation="auto", max_output_tokens=60)
    later = _longest_tail(head, turns, MAX_LEN - 60)
    assert later > start and _sent(srv, r["id"]) == _text(head + turns[later:])
    assert r["usage"]["input_tokens"] + 60 <= MAX_LEN
    # the same request without "auto" is refused, as before
    for truncation in ({}, {"truncation": "disabled"}):
        status, payload = _post(srv, **body, **truncation)
        assert status == 400 and payload["error"]["param"] == "input", payload
    status, payload = _post(srv, **body, truncation="middle")
    assert status == 400 and payload["error"]["param"] == "truncation", payload


def test_a_function_call_keeps_its_output(srv: SimpleNamespace) -> None:
    def call(cid: str) -> dict:
        return {"type": "function_call", "call_id": cid, "name": "lookup", "arguments": "{}"}

    def output(cid: str, text: str) -> dict:
        return {"type": "function_call_output", "call_id": cid, "output": text}

    old = "o" * 60
    items = [
        {"role": "user", "content": "first " + old},
        call("c1"),
        output("c1", "result one " + old),
        {"role": "user", "content": "second " + old},
        call("c2"),
        {"role": "user", "content": "third, the answer to c2 comes after me"},
        output("c2", "result two " + "o" * 120),  # late: no cut between c2 and its output
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "fourth"},
    ]
    r = _create(srv, input=items, truncation="auto")
    # the cut before "third" would part c2 from its output: the kept tail starts at "fourth"
    assert _sent(srv, r["id"]) == _text([("user", "fourth")])
    # with room for more, the cut falls before "second": c2 and its output both kept
    items[0]["content"] = "first " + "o" * 150
    items[2]["output"] = "result one"
    items[6]["output"] = "result two"
    r = _create(srv, input=items, truncation="auto")
    kept = [
        ("user", "second " + old),
        ("assistant", ""),
        ("user", "third, the answer to c2 comes after me"),
        ("tool", "result two"),
        ("assistant", "done"),
        ("user", "fourth"),
    ]
    assert _sent(srv, r["id"]) == _text(kept)
    rendered = srv.app.tokenizer.messages  # the fake tokenizer keeps the last render's
    tool_ids = [m.get("tool_call_id") for m in rendered]
    calls = [c["id"] for m in rendered for c in m.get("tool_calls") or ()]
    assert [t for t in tool_ids if t] == calls == ["c2"]


def test_the_previous_responses_turns_are_dropped_first(srv: SimpleNamespace) -> None:
    first = _create(srv, input=_items(_turns(3, pad=25)[:-1]), instructions="Old rules.")
    second = _create(
        srv,
        input="and now?",
        instructions="New rules.",
        previous_response_id=first["id"],
        truncation="auto",
    )
    history = [*_turns(3, pad=25)[:-1], ("assistant", "ok"), ("user", "and now?")]
    head = [("system", "New rules.")]
    start = _longest_tail(head, history, MAX_LEN - 1)
    assert start > 0 and _sent(srv, second["id"]) == _text(head + history[start:])
    # input_items lists this request's own input (the stored conversation is the cut one)
    status, _, items = srv.http.request("GET", f"/v1/responses/{second['id']}/input_items")
    assert status == 200 and [d["type"] for d in items["data"]] == ["message"]


# ---- what cannot fit ----------------------------------------------------------------------
def test_a_last_turn_too_long_alone_is_a_400_naming_input(srv: SimpleNamespace) -> None:
    items = _items([*_turns(2), ("user", "x" * MAX_LEN)])
    for stream in (False, True):
        status, payload = _post(srv, input=items, truncation="auto", stream=stream)
        assert status == 400 and payload["error"]["param"] == "input", payload
        assert "truncation 'auto'" in payload["error"]["message"]
    # it fits alone, but not with the output budget asked for
    items = _items([*_turns(2), ("user", "x" * 150)])
    status, payload = _post(srv, input=items, truncation="auto", max_output_tokens=100)
    assert status == 400 and payload["error"]["param"] == "max_output_tokens", payload


# ---- streams, input_tokens, and how often the prompt is rendered ---------------------------
def test_a_stream_is_cut_the_same(srv: SimpleNamespace) -> None:
    body = {"input": _items([*_turns(8), ("user", "last")]), "truncation": "auto"}
    whole = _create(srv, **body, store=False)
    srv.engine.script = "ok"
    events = typed_events(srv.http, "/v1/responses", {**body, "store": False})
    assert events[0]["response"]["truncation"] == "auto"
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["truncation"] == "auto"
    assert final["usage"] == whole["usage"] and final["usage"]["input_tokens"] < MAX_LEN
    assert _sent(srv, final["id"]) == _sent(srv, whole["id"])
    status, _, count = srv.http.request("POST", "/v1/responses/input_tokens", body)
    assert status == 200 and count["input_tokens"] == whole["usage"]["input_tokens"]


def test_the_cut_is_found_by_bisection(srv: SimpleNamespace, monkeypatch) -> None:
    renders = []
    chat_prompt = srv.app._chat_prompt

    def counted(req):
        renders.append(len(req.messages))
        return chat_prompt(req)

    monkeypatch.setattr(srv.app, "_chat_prompt", counted)
    turns = [*_turns(200, pad=2), ("user", "last")]
    r = _create(srv, input=_items(turns), truncation="auto")
    start = _longest_tail([], turns, MAX_LEN - 1)
    assert _sent(srv, r["id"]) == _text(turns[start:])
    assert len(renders) <= math.ceil(math.log2(201)) + 3, renders
    renders.clear()
    _create(srv, input=_items(turns[start:]), truncation="auto")
    assert len(renders) == 1  # one that fits: rendered once


# ---- images go with their turn ------------------------------------------------------------
def test_the_images_kept_are_those_of_the_turns_kept() -> None:
    """A stub app whose prompt takes 10 tokens a message and 100 an image: the request left
    after the cut holds the kept turns' images alone, in order, named as the client sent them."""
    from paged_server.responses_api import ResponseStore
    from paged_server.responses_request import parse_responses
    from paged_server.responses_truncation import fit_prompt

    def image(name: str) -> dict:
        return {"type": "input_image", "image_url": f"http://host/{name}.png"}

    def length(chat) -> int:
        parts = [p for m in chat.messages if isinstance(m["content"], list) for p in m["content"]]
        return 10 * len(chat.messages) + 100 * sum(p["type"] == "image" for p in parts)

    app = SimpleNamespace(max_model_len=300)
    app._chat_prompt = lambda chat: ("", [0] * length(chat), None)
    items = [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": [image("a"), {"type": "input_text", "text": "a?"}]},
        {"role": "assistant", "content": "A."},
        {"role": "user", "content": [image("b"), image("c"), {"type": "input_text", "text": "?"}]},
        {"role": "assistant", "content": "B, C."},
        {"role": "user", "content": [{"type": "input_text", "text": "d?"}, image("d")]},
    ]
    body = {"input": items, "truncation": "auto"}
    req = parse_responses(body, None, ResponseStore(), images=True)
    assert len(req.chat.media_refs) == 4
    _, ids, _ = fit_prompt(app, req)
    assert len(ids) == 10 + 110  # system + the last turn with its image: "b", "c" do not fit
    assert [m["role"] for m in req.chat.messages] == ["system", "user"]
    assert [(r.url, r.param) for r in req.chat.media_refs] == [
        ("http://host/d.png", "input[5].content[1].image_url")
    ]
    app.max_model_len = 400  # the whole takes 460 tokens
    req = parse_responses(body, None, ResponseStore(), images=True)
    _, ids, _ = fit_prompt(app, req)
    assert len(ids) == 10 * 4 + 100 * 3  # system, then from the "b", "c" turn on
    assert [r.url[-5:] for r in req.chat.media_refs] == ["b.png", "c.png", "d.png"]


def test_call_ids_reused_across_turns_still_allow_cuts(srv: SimpleNamespace) -> None:
    """A client that numbers its calls per turn ("call_0" in every turn): each output pairs
    with the latest call of its id, so the turns between two such pairs may still be cut."""

    def call(cid: str) -> dict:
        return {"type": "function_call", "call_id": cid, "name": "lookup", "arguments": "{}"}

    def output(cid: str, text: str) -> dict:
        return {"type": "function_call_output", "call_id": cid, "output": text}

    items = [
        {"role": "user", "content": "first " + "o" * 200},
        call("call_0"),
        output("call_0", "r1"),
        {"role": "assistant", "content": "done1"},
        {"role": "user", "content": "second"},
        call("call_0"),
        output("call_0", "r2"),
        {"role": "assistant", "content": "done2"},
        {"role": "user", "content": "last"},
    ]
    r = _create(srv, input=items, truncation="auto")
    kept = [
        ("user", "second"),
        ("assistant", ""),
        ("tool", "r2"),
        ("assistant", "done2"),
        ("user", "last"),
    ]
    assert _sent(srv, r["id"]) == _text(kept)
