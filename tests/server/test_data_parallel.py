"""`paged-server --data-parallel-size 2`: two engine replicas behind one front answer like one
server, share the load, report both in /metrics, and stop with the front; SSE passes through the
front byte for byte, and a stored Responses API response's follow-ups reach the replica that
holds it (in-process replicas over scripted engines, behind a `ReplicaRouter`)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from fake_engine import ScriptedEngine
from procs import wait_gone
from server_proc import (
    COMMON_ARGS,
    HEADERS,
    REAL_ARGS,
    ServerProc,
    greedy_answers,
    launch,
    serve_in_process,
    typed_events,
)

from paged_server.data_parallel import (
    Replica,
    ReplicaRouter,
    _estimate_tokens,
    replica_argv,
)
from paged_server.exposition import with_label
from paged_server.http import Server

openai = pytest.importorskip("openai")


def test_two_replicas_serve_like_one(real_server, tiny_model):
    want = greedy_answers(real_server)
    server = launch(["--model", tiny_model, "--data-parallel-size", "2", *REAL_ARGS], fake=False)
    try:
        with open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children") as f:
            replicas = [int(p) for p in f.read().split()]
        assert len(replicas) == 2
        assert greedy_answers(server) == want
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0)

        def one(i: int) -> str:
            return (
                client.completions.create(
                    model="tiny", prompt=f"request {i}", max_tokens=16, temperature=0
                )
                .choices[0]
                .text
            )

        with ThreadPoolExecutor(8) as pool:
            assert len(list(pool.map(one, range(8)))) == 8
        events = list(
            client.with_options(timeout=30).responses.create(
                model="tiny", input="Hi", max_output_tokens=4, temperature=0, stream=True
            )
        )
        assert events[-1].type == "response.completed"  # the stream ends through the front
        final = events[-1].response
        assert client.responses.retrieve(final.id).output_text == final.output_text
        status, _, text = server.request("GET", "/metrics")
        assert status == 200
        done = {
            line.split("replica=")[1][1]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("paged:request_success_total") and 'finished_reason="length"' in line
        }
        assert set(done) == {"0", "1"} and all(v > 0 for v in done.values()), text
        status, _, body = server.request("GET", "/health")
        assert status == 200 and body["replicas"] == 2
        status, _, body = server.request("POST", "/v1/completions", {"model": "tiny"})
        assert status == 400 and body["error"]["param"] == "prompt"  # a replica's own answer
    finally:
        assert server.stop() == 0, "".join(server.lines[-30:])
    assert wait_gone(replicas, timeout=30) == []


def test_replica_argv_drops_the_routers_options():
    argv = ["serve", "m", "-dp", "2", "--port", "8000", "--host=0.0.0.0", "-tp", "2"]
    assert replica_argv(argv) == ["serve", "m", "-tp", "2"]
    assert replica_argv(["--data-parallel-size=3", "--model", "x"]) == ["--model", "x"]
    assert replica_argv(["--uds", "/run/p.sock", "--model", "x", "-dp", "2"]) == ["--model", "x"]


def test_metric_labels_and_cost_estimate():
    assert with_label('a{b="c"} 1', "replica", "0") == 'a{b="c",replica="0"} 1'
    assert with_label("a 1", "replica", "1") == 'a{replica="1"} 1'
    assert _estimate_tokens({"max_tokens": 10, "n": 2}, 400) == 100 + 20
    assert _estimate_tokens({"max_output_tokens": 10}, 40) == 10 + 10
    assert _estimate_tokens([1, 2], 10) == 1
    # an input_audio part's base64 is no prompt text: a clip costs its nominal 750 tokens
    clip = {"type": "input_audio", "input_audio": {"data": "A" * 4000, "format": "wav"}}
    body = {"max_tokens": 10, "messages": [{"role": "user", "content": [clip]}]}
    assert _estimate_tokens(body, 4400) == 100 + 750 + 10


# ---- the front over in-process replicas ----------------------------------------------------
@pytest.fixture(scope="module")
def front() -> Iterator[SimpleNamespace]:
    """A `ReplicaRouter` front over two in-process servers on scripted engines."""
    engines = [ScriptedEngine(max_model_len=128, step_time=0.0005) for _ in range(2)]
    with (
        serve_in_process(COMMON_ARGS, engines[0]) as (s0, _),
        serve_in_process(COMMON_ARGS, engines[1]) as (s1, _),
    ):
        live = SimpleNamespace(poll=lambda: None)  # a running replica process
        replicas = [Replica(i, live, s.host, s.port) for i, s in enumerate((s0, s1))]
        router = ReplicaRouter(replicas, timeout=10)
        server = Server(("127.0.0.1", 0), router, io_timeout=3)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        http = ServerProc(None, "http://{}:{}".format(*server.server_address[:2]))
        try:
            yield SimpleNamespace(http=http, router=router, engines=engines)
        finally:
            server.shutdown()
            server.server_close()


def _script(front: SimpleNamespace, text: str) -> None:
    for engine in front.engines:
        engine.script = text


def _assert_load_released(front: SimpleNamespace) -> None:
    """Every request's token estimate is taken off its replica once the front answered it (the
    front's thread does so just after the client has its last byte)."""
    deadline = time.monotonic() + 5
    while any(r.tokens_in_flight for r in front.router.replicas) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [r.tokens_in_flight for r in front.router.replicas] == [0, 0]


def _create(front: SimpleNamespace, status: int = 200, **body) -> dict:
    got, _, payload = front.http.request("POST", "/v1/responses", {"model": "tiny", **body})
    assert got == status, payload
    return payload


def _stream(front: SimpleNamespace, **body) -> list[dict]:
    """A streamed /v1/responses through the front, read to the end of its chunked body (a
    stream the front never ends times out); every event must be `event: <type>` + `data:`."""
    conn = front.http.conn(5)
    try:
        data = json.dumps({"model": "tiny", **body, "stream": True})
        conn.request("POST", "/v1/responses", data, HEADERS)
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("Content-Type") == "text/event-stream"
        raw = r.read().decode()
        conn.request("GET", "/health")  # the connection serves on after the stream
        assert conn.getresponse().status == 200
    finally:
        conn.close()
    *blocks, tail = raw.split("\n\n")
    assert tail == ""  # every event ends with its blank line; no [DONE]
    events = []
    for block in blocks:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        events.append(json.loads(data[6:]))
        assert events[-1]["type"] == name[7:]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    return events


def test_the_fronts_metrics_parse_whole(front: SimpleNamespace) -> None:
    """Both replicas' families under one HELP / TYPE each, every sample labelled with its replica,
    in either format (the front appended replica after replica: a strict parser, as
    prometheus_client, read the second replica's histogram samples as untyped families)."""
    from test_metrics_peers import PROMETHEUS_ACCEPT, parse

    _script(front, "ok")
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    for _ in range(2):
        assert front.http.request("POST", "/v1/completions", body)[0] == 200
    status, headers, text = front.http.request("GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    ttft = parse(text)["paged:time_to_first_token_seconds"]
    assert ttft.type == "histogram"
    assert {labels["replica"] for _, labels, _ in ttft.samples} == {"0", "1"}
    status, headers, om = front.http.request(
        "GET", "/metrics", headers={"Accept": PROMETHEUS_ACCEPT}
    )
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert parse(om, openmetrics=True)["paged:prompt_tokens"].type == "counter"


def test_a_streamed_response_passes_through_the_front_whole(front: SimpleNamespace) -> None:
    _script(front, "Hello there.")
    final = _stream(front, input="Hi", store=False)[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "Hello there."
    # a chat stream through the front still ends with its [DONE] (ServerProc.stream checks it)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
    chunks = front.http.stream(chat, "/v1/chat/completions")
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "Hello there."
    _assert_load_released(front)


def test_anthropic_messages_pass_through_the_front(front: SimpleNamespace) -> None:
    """A Messages API stream passes whole (Anthropic's typed events, no [DONE]); the front's
    own errors on those routes are in Anthropic's shape, as the replicas' are."""
    _script(front, "Hello there.")
    body = {"model": "tiny", "max_tokens": 32, "messages": [{"role": "user", "content": "Hi"}]}
    events = typed_events(front.http, "/v1/messages", body)
    assert [e["type"] for e in events][:2] == ["message_start", "ping"]
    assert events[-1]["type"] == "message_stop"
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert text == "Hello there."
    status, _, whole = front.http.request("POST", "/v1/messages", body)
    assert status == 200 and whole["content"] == [{"type": "text", "text": "Hello there."}]
    status, _, bad = front.http.request("POST", "/v1/messages", b"{oops")  # the front refuses it
    assert status == 400 and bad["type"] == "error", bad
    assert bad["error"]["type"] == "invalid_request_error", bad
    _assert_load_released(front)


def test_stored_response_follow_ups_reach_the_replica_holding_it(front: SimpleNamespace) -> None:
    e0, e1 = front.engines
    ran_on_0 = set(e0.params)
    busy = front.router.replicas[0]
    busy.tokens_in_flight += 10**6  # least-loaded routing sends the first turn to replica 1
    try:
        _script(front, "Blue.")
        first = _create(front, input="Favourite colour?")
    finally:
        busy.tokens_in_flight -= 10**6
    assert first["id"] + "-0" in e1.params and first["id"] + "-0" not in e0.params
    # replica 0 is now the least loaded: the follow-ups must still reach replica 1
    status, _, got = front.http.request("GET", f"/v1/responses/{first['id']}")
    assert status == 200 and got == first
    _script(front, "Red.")
    second = _create(front, input="And yours?", previous_response_id=first["id"])
    assert second["id"] + "-0" in e1.params and second["previous_response_id"] == first["id"]
    turns = (("user", "Favourite colour?"), ("assistant", "Blue."), ("user", "And yours?"))
    prompt = "".join(f"<{role}>{text}\n" for role, text in turns) + "<assistant>"
    assert second["usage"]["input_tokens"] == len(prompt)  # the fake template: a token a byte
    _script(front, "Green.")
    third = _stream(front, input="Why?", previous_response_id=second["id"])[-1]["response"]
    assert third["id"] + "-0" in e1.params and third["status"] == "completed"
    err = _create(front, 400, input="x", previous_response_id="resp_nope")
    assert err["error"]["code"] == "previous_response_not_found"

    status, _, payload = front.http.request("DELETE", f"/v1/responses/{first['id']}")
    assert status == 200 and payload["deleted"] is True
    for method in ("GET", "DELETE"):
        status, _, payload = front.http.request(method, f"/v1/responses/{first['id']}")
        assert status == 404 and payload["error"]["code"] == "not_found"
    assert front.http.request("GET", f"/v1/responses/{third['id']}")[0] == 200
    assert set(e0.params) == ran_on_0  # every turn ran on replica 1
    _assert_load_released(front)


def test_background_responses_through_the_front(front: SimpleNamespace) -> None:
    """A background response is polled, read again as a stream and cancelled through the
    front, whichever replica runs it."""
    _script(front, "Later.")
    queued = _create(front, input="x", background=True)
    assert queued["status"] == "queued"
    deadline = time.monotonic() + 10
    while (got := front.http.request("GET", f"/v1/responses/{queued['id']}")[2])["status"] != (
        "completed"
    ):
        assert time.monotonic() < deadline, got
        time.sleep(0.02)
    assert got["output"][0]["content"][0]["text"] == "Later."
    events = _stream(front, input="x", background=True)
    rid = events[0]["response"]["id"]
    again = typed_events(front.http, f"/v1/responses/{rid}?stream=true&starting_after=1", None)
    assert again == events[2:] and again[-1]["type"] == "response.completed"
    _script(front, "z" * 100)
    for engine in front.engines:
        engine.step_time = 0.02  # 2 s for the 100 tokens: the cancel comes first
    try:
        long = _create(front, input="x", background=True, max_output_tokens=100)
        status, _, cancelled = front.http.request("POST", f"/v1/responses/{long['id']}/cancel")
    finally:
        for engine in front.engines:
            engine.step_time = 0.0005
    assert status == 200 and cancelled["status"] == "cancelled", cancelled
    status, _, err = front.http.request("GET", "/v1/responses/resp_nope?stream=true")
    assert status == 404, err
    _assert_load_released(front)


def test_a_replica_breaking_off_its_stream_is_an_in_band_502() -> None:
    """A replica that dies mid-stream (no last chunk): the client gets what it sent, then an
    error event, and the stream ends."""
    listener = socket.create_server(("127.0.0.1", 0))

    def replica() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            event = b"event: response.created\ndata: {}\n\n"
            head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            conn.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n")
            conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))  # then gone

    threading.Thread(target=replica, daemon=True).start()
    live = SimpleNamespace(poll=lambda: None)
    router = ReplicaRouter([Replica(0, live, "127.0.0.1", listener.getsockname()[1])], timeout=5)
    server = Server(("127.0.0.1", 0), router, io_timeout=3)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        http = ServerProc(None, "http://{}:{}".format(*server.server_address[:2]))
        conn = http.conn(5)
        conn.request("POST", "/v1/responses", json.dumps({"input": "x", "stream": True}), HEADERS)
        raw = conn.getresponse().read().decode()
        conn.close()
    finally:
        server.shutdown()
        server.server_close()
        listener.close()
    first, error, done, tail = raw.split("\n\n")
    assert first == "event: response.created\ndata: {}" and (done, tail) == ("data: [DONE]", "")
    message = json.loads(error.removeprefix("data: "))["error"]["message"]
    assert message.startswith("engine replica 0 broke off its stream"), message


def test_speech_uploads_pass_through_the_front_as_they_came(front: SimpleNamespace) -> None:
    """A multipart transcription upload is no JSON: the front forwards its bytes and
    Content-Type, and the replica (a text model here) answers it, a 400 naming `model`."""
    boundary = "front-boundary"
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\ntiny\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        f"Content-Type: audio/wav\r\n\r\nRIFF\r\n--{boundary}--\r\n"
    ).encode()
    ctype = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    status, _, out = front.http.request("POST", "/v1/audio/transcriptions", body, ctype)
    assert status == 400 and out["error"]["param"] == "model", out
    status, _, out = front.http.request(
        "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}
    )
    assert status == 200, out
