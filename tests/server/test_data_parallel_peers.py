"""The data-parallel front (`ReplicaRouter`) over replicas that misbehave: one that answers
garbage, breaks off its answer, stalls past the front's timeout or refuses connections. The
client gets an OpenAI-style 502 naming the replica (a stall: a 504; a refused connection:
another replica serves it), the front keeps routing, and no load estimate, thread or socket
is left behind."""

from __future__ import annotations

import gc
import json
import os
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
from server_proc import ServerProc

from paged_server.data_parallel import Replica, ReplicaRouter
from paged_server.http import Server

OK_BODY = json.dumps({"object": "text_completion", "choices": []}).encode()
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
    len(OK_BODY),
    OK_BODY,
)


class _FakeReplica(socketserver.ThreadingTCPServer):
    """A loopback 'replica' whose answer to every request is `behave(sock)`."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, behave: Callable[[socket.socket], None]) -> None:
        self.behave = behave
        self.release = threading.Event()  # ends the stalls
        outer = self

        class _Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                _read_request(self.request)
                outer.behave(self.request)

        super().__init__(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True).start()

    def stop(self) -> None:
        self.release.set()
        self.shutdown()
        self.server_close()


def _read_request(sock: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (int(v) for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")[1:])
         if k.strip().lower() == b"content-length"),
        0,
    )  # fmt: skip
    while len(body) < length:
        body += sock.recv(65536)


def _refusing_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def front() -> Iterator[Callable[..., SimpleNamespace]]:
    """front(*ports) -> a router front over replicas at those loopback ports, timeout 1 s."""
    servers: list[Server] = []

    def make(*ports: int) -> SimpleNamespace:
        live = SimpleNamespace(poll=lambda: None)  # a running replica process
        replicas = [Replica(i, live, "127.0.0.1", p) for i, p in enumerate(ports)]
        router = ReplicaRouter(replicas, timeout=1.0)
        server = Server(("127.0.0.1", 0), router, io_timeout=3)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        http = ServerProc(None, "http://{}:{}".format(*server.server_address[:2]))
        return SimpleNamespace(http=http, router=router)

    yield make
    for server in servers:
        server.shutdown()
        server.server_close()


def _complete(f: SimpleNamespace) -> tuple[int, object]:
    status, _, out = f.http.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    return status, out


def _assert_502(status: int, out, replica: int, words: str) -> None:
    assert status == 502, out
    error = out["error"]
    assert error["code"] == 502 and error["type"], error
    assert error["message"].startswith(f"engine replica {replica} {words}"), error


def _idle(f: SimpleNamespace) -> None:
    deadline = time.monotonic() + 5
    while any(r.tokens_in_flight for r in f.router.replicas) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [r.tokens_in_flight for r in f.router.replicas] == [0] * len(f.router.replicas)


def _garbage(sock: socket.socket) -> None:
    sock.sendall(b"HELLO THERE\r\n\r\n")


def _half(sock: socket.socket) -> None:
    sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
    sock.sendall(b"Content-Length: 100\r\n\r\n" + OK_BODY[:10])  # then gone


def test_garbage_and_half_answers_are_502s_and_the_front_serves_on(front) -> None:
    good = _FakeReplica(lambda s: s.sendall(OK))
    bad = _FakeReplica(_garbage)
    try:
        f = front(bad.server_address[1], good.server_address[1])
        _assert_502(*_complete(f), 0, "did not answer")  # least loaded: replica 0 first
        _idle(f)
        status, out = f.http.request("GET", "/health")[::2]
        assert status == 503 and "[0]" in out["error"]["message"], out
        bad.behave = _half
        _assert_502(*_complete(f), 0, "broke off")
        bad.behave = lambda s: s.sendall(OK)
        assert _complete(f)[0] == 200
        _idle(f)
    finally:
        bad.stop()
        good.stop()


def test_a_replica_stalling_past_the_timeout_is_a_504(front) -> None:
    """Headers, then a body that never comes (a slow-loris): after the front's timeout the
    client gets a 504, a gateway timeout (it used to get a closed connection and no answer)."""
    stall = _FakeReplica(lambda s: None)

    def headers_then_wait(sock: socket.socket) -> None:
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
        sock.sendall(b"Content-Length: 100\r\n\r\n{")
        stall.release.wait(10)

    stall.behave = headers_then_wait
    try:
        f = front(stall.server_address[1])
        t0 = time.monotonic()
        status, out = _complete(f)
        assert status == 504 and out["error"]["code"] == 504, out
        assert out["error"]["message"].startswith("engine replica 0 timed out"), out
        assert time.monotonic() - t0 < 5
        _idle(f)
    finally:
        stall.stop()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_a_replica_refusing_connections_is_routed_around(front) -> None:
    """Replica 0 (the idle front's first choice) refuses connections: every request is served
    by replica 1. With every replica refusing, a 502. Nothing leaks: load estimates, threads,
    sockets."""
    good = _FakeReplica(lambda s: s.sendall(OK))
    try:
        f = front(_refusing_port(), good.server_address[1])
        _complete(f)  # warm: the front's first connection thread
        gc.collect()
        threads, fds = threading.active_count(), _fds()
        for _ in range(5):
            status, out = _complete(f)
            assert status == 200 and out == json.loads(OK_BODY), out
        _idle(f)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (threading.active_count() > threads or _fds() > fds):
            time.sleep(0.05)
            gc.collect()
        assert threading.active_count() <= threads and _fds() <= fds
        none = front(_refusing_port(), _refusing_port())
        _assert_502(*_complete(none), 1, "refused")
        _idle(none)
    finally:
        good.stop()
