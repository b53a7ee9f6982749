"""Background responses (`"background": true`): answered at once "queued", run on by the
server; polled, cancelled, streamed again from any sequence number; a client that leaves does
not stop them. Through the raw API and the `openai` SDK (its own types validate the answers)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from fake_engine import ScriptedEngine
from server_proc import HEADERS, serve_in_process, typed_events

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402

STREAM_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
ARGS = ["--max-model-len", "4096", "--served-model-name", "tiny", "--reasoning-parser", "qwen3"]
LONG = "z" * 3000  # ~6 s at the engine's 2 ms a token: long enough to catch running


@pytest.fixture(scope="module")
def srv() -> Iterator[SimpleNamespace]:
    engine = ScriptedEngine(max_model_len=4096, step_time=0.002)
    with serve_in_process(ARGS, engine) as (http, app):
        client = openai.OpenAI(base_url=http.url + "/v1", api_key="x", max_retries=0)
        yield SimpleNamespace(http=http, engine=engine, app=app, client=client)


def _post(srv: SimpleNamespace, script: str, **body) -> dict:
    srv.engine.script = script
    status, _, payload = srv.http.request("POST", "/v1/responses", body)
    assert status == 200, payload
    Response.model_validate(payload)
    return payload


def _get(srv: SimpleNamespace, rid: str) -> dict:
    status, _, payload = srv.http.request("GET", f"/v1/responses/{rid}")
    assert status == 200, payload
    Response.model_validate(payload)
    return payload


def _until(srv: SimpleNamespace, rid: str, statuses: tuple[str, ...], timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while (r := _get(srv, rid))["status"] not in statuses:
        assert time.monotonic() < deadline, r["status"]
        time.sleep(0.02)
    return r


def _idle(engine: ScriptedEngine, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine still runs the request"
        time.sleep(0.01)


def test_queued_then_polled_to_completion_then_continued(srv: SimpleNamespace) -> None:
    r = _post(srv, "<think>hm</think>Paris.", input="Capital of France?", background=True)
    assert (r["status"], r["background"], r["output"], r["usage"]) == ("queued", True, [], None)
    done = _until(srv, r["id"], ("completed",))
    assert done["background"] is True and done["id"] == r["id"]
    assert [it["type"] for it in done["output"]] == ["reasoning", "message"]
    assert done["output"][1]["content"][0]["text"] == "Paris."
    assert done["usage"]["output_tokens"] == len("<think>hm</think>Paris.") + 1  # + EOS
    # the finished conversation continues (the next prompt holds the first answer)
    nxt = _post(srv, "Lyon.", input="And the second city?", previous_response_id=r["id"])
    assert nxt["status"] == "completed" and nxt["output"][0]["content"][0]["text"] == "Lyon."
    prompt = srv.engine.prompts[nxt["id"] + "-0"]
    assert "Capital of France?" in str(prompt) and "Paris." in str(prompt)


def test_a_running_response_is_not_continued_and_is_cancelled(srv: SimpleNamespace) -> None:
    engine = srv.engine
    r = _post(srv, LONG, input="x", background=True)
    running = _until(srv, r["id"], ("in_progress",))
    assert running["status"] == "in_progress" and engine.has_unfinished_requests()
    status, _, err = srv.http.request(
        "POST", "/v1/responses", {"input": "y", "previous_response_id": r["id"]}
    )
    assert status == 400 and err["error"]["param"] == "previous_response_id", err
    assert "in_progress" in err["error"]["message"]
    generated = engine.gen_tokens
    status, _, cancelled = srv.http.request("POST", f"/v1/responses/{r['id']}/cancel")
    assert status == 200 and cancelled["status"] == "cancelled", cancelled
    Response.model_validate(cancelled)
    _idle(engine)  # its engine request was aborted
    assert engine.gen_tokens - generated < len(LONG)
    assert _get(srv, r["id"])["status"] == "cancelled"
    again = srv.http.request("POST", f"/v1/responses/{r['id']}/cancel")
    assert again[0] == 200 and again[2]["status"] == "cancelled"  # idempotent
    # a finished background response is not cancelled; a synchronous one never is
    done = _post(srv, "ok", input="x", background=True)
    _until(srv, done["id"], ("completed",))
    status, _, err = srv.http.request("POST", f"/v1/responses/{done['id']}/cancel")
    assert status == 400 and "completed" in err["error"]["message"], err
    assert _get(srv, done["id"])["status"] == "completed"
    sync = _post(srv, "ok", input="x")
    status, _, err = srv.http.request("POST", f"/v1/responses/{sync['id']}/cancel")
    assert status == 400 and err["error"]["message"] == "Cannot cancel a synchronous response."


def test_delete_stops_a_running_response(srv: SimpleNamespace) -> None:
    r = _post(srv, LONG, input="x", background=True)
    _until(srv, r["id"], ("in_progress",))
    status, _, body = srv.http.request("DELETE", f"/v1/responses/{r['id']}")
    assert status == 200 and body["deleted"] is True
    _idle(srv.engine)
    assert srv.http.request("GET", f"/v1/responses/{r['id']}")[0] == 404


def test_stream_then_stream_again_from_a_sequence_number(srv: SimpleNamespace) -> None:
    srv.engine.script = "<think>a</think>Hi there."
    events = typed_events(srv.http, "/v1/responses", {"input": "x", "background": True})
    for e in events:
        STREAM_EVENT.validate_python(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    assert events[0]["response"]["status"] == "queued" and events[0]["response"]["background"]
    assert events[1]["type"] == "response.in_progress"
    final = events[-1]
    assert final["type"] == "response.completed"
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "Hi there."
    rid = final["response"]["id"]
    assert _get(srv, rid) == final["response"]
    again = typed_events(srv.http, f"/v1/responses/{rid}?stream=true&starting_after=3", None)
    assert again == events[4:]
    assert typed_events(srv.http, f"/v1/responses/{rid}?stream=true", None) == events
    # bad reads
    for query, param in [
        ("stream=maybe", "stream"),
        ("stream=true&starting_after=-2", "starting_after"),
        ("stream=true&starting_after=x", "starting_after"),
    ]:
        status, _, err = srv.http.request("GET", f"/v1/responses/{rid}?{query}")
        assert status == 400 and err["error"]["param"] == param, (query, err)
    quiet = _post(srv, "ok", input="x", background=True)  # not streamed: no events kept
    status, _, err = srv.http.request("GET", f"/v1/responses/{quiet['id']}?stream=true")
    assert status == 400 and err["error"]["param"] == "stream"


def test_a_client_that_leaves_does_not_stop_it(srv: SimpleNamespace) -> None:
    """The stream's reader goes after its first event: the response runs to its end, and a
    reader that comes back resumes after the last event it saw."""
    script = "w" * 400
    srv.engine.script = script
    conn = srv.http.conn(10)
    body = {"input": "x", "background": True, "stream": True}
    conn.request("POST", "/v1/responses", json.dumps(body), HEADERS)
    r = conn.getresponse()
    assert r.status == 200
    name, data = r.readline(), json.loads(r.readline()[6:])
    assert name == b"event: response.created\n" and data["sequence_number"] == 0
    conn.close()
    rid = data["response"]["id"]
    done = _until(srv, rid, ("completed",))
    assert done["output"][0]["content"][0]["text"] == script
    rest = typed_events(srv.http, f"/v1/responses/{rid}?stream=true&starting_after=0", None)
    assert rest[0]["sequence_number"] == 1 and rest[-1]["type"] == "response.completed"


def test_a_reader_follows_a_running_response(srv: SimpleNamespace) -> None:
    """A second reader joins while it runs: it gets the events so far, then each as it comes."""
    srv.engine.script = "v" * 600
    conn = srv.http.conn(10)
    body = {"input": "x", "background": True, "stream": True}
    conn.request("POST", "/v1/responses", json.dumps(body), HEADERS)
    r = conn.getresponse()
    r.readline()
    rid = json.loads(r.readline()[6:])["response"]["id"]
    follower = typed_events(srv.http, f"/v1/responses/{rid}?stream=true", None)
    conn.close()
    assert follower[0]["type"] == "response.created"
    assert follower[-1]["type"] == "response.completed"
    text = "".join(e["delta"] for e in follower if e["type"] == "response.output_text.delta")
    assert text == "v" * 600


def test_an_engine_failure_fails_it_alone(srv: SimpleNamespace, monkeypatch) -> None:
    def boom(req, seq) -> int:
        raise RuntimeError("boom")

    monkeypatch.setattr(srv.engine, "_next_token", boom)
    r = _post(srv, "x", input="x", background=True)
    failed = _until(srv, r["id"], ("failed",))
    assert failed["error"]["code"] == "server_error"
    monkeypatch.undo()
    ok = _post(srv, "fine", input="x", background=True)
    assert _until(srv, ok["id"], ("completed",))["output"][0]["content"][0]["text"] == "fine"


def test_a_refused_one_is_not_stored(srv: SimpleNamespace, monkeypatch) -> None:
    """The engine refuses it when adding it: the client gets the 400 and no id, so no "queued"
    entry may stay behind in the store, for a stream or not."""

    def refuse(*args, **kwargs) -> None:
        raise ValueError("temperature: refused by the engine")

    monkeypatch.setattr(srv.engine, "add_request", refuse)
    before = len(srv.app.response_store)
    for stream in (False, True):
        body = {"input": "x", "background": True, "stream": stream}
        status, _, payload = srv.http.request("POST", "/v1/responses", body)
        assert status == 400 and "refused by the engine" in payload["error"]["message"], payload
    assert len(srv.app.response_store) == before
    monkeypatch.undo()
    ok = _post(srv, "fine", input="x", background=True)
    assert _until(srv, ok["id"], ("completed",))["output"][0]["content"][0]["text"] == "fine"


def test_the_openai_sdk(srv: SimpleNamespace) -> None:
    """What an SDK user writes: create(background=True), retrieve until done, cancel, and
    retrieve(stream=True, starting_after=N)."""
    client = srv.client
    srv.engine.script = "SDK answer."
    r = client.responses.create(model="tiny", input="x", background=True)
    assert r.status == "queued"
    while r.status in ("queued", "in_progress"):
        time.sleep(0.02)
        r = client.responses.retrieve(r.id)
    assert r.status == "completed" and r.output_text == "SDK answer."
    srv.engine.script = LONG
    r = client.responses.create(model="tiny", input="x", background=True)
    assert client.responses.cancel(r.id).status == "cancelled"
    srv.engine.script = "Streamed."
    stream = client.responses.create(model="tiny", input="x", background=True, stream=True)
    first = list(stream)
    rid = first[0].response.id
    events = list(client.responses.retrieve(rid, stream=True, starting_after=2))
    assert [e.sequence_number for e in events] == [e.sequence_number for e in first[3:]]
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == "Streamed."
