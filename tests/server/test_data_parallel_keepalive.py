"""The data-parallel front keeps HTTP/1.1 keep-alive connections to its replicas (a new
loopback connection per request left ~3,000 sockets in TIME_WAIT under a soak: ports run out
at a few hundred requests a second). Reuse must not cost what a connection per request gave:
an answer not read to its end (a client gone mid-stream, a replica past the deadline) closes
its connection; a pooled connection the replica closed while idle is resent once, on a new
connection, only while nothing of the answer came; the idle pool is bounded."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from fake_engine import ScriptedEngine
from server_proc import COMMON_ARGS, HEADERS, ServerProc

from paged_server.data_parallel import Replica, ReplicaRouter
from paged_server.http import Server

_LIVE = SimpleNamespace(poll=lambda: None)  # a running replica process
_OK_BODY = json.dumps({"object": "text_completion", "choices": []}).encode()
_OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
    len(_OK_BODY),
    _OK_BODY,
)
_EVENT = b'data: {"choices": []}\n\n'
_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


class _CountingServer(Server):
    """A replica server that counts the connections it accepted."""

    accepted = 0

    def get_request(self):
        got = super().get_request()
        self.accepted += 1
        return got


@contextlib.contextmanager
def _front(
    replicas: list[tuple[str, int]], **router_args
) -> Iterator[tuple[ServerProc, ReplicaRouter]]:
    router_args.setdefault("timeout", 10)
    router = ReplicaRouter(
        [Replica(i, _LIVE, host, port) for i, (host, port) in enumerate(replicas)], **router_args
    )
    server = Server(("127.0.0.1", 0), router, io_timeout=3)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield ServerProc(None, "http://{}:{}".format(*server.server_address[:2])), router
    finally:
        server.shutdown()
        server.server_close()
        router.close()


@contextlib.contextmanager
def _replicas(count: int, keep_alive: float = 5.0) -> Iterator[list[SimpleNamespace]]:
    """`count` in-process replica servers (scripted engines) that count their connections."""
    from paged_server.cli import build_app
    from paged_server.cli_args import build_parser

    with contextlib.ExitStack() as stack:
        out = []
        for _ in range(count):
            engine = ScriptedEngine(max_model_len=128, step_time=0.0005)
            engine.script = "Hello there."
            client, app = build_app(build_parser().parse_args(COMMON_ARGS), engine)
            server = _CountingServer(
                ("127.0.0.1", 0), app, keep_alive_timeout=keep_alive, io_timeout=3
            )
            client.start()
            threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
            stack.callback(client.stop)
            stack.callback(server.server_close)
            stack.callback(server.shutdown)
            out.append(SimpleNamespace(server=server, engine=engine))
        yield out


def _address(replica: SimpleNamespace) -> tuple[str, int]:
    return replica.server.server_address[:2]


def test_requests_through_the_front_reuse_replica_connections() -> None:
    """Forty requests of every kind (answers, SSE streams, /health, /metrics probes) cost the
    replicas a handful of connections, not one each."""
    with _replicas(2) as reps, _front([_address(r) for r in reps]) as (http, _):
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 4}
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
        for _ in range(10):
            status, _, out = http.request("POST", "/v1/completions", body)
            assert status == 200 and out["choices"][0]["text"] == "Hell", out
            events = http.stream(chat, "/v1/chat/completions")
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in events)
            assert text == "Hello there."
            assert http.request("GET", "/health")[0] == 200
            assert http.request("GET", "/metrics")[0] == 200
        accepted = [r.server.accepted for r in reps]
        # a connection per request: 20 answers plus 2 x 20 probes over the two replicas
        assert sum(accepted) <= 4, accepted


def test_a_stream_the_client_left_is_not_pooled() -> None:
    """A stream abandoned mid-way closes the pooled connection it ran on (the replica aborts
    the request), and the next request goes on a new connection."""
    with _replicas(1) as reps, _front([_address(reps[0])]) as (http, router):
        rep = reps[0]
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 4}
        assert http.request("POST", "/v1/completions", body)[0] == 200
        assert rep.server.accepted == 1 and router.pools[0].idle() == 1
        rep.engine.script = "z" * 100
        rep.engine.step_time = 0.05  # 5 s of tokens: the client leaves long before
        data = json.dumps({**body, "max_tokens": 100, "stream": True})
        sock = socket.create_connection((http.host, http.port), timeout=10)
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(data), data.encode())
        )
        got = b""
        while b"data: " not in got:
            chunk = sock.recv(4096)
            assert chunk, got
            got += chunk
        assert rep.server.accepted == 1  # the stream ran on the pooled connection
        sock.close()
        deadline = time.monotonic() + 5
        while "abort_request" not in rep.engine.threads and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "abort_request" in rep.engine.threads  # its connection closed: aborted there
        assert router.pools[0].idle() == 0
        rep.engine.step_time = 0.0005
        rep.engine.script = "Hello there."
        assert http.request("POST", "/v1/completions", body)[0] == 200
        assert rep.server.accepted == 2  # a new connection: the abandoned one was not reused


def test_an_idle_connection_the_replica_closed_is_not_used() -> None:
    """A replica whose keep-alive timeout is shorter than the front thinks closes the pooled
    connection while idle: the next request still gets its answer, on a new connection."""
    with _replicas(1, keep_alive=0.3) as reps, _front([_address(reps[0])]) as (http, _):
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 4}
        assert http.request("POST", "/v1/completions", body)[0] == 200
        time.sleep(0.8)  # the replica closes the idle connection
        assert http.request("POST", "/v1/completions", body)[0] == 200
        assert reps[0].server.accepted == 2


class _RawReplica:
    """A loopback replica answering HTTP/1.1 keep-alive requests by script: `script[(c, r)]`
    is what it does with request r on its c-th connection (0-based; default "ok": a whole
    200). "drop": close without answering (its keep-alive timer fired as the request came);
    "partial": part of a status line, then a reset; "stall": nothing, until the front closes;
    "stream": a whole one-event SSE stream; "slow": a whole answer after 0.5 s."""

    def __init__(self, script: dict[tuple[int, int], str] | None = None) -> None:
        self.script = script or {}
        self.requests: list[tuple[int, int]] = []
        self.connections = 0
        self.open = 0
        self.closed_by_front = 0  # connections the front closed while the replica waited
        self._lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                c, self.connections = self.connections, self.connections + 1
                self.open += 1
            threading.Thread(target=self._serve, args=(conn, c), daemon=True).start()

    def _serve(self, conn: socket.socket, c: int) -> None:
        buf = b""
        try:
            for r in range(1000):
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        with self._lock:
                            self.closed_by_front += 1
                        return
                    buf += chunk
                head, buf = buf.split(b"\r\n\r\n", 1)
                length = next(
                    (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                     if line.lower().startswith(b"content-length:")),
                    0,
                )  # fmt: skip
                while len(buf) < length:
                    buf += conn.recv(65536)
                buf = buf[length:]
                with self._lock:
                    self.requests.append((c, r))
                action = self.script.get((c, r), "ok")
                if action == "drop":
                    return
                if action == "partial":
                    conn.sendall(b"HTTP/1.1 20")
                    time.sleep(0.2)  # the front has those bytes, then a reset
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
                if action == "stall":
                    conn.settimeout(10)
                    if conn.recv(1) == b"":
                        with self._lock:
                            self.closed_by_front += 1
                    return
                if action == "slow":
                    time.sleep(0.5)
                if action == "stream":
                    chunk = b"%x\r\n%s\r\n" % (len(_EVENT), _EVENT)
                    conn.sendall(_STREAM_HEAD + chunk + b"0\r\n\r\n")
                else:
                    conn.sendall(_OK)
        except OSError:
            return
        finally:
            with self._lock:
                self.open -= 1
            conn.close()

    def close(self) -> None:
        self.listener.close()


def _complete(http: ServerProc) -> tuple[int, object]:
    status, _, out = http.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    return status, out


def test_a_pooled_connection_the_replica_dropped_is_resent_once() -> None:
    """The replica closes a pooled connection as the next request arrives (its keep-alive timer
    fired): nothing of an answer came, so the request goes again on a new connection. A new
    connection that fails too is not tried a third time."""
    rep = _RawReplica({(0, 1): "drop", (1, 1): "drop", (2, 0): "drop"})
    try:
        with _front([rep.address]) as (http, _):
            assert _complete(http)[0] == 200
            status, out = _complete(http)  # (0, 1) dropped, resent as (1, 0)
            assert status == 200, out
            assert rep.requests == [(0, 0), (0, 1), (1, 0)]
            status, out = _complete(http)  # (1, 1) dropped, resent as (2, 0): dropped too
            assert status == 502 and "did not answer" in out["error"]["message"], out
            assert rep.requests[3:] == [(1, 1), (2, 0)]
            assert _complete(http)[0] == 200  # on (3, 0)
    finally:
        rep.close()


def test_a_pooled_connection_broken_off_mid_answer_is_not_resent() -> None:
    """Part of the answer came before the replica closed: the request may have run, so the
    client gets the 502 and the replica sees it once."""
    rep = _RawReplica({(0, 1): "partial"})
    try:
        with _front([rep.address]) as (http, _):
            assert _complete(http)[0] == 200
            status, out = _complete(http)
            assert status == 502 and "did not answer" in out["error"]["message"], out
            assert rep.requests == [(0, 0), (0, 1)]
    finally:
        rep.close()


def test_a_request_past_the_deadline_closes_its_pooled_connection() -> None:
    """A replica stalling on a pooled connection: the client gets the 504 and the replica
    sees that connection closed; the next request goes on a new one."""
    rep = _RawReplica({(0, 2): "stall"})
    try:
        with _front([rep.address], timeout=1.0) as (http, _):
            for _ in range(2):
                assert _complete(http)[0] == 200
            status, out = _complete(http)
            assert status == 504, out
            deadline = time.monotonic() + 5
            while rep.closed_by_front < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert rep.closed_by_front == 1
            assert _complete(http)[0] == 200
            assert rep.requests == [(0, 0), (0, 1), (0, 2), (1, 0)]
    finally:
        rep.close()


def test_the_idle_pool_is_bounded() -> None:
    """Eight requests at once take eight connections; once answered, the front keeps
    `pool_size` of them and closes the rest."""
    rep = _RawReplica({(c, 0): "slow" for c in range(8)})
    try:
        with _front([rep.address], pool_size=3) as (http, router):
            with ThreadPoolExecutor(8) as pool:
                assert list(pool.map(lambda _: _complete(http)[0], range(8))) == [200] * 8
            assert rep.connections == 8 and router.pools[0].idle() == 3
            deadline = time.monotonic() + 5
            while rep.open > 3 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert rep.open == 3 and rep.closed_by_front == 5
            for _ in range(6):
                assert _complete(http)[0] == 200
            assert rep.connections == 8  # the pooled ones served them
    finally:
        rep.close()


def test_a_whole_stream_returns_its_connection_to_the_pool() -> None:
    rep = _RawReplica({(0, 0): "stream"})
    try:
        with _front([rep.address]) as (http, router):
            conn = http.conn(5)
            conn.request("POST", "/v1/completions", json.dumps({"stream": True}), HEADERS)
            resp = conn.getresponse()
            assert resp.status == 200 and resp.read() == _EVENT
            conn.close()
            deadline = time.monotonic() + 5
            while router.pools[0].idle() < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert _complete(http)[0] == 200
            assert rep.requests == [(0, 0), (0, 1)]
    finally:
        rep.close()
