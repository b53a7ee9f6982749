"""Server edges against vLLM's stack (uvicorn + httptools/llhttp + Starlette/FastAPI):

- the request line as llhttp 9 (httptools' vendored parser) reads it (src/llhttp/http.ts,
  constants.ts METHODS_HTTP1, url.ts): an unknown or lower-case method, an HTTP version other
  than 0.9 / 1.0 / 1.1 / 2.0, HTTP/2's preface, a tab or a byte past 0x7E is a 400 that closes
  (uvicorn's httptools_impl answers any parser error so); a method llhttp knows reaches the
  router (Starlette: 405 for a route without it, 404 for an unknown path); runs of spaces
  between the words are fine;
- the data-parallel front's deadline on a replica's answer: a replica dribbling bytes is cut
  (a 504) after the front's timeout in all, a stream after that long between two events;
- Anthropic's error shape for `/v1/models` asked by an Anthropic client (`anthropic-version`),
  its 401 included; a system image stays a 400 (Anthropic's `system` takes text alone);
- a cancelled background Responses stream ends with a `response.cancelled` event.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
from fake_engine import FakeEngine, ScriptedEngine
from server_proc import API_KEY, HEADERS, MAX_MODEL_LEN, ServerProc, exchange, serve_in_process

from paged_server import data_parallel
from paged_server.data_parallel import Replica, ReplicaRouter
from paged_server.http import Server

ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "tiny"]


@pytest.fixture(scope="module")
def fake() -> Iterator[ServerProc]:
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN, step_time=0.001)
    with serve_in_process(ARGS, engine) as (http, _app):
        yield http


def _answers(out: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The answers in `out` (Content-Length framed): (status, headers, body) each."""
    got = []
    while out:
        head, _, rest = out.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:])
        n = int(headers.get("Content-Length", "0"))
        got.append((int(lines[0].split()[1]), headers, rest[:n]))
        out = rest[n:]
    return got


def _refused(fake: ServerProc, line: bytes) -> str:
    """`line` answered by one 400 in OpenAI's shape that closes the connection (a request
    behind it is not served); its message."""
    out = exchange(fake, line + b"Host: t\r\n\r\nGET /health HTTP/1.1\r\nHost: t\r\n\r\n")
    (answer,) = _answers(out)
    status, headers, body = answer
    assert status == 400 and headers["Connection"] == "close", out
    return json.loads(body)["error"]["message"]


# ---- 1. the request line ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("line", "words"),
    [
        (b"get /health HTTP/1.1\r\n", "invalid method"),  # llhttp: methods are case-sensitive
        (b"Get /health HTTP/1.1\r\n", "invalid method"),
        (b"BREW /health HTTP/1.1\r\n", "invalid method"),  # no such method
        (b"DESCRIBE /health HTTP/1.1\r\n", "invalid method"),  # RTSP's, not HTTP/1.1's
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n", "HTTP/2"),  # HTTP/2's preface (llhttp: an error)
        (b"GET /health HTTP/1.2\r\n", "invalid HTTP version"),
        (b"GET /health HTTP/3.0\r\n", "invalid HTTP version"),
        (b"GET /health HTTP/1.10\r\n", "malformed request line"),  # one digit each
        (b"GET /health http/1.1\r\n", "malformed request line"),
        (b"GET\t/health\tHTTP/1.1\r\n", "malformed request line"),  # spaces only
        (b" GET /health HTTP/1.1\r\n", "malformed request line"),
        (b"GET /health HTTP/1.1 \r\n", "malformed request line"),
        (b"GET /h\xe9alth HTTP/1.1\r\n", "malformed request line"),  # visible ASCII only
        (b"GET health HTTP/1.1\r\n", "invalid request target"),
    ],
)
def test_request_lines_llhttp_refuses_are_400s_that_close(
    fake: ServerProc, line: bytes, words: str
) -> None:
    assert words in _refused(fake, line)


def test_a_method_llhttp_knows_reaches_the_router(fake: ServerProc) -> None:
    """405 (with Allow) for a route without it, 404 for an unknown path, as Starlette answers;
    the connection serves on (the base class answered 501 for a method without a handler)."""
    pipelined = (
        b"TRACE /health HTTP/1.1\r\nHost: t\r\n\r\n"
        b"PROPFIND /v1/models HTTP/1.1\r\nHost: t\r\n\r\n"
        b"M-SEARCH /nowhere HTTP/1.1\r\nHost: t\r\n\r\n"
        b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    )
    got = _answers(exchange(fake, pipelined))
    assert [status for status, _, _ in got] == [405, 405, 404, 200], got
    assert got[0][1]["Allow"] == "GET" and got[1][1]["Allow"] == "GET"
    assert json.loads(got[0][2])["error"]["code"] == "method_not_allowed"


def test_connect_is_answered_then_closes(fake: ServerProc) -> None:
    """llhttp hands what follows a CONNECT's headers to another protocol: never a request."""
    out = exchange(fake, b"CONNECT /health HTTP/1.1\r\nHost: t\r\n\r\nGET /health HTTP/1.1\r\n\r\n")
    ((status, headers, _),) = _answers(out)
    assert status == 405 and headers["Connection"] == "close", out


def test_runs_of_spaces_and_http_2_0(fake: ServerProc) -> None:
    """llhttp takes runs of spaces between the words. "GET / HTTP/2.0" stays a 505 (llhttp
    reads an HTTP/1 message of version 2.0; nothing here speaks HTTP/2)."""
    line = b"GET   /health  HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    assert [s for s, _, _ in _answers(exchange(fake, line))] == [200]
    out = exchange(fake, b"GET /health HTTP/2.0\r\nHost: t\r\n\r\n")
    assert [s for s, _, _ in _answers(out)] == [505], out


def test_an_http_0_9_version_gets_a_status_line(fake: ServerProc) -> None:
    """ "GET /health HTTP/0.9": llhttp takes the version and uvicorn answers with a status line
    and headers (the base class answered HTTP/0.9's way: the body alone), then closes."""
    out = exchange(fake, b"GET /health HTTP/0.9\r\nHost: t\r\n\r\n")
    ((status, headers, _),) = _answers(out)
    assert status == 200 and headers["Connection"] == "close", out


# ---- 2. the data-parallel front's deadline -------------------------------------------------
class _Replica(socketserver.ThreadingTCPServer):
    """A loopback 'replica' that reads a request's head and then runs `behave(sock)`."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, behave: Callable[[socket.socket, threading.Event], None]) -> None:
        self.stop_event = threading.Event()
        outer = self

        class _Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                data = b""
                while b"\r\n\r\n" not in data and (chunk := self.request.recv(65536)):
                    data += chunk
                behave(self.request, outer.stop_event)

        super().__init__(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True).start()

    def stop(self) -> None:
        self.stop_event.set()
        self.shutdown()
        self.server_close()


def _dribble(sock: socket.socket, stop: threading.Event, data: bytes, every: float) -> None:
    """`data` a byte at a time, one each `every` seconds (well under the front's timeout),
    until it is all sent or the test ends."""
    for i in range(len(data)):
        if stop.wait(every):
            return
        try:
            sock.sendall(data[i : i + 1])
        except OSError:  # the front gave up and closed
            return


TIMEOUT = 0.6  # the front's timeout in these tests


@pytest.fixture
def front() -> Iterator[Callable[..., SimpleNamespace]]:
    servers: list[Server] = []

    def make(*ports: int) -> SimpleNamespace:
        live = SimpleNamespace(poll=lambda: None)  # a running replica process
        replicas = [Replica(i, live, "127.0.0.1", port) for i, port in enumerate(ports)]
        router = ReplicaRouter(replicas, timeout=TIMEOUT)
        server = Server(("127.0.0.1", 0), router, io_timeout=3)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        return SimpleNamespace(
            http=ServerProc(None, "http://{}:{}".format(*server.server_address[:2]))
        )

    yield make
    for server in servers:
        server.shutdown()
        server.server_close()


BODY = json.dumps({"object": "text_completion", "choices": []}).encode()
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(
    BODY
)


def _complete(f: SimpleNamespace) -> tuple[int, object, float]:
    t0 = time.monotonic()
    status, _, out = f.http.request(
        "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}, timeout=8
    )
    return status, out, time.monotonic() - t0


@pytest.mark.parametrize("where", ["head", "body"])
def test_a_replica_dribbling_its_answer_is_a_504(front, where: str) -> None:
    """A byte every 0.1 s (each receive well within the socket timeout): cut once the whole
    answer is not in after the front's timeout (it used to be read to its end, however long)."""

    def behave(sock: socket.socket, stop: threading.Event) -> None:
        if where == "body":
            sock.sendall(HEAD)
            _dribble(sock, stop, BODY * 10, 0.1)
        else:
            _dribble(sock, stop, HEAD + BODY, 0.1)

    replica = _Replica(behave)
    try:
        status, out, took = _complete(front(replica.server_address[1]))
        assert status == 504, out
        assert out["error"]["message"].startswith("engine replica 0 timed out"), out
        assert took < TIMEOUT + 1.5, took
    finally:
        replica.stop()


def _event(i: int) -> bytes:
    data = b'data: {"i": %d}\n\n' % i
    return b"%x\r\n%s\r\n" % (len(data), data)


def test_a_stream_is_bounded_between_events_not_in_all(front) -> None:
    """Events 0.2 s apart for longer than the timeout pass whole; then one event dribbled a
    byte every 0.1 s is cut (in-band, a 504) once it is not whole after the timeout."""
    n = 6  # 1.2 s of events: twice the timeout

    def behave(sock: socket.socket, stop: threading.Event) -> None:
        sock.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        for i in range(n):
            if stop.wait(0.2):
                return
            sock.sendall(_event(i))
        _dribble(sock, stop, _event(n) * 20, 0.1)

    replica = _Replica(behave)
    try:
        f = front(replica.server_address[1])
        t0 = time.monotonic()
        conn = f.http.conn(8)
        body = json.dumps({"prompt": "hi", "max_tokens": 2, "stream": True})
        conn.request("POST", "/v1/completions", body, HEADERS)
        r = conn.getresponse()
        assert r.status == 200
        chunks = r.read().split(b"\n\n")
        events = [json.loads(c[6:]) for c in chunks if c and c != b"data: [DONE]"]
        conn.close()
        took = time.monotonic() - t0
        assert events[:n] == [{"i": i} for i in range(n)], events
        error = events[-1]["error"]
        assert error["code"] == 504 and "timed out" in error["message"], events
        assert took < n * 0.2 + TIMEOUT + 1.5, took
    finally:
        replica.stop()


def test_health_of_a_dribbling_replica_is_bounded(front, monkeypatch) -> None:
    monkeypatch.setattr(data_parallel, "_ASK_TIMEOUT", TIMEOUT)
    replica = _Replica(lambda sock, stop: _dribble(sock, stop, HEAD + BODY, 0.1))
    try:
        f = front(replica.server_address[1])
        t0 = time.monotonic()
        status, _, out = f.http.request("GET", "/health", timeout=8)
        assert status == 503 and "[0]" in out["error"]["message"], out
        assert time.monotonic() - t0 < TIMEOUT + 1.5
    finally:
        replica.stop()


def test_health_asks_every_replica_at_once(front, monkeypatch) -> None:
    """Four stalled replicas cost one ask's timeout, not four (they were asked in turn: a
    health check behind K stalled replicas took K x 10 s)."""
    monkeypatch.setattr(data_parallel, "_ASK_TIMEOUT", 1.0)
    replicas = [
        _Replica(lambda sock, stop: _dribble(sock, stop, HEAD + BODY, 0.1)) for _ in range(4)
    ]
    try:
        f = front(*(r.server_address[1] for r in replicas))
        t0 = time.monotonic()
        status, _, out = f.http.request("GET", "/health", timeout=10)
        assert status == 503 and "[0, 1, 2, 3]" in out["error"]["message"], out
        assert time.monotonic() - t0 < 3.0  # asked in turn: at least 4 s
        status, _, text = f.http.request("GET", "/metrics", timeout=10)
        assert status == 200 and text == ""  # none answered whole: an empty exposition
    finally:
        for r in replicas:
            r.stop()


def test_a_replica_connection_closing_early_keeps_its_answer_readable(front) -> None:
    """An answer that ends its connection (`Connection: close`): http.client closes the
    connection before the body is read, which the front's deadline reader must outlive."""

    def behave(sock: socket.socket, stop: threading.Event) -> None:
        sock.sendall(HEAD.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
        time.sleep(0.05)
        sock.sendall(BODY)

    replica = _Replica(behave)
    try:
        status, out, _ = _complete(front(replica.server_address[1]))
        assert status == 200 and out == json.loads(BODY), out
    finally:
        replica.stop()


# ---- 3. Anthropic's error shape for /v1/models --------------------------------------------
@pytest.fixture(scope="module")
def guarded() -> Iterator[ServerProc]:
    engine = ScriptedEngine(max_model_len=512, step_time=0.0005)
    args = ["--max-model-len", "512", "--served-model-name", "tiny", "--api-key", API_KEY]
    with serve_in_process(args, engine) as (http, _app):
        yield http


def _get(server: ServerProc, path: str, headers: dict[str, str]) -> tuple[int, dict]:
    conn = server.conn(10)
    try:
        conn.request("GET", path, headers=headers)
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def test_an_anthropic_clients_401_on_models_is_in_anthropics_shape(guarded: ServerProc) -> None:
    version = {"anthropic-version": "2023-06-01"}
    for path in ("/v1/models", "/v1/models/tiny"):
        status, body = _get(guarded, path, {**version, "x-api-key": "wrong"})
        assert status == 401, body
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error", body
        status, body = _get(guarded, path, {"Authorization": "Bearer wrong"})  # OpenAI's
        assert status == 401 and body["error"]["code"] == "invalid_api_key", body
    assert _get(guarded, "/v1/models", {**version, "x-api-key": API_KEY})[0] == 200
    anthropic = pytest.importorskip("anthropic")
    bad = anthropic.Anthropic(base_url=guarded.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        bad.models.list()
    assert err.value.body["error"]["type"] == "authentication_error"


def test_a_system_image_stays_a_400(guarded: ServerProc) -> None:
    """vLLM keeps a system block's text and drops any other block unsaid; Anthropic's
    `system` takes text blocks alone and refuses the rest: so does this (a dropped image would
    change the prompt without a word)."""
    image = {"type": "image", "source": {"type": "url", "url": "https://x/1.png"}}
    body = {
        "model": "tiny",
        "max_tokens": 4,
        "system": [{"type": "text", "text": "Be brief."}, image],
        "messages": [{"role": "user", "content": "Hi"}],
    }
    status, _, out = guarded.request("POST", "/v1/messages", body, headers={"x-api-key": API_KEY})
    assert status == 400 and out["type"] == "error", out
    assert out["error"]["message"].startswith("system[1]"), out


# ---- 4. a cancelled background stream's last event ----------------------------------------
def test_a_cancelled_background_stream_ends_with_response_cancelled() -> None:
    openai = pytest.importorskip("openai")
    engine = ScriptedEngine(max_model_len=4096, step_time=0.002)
    args = ["--max-model-len", "4096", "--served-model-name", "tiny"]
    with serve_in_process(args, engine) as (server, _app):
        engine.script = "z" * 3000  # ~6 s: cancelled long before its end
        conn = server.conn(10)
        body = {"input": "x", "background": True, "stream": True}
        conn.request("POST", "/v1/responses", json.dumps(body), HEADERS)
        r = conn.getresponse()
        assert r.status == 200
        r.readline()
        rid = json.loads(r.readline()[6:])["response"]["id"]
        status, _, cancelled = server.request("POST", f"/v1/responses/{rid}/cancel")
        assert status == 200 and cancelled["status"] == "cancelled", cancelled
        rest = r.read().decode()  # the creator's stream ends
        conn.close()
        lines = [ln for ln in rest.split("\n") if ln.startswith("data: ")]
        last = json.loads(lines[-1][6:])
        assert last["type"] == "response.cancelled", last
        assert "event: response.cancelled\n" in rest
        openai.types.responses.Response.model_validate(last["response"])
        assert last["response"]["status"] == "cancelled" and last["response"]["id"] == rid
        # a reader coming later gets every event, the cancel last, numbered on
        events = []
        conn = server.conn(10)
        conn.request("GET", f"/v1/responses/{rid}?stream=true", headers=HEADERS)
        for line in conn.getresponse().read().decode().split("\n"):
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
        conn.close()
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[-1] == last and [e["type"] for e in events].count("response.cancelled") == 1
