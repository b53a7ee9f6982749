"""Request ids as vLLM's OpenAI server treats them: the X-Request-Id header names the response
id (over the body's `request_id`, over a random one) on every route vLLM reads it on, and ids
need not be unique: each engine request gets an internal id of its own, so two requests of one
id are both served and a client that leaves aborts only its own. Over a tiny llama in process."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator

import pytest
from server_proc import COMMON_ARGS, HEADERS, ServerProc, serve_in_process

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LONG = {"max_tokens": 120, "ignore_eos": True, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def served(tiny_model: str) -> Iterator[ServerProc]:
    from paged_engine import LLMEngine

    engine = LLMEngine(
        model=tiny_model, dtype="float32", max_model_len=128, num_gpu_blocks_override=64
    )
    try:
        with serve_in_process(COMMON_ARGS, engine) as (http, _app):
            yield http
    finally:
        engine.shutdown()


def post(server: ServerProc, path: str, body: dict, rid: str | None, status: int = 200) -> dict:
    headers = {} if rid is None else {"X-Request-Id": rid}
    got, _, payload = server.request("POST", path, body, headers=headers)
    assert got == status, payload
    return payload


def open_stream(server: ServerProc, body: dict, rid: str) -> http.client.HTTPResponse:
    conn = server.conn(timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {**HEADERS, "X-Request-Id": rid})
    r = conn.getresponse()
    assert r.status == 200, r.read()
    return r


def events(r: http.client.HTTPResponse) -> list[dict]:
    """The rest of a stream's events; asserts it ends with [DONE]."""
    out = []
    for line in r:
        if line.startswith(b"data: "):
            if line[6:].strip() == b"[DONE]":
                return out
            out.append(json.loads(line[6:]))
    raise AssertionError("the stream ended without [DONE]")


def text_of(evs: list[dict]) -> str:
    return "".join(c["text"] for e in evs for c in e["choices"])


def test_the_header_names_the_response_id_over_the_body(served: ServerProc) -> None:
    assert post(served, "/v1/chat/completions", CHAT, "trace-1")["id"] == "chatcmpl-trace-1"
    body = {"prompt": "a", "max_tokens": 1, "request_id": "from-body"}
    assert post(served, "/v1/completions", body, "trace-2")["id"] == "cmpl-trace-2"
    assert post(served, "/v1/completions", body, None)["id"] == "cmpl-from-body"
    assert post(served, "/v1/completions", body, "")["id"] == "cmpl-from-body"  # empty: unset
    random_id = post(served, "/v1/completions", {"prompt": "a", "max_tokens": 1}, None)["id"]
    assert random_id.startswith("cmpl-") and len(random_id) == len("cmpl-") + 32


@pytest.mark.parametrize(
    ("path", "body", "prefix"),
    [
        ("/v1/embeddings", {"input": "a b"}, "embd"),
        ("/pooling", {"input": "a b"}, "pool"),
        ("/v1/score", {"text_1": "a", "text_2": ["b", "c"]}, "score"),
        ("/v1/rerank", {"query": "a", "documents": ["b", "c"]}, "rerank"),
    ],
)
def test_the_header_names_pooling_answers(served: ServerProc, path, body, prefix) -> None:
    assert post(served, path, body, "trace-3")["id"] == f"{prefix}-trace-3"


def test_every_stream_chunk_carries_the_header_id(served: ServerProc) -> None:
    r = open_stream(served, {"prompt": "a", "max_tokens": 3, "stream": True}, "s-1")
    evs = events(r)
    assert evs and {e["id"] for e in evs} == {"cmpl-s-1"}
    conn = served.conn(timeout=60)
    body = json.dumps({**CHAT, "stream": True})
    conn.request("POST", "/v1/chat/completions", body, {**HEADERS, "X-Request-Id": "s-2"})
    evs = events(conn.getresponse())
    conn.close()
    assert evs and {e["id"] for e in evs} == {"chatcmpl-s-2"}


def test_two_streams_of_one_header_id_each_get_their_own_text(served: ServerProc) -> None:
    """Before: the engine refused the second (id in use) with a 400."""
    bodies = [{**LONG, "prompt": [5, 6, 7]}, {**LONG, "prompt": [9, 8, 30, 31]}]
    alone = [text_of(events(open_stream(served, b, f"alone-{i}"))) for i, b in enumerate(bodies)]
    assert alone[0] != alone[1]
    streams = [open_stream(served, b, "same") for b in bodies]  # both in flight at once
    got: list[list[dict]] = [[], []]

    def read(i: int) -> None:
        got[i] = events(streams[i])

    threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [text_of(g) for g in got] == alone
    assert {e["id"] for g in got for e in g} == {"cmpl-same"}
    assert served.wait_idle()["paged:kv_cache_used_blocks"] == 0


def test_a_client_that_leaves_aborts_only_its_own_request(served: ServerProc) -> None:
    """Two streams of one X-Request-Id; the first client hangs up: that request is aborted (the
    counter goes up by one) and the other, same id, streams to its end."""
    before = served.metrics()["paged:request_aborted_total"]
    leaving = open_stream(served, {**LONG, "prompt": [5, 6]}, "twin")
    staying = open_stream(served, {**LONG, "prompt": [5, 7]}, "twin")
    leaving.readline()  # its first event: in flight
    staying.readline()
    leaving.close()
    rest = events(staying)
    staying.close()
    assert rest and rest[-1]["choices"][0]["finish_reason"] == "length"
    m = served.wait_idle()
    assert m["paged:request_aborted_total"] == before + 1
    assert m["paged:kv_cache_used_blocks"] == 0


@pytest.mark.parametrize(
    "value",
    ["x" * 129, "tab\there", "bell\x07", "caf\u00e9".encode(), "\u2603".encode()],
    ids=["too-long", "tab", "control", "latin-utf8", "snowman-utf8"],
)
def test_a_hostile_header_is_a_400_naming_it(served: ServerProc, value: str | bytes) -> None:
    conn = served.conn(timeout=30)
    try:
        conn.putrequest("POST", "/v1/completions")
        data = json.dumps({"prompt": "a", "max_tokens": 1}).encode()
        for k, v in {**HEADERS, "Content-Length": str(len(data)), "X-Request-Id": value}.items():
            conn.putheader(k, v)
        conn.endheaders(data)
        r = conn.getresponse()
        payload = json.loads(r.read())
    finally:
        conn.close()
    assert r.status == 400, payload
    assert payload["error"]["param"] == "X-Request-Id", payload
    assert post(served, "/v1/completions", {"prompt": "a", "max_tokens": 1}, "ok")["id"] == (
        "cmpl-ok"
    )


def test_the_offline_engine_serves_a_duplicate_id_as_vllm_does(tiny_model: str) -> None:
    """vLLM's LLMEngine.add_request gives every request an internal id of its own: a second
    request under an id in use is served (before: a ValueError), its outputs carry the caller's
    id, and aborting that id aborts both."""
    from paged_engine import LLMEngine, SamplingParams

    engine = LLMEngine(
        model=tiny_model, dtype="float32", max_model_len=128, num_gpu_blocks_override=64
    )
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7], [9, 8, 30, 31]]

    try:
        texts: dict[str, str] = {}
        for rid, p in zip(["p0", "p1"], prompts):
            engine.add_request(rid, p, params)
        while engine.has_unfinished_requests():
            texts |= {o.request_id: o.outputs[0].text for o in engine.step() if o.finished}
        assert texts["p0"] != texts["p1"]
        first = engine.add_request("same", prompts[0], params)
        second = engine.add_request("same", prompts[1], params)
        assert first == "same" and second.startswith("same-") and len(second) == len("same-") + 8
        got = []
        while engine.has_unfinished_requests():
            got += [(o.request_id, o.outputs[0].text) for o in engine.step() if o.finished]
        assert sorted(got) == sorted([("same", texts["p0"]), ("same", texts["p1"])])
        for p in prompts:
            engine.add_request("gone", p, params)
        engine.step()
        engine.abort_request("gone")  # the caller's id: both of it
        assert not engine.has_unfinished_requests()
        assert engine.get_stats().num_running == 0
    finally:
        engine.shutdown()
