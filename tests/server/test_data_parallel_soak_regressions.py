"""What a soak of `paged-server --data-parallel-size 2` found: the front must notice a client
that leaves while it waits on a replica (no byte to write yet: a non-streamed answer, a stream
between events) and close that replica connection, so the replica aborts the request as a
single server does (it was held until the replica finished, or until the front's deadline);
and a stream a replica breaks off inside an event must end with an error event a client can
parse (the cut event's bytes had gone out first). Each replica here is a raw socket that
answers as the test scripts it."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace

from paged_server.data_parallel import Replica, ReplicaRouter
from paged_server.http import Server

_EVENT = b'data: {"choices": []}\n\n'
_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
# how long a replica here waits for the front to close its connection; the front checks its
# client every 0.25 s, and its own deadline (_TIMEOUT) is far past this
_EOF_WITHIN = 10.0
_TIMEOUT = 60.0


def _read_request(conn: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += conn.recv(65536)


@contextmanager
def _front(answer: Callable[[socket.socket], None]) -> Iterator[SimpleNamespace]:
    """A front over one raw replica: `answer(conn)` serves each replica connection once its
    request was read (`seen.request`); `seen.eof` is set when the front closed a connection
    that `answer` left open (one it closed is gone)."""
    listener = socket.create_server(("127.0.0.1", 0))
    seen = SimpleNamespace(eof=threading.Event(), request=threading.Event())

    def replica() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                _read_request(conn)
                seen.request.set()
                answer(conn)
                if conn.fileno() == -1:  # `answer` closed it
                    continue
                conn.settimeout(_EOF_WITHIN)
                try:
                    if conn.recv(1) == b"":
                        seen.eof.set()
                except OSError:
                    pass

    threading.Thread(target=replica, daemon=True).start()
    live = SimpleNamespace(poll=lambda: None)
    replica_0 = Replica(0, live, "127.0.0.1", listener.getsockname()[1])
    router = ReplicaRouter([replica_0], timeout=_TIMEOUT)
    server = Server(("127.0.0.1", 0), router, io_timeout=3)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield SimpleNamespace(address=server.server_address[:2], seen=seen, router=router)
    finally:
        server.shutdown()
        server.server_close()
        listener.close()


def _send(address: tuple, stream: bool) -> socket.socket:
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 200, "stream": stream})
    sock = socket.create_connection(address, timeout=_EOF_WITHIN)
    head = "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n{body}".encode())
    return sock


def _body(raw: bytes) -> bytes:
    """The data of a whole chunked HTTP response."""
    rest, body = raw.split(b"\r\n\r\n", 1)[1], b""
    while True:
        size, rest = rest.split(b"\r\n", 1)
        if not int(size, 16):
            return body
        body, rest = body + rest[: int(size, 16)], rest[int(size, 16) + 2 :]


def _read_all(sock: socket.socket) -> bytes:
    """A chunked response up to its last chunk."""
    got = b""
    while not got.endswith(b"0\r\n\r\n"):
        chunk = sock.recv(4096)
        assert chunk, got
        got += chunk
    return got


def test_a_client_gone_before_a_whole_answer_aborts_it_on_the_replica() -> None:
    """The replica has not answered yet; the client leaves: the front closes the replica's
    connection (which aborts the request there) instead of waiting out the answer."""
    with _front(lambda conn: None) as front:
        sock = _send(front.address, stream=False)
        assert front.seen.request.wait(_EOF_WITHIN)
        sock.close()
        assert front.seen.eof.wait(_EOF_WITHIN), "the front kept the replica connection open"


def test_a_client_gone_between_stream_events_aborts_it_on_the_replica() -> None:
    """A stream whose next event is slow: the client read the first one and left; the front
    closes the replica's connection then, not at the next event it could not write."""

    def one_event(conn: socket.socket) -> None:
        conn.sendall(_STREAM_HEAD + b"%x\r\n%s\r\n" % (len(_EVENT), _EVENT))

    with _front(one_event) as front:
        sock = _send(front.address, stream=True)
        got = b""
        while _EVENT not in got:
            got += sock.recv(4096)
        sock.close()
        assert front.seen.eof.wait(_EOF_WITHIN), "the front kept the replica connection open"


def test_a_slow_replica_still_answers_a_client_that_waits() -> None:
    """Watching the client does not cut a replica that is slower than the watch interval."""
    release = threading.Event()

    def slow(conn: socket.socket) -> None:
        release.wait(0.8)  # several watch intervals with nothing to read
        conn.sendall(_STREAM_HEAD + b"%x\r\n%s\r\n" % (len(_EVENT), _EVENT))
        release.wait(0.8)
        conn.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(_EVENT), _EVENT))

    with _front(slow) as front:
        sock = _send(front.address, stream=True)
        got = _read_all(sock)
        sock.close()
    assert got.startswith(b"HTTP/1.1 200") and got.count(_EVENT) == 2, got


def test_an_event_cut_mid_way_is_held_back_so_the_error_event_parses() -> None:
    """A replica that breaks off inside an event: the client gets the whole events, then the
    front's in-band error as an event of its own (the cut event's bytes had gone out before
    it, so the error's `data:` line ran into them: no SSE parser could read it)."""

    def cut(conn: socket.socket) -> None:
        part = b'data: {"choices": [{"te'
        conn.sendall(_STREAM_HEAD + b"%x\r\n%s\r\n" % (len(_EVENT), _EVENT))
        conn.sendall(b"%x\r\n%s\r\n" % (len(part), part))
        conn.close()  # gone, no last chunk

    with _front(cut) as front:
        sock = _send(front.address, stream=True)
        got = _read_all(sock)
        sock.close()
    events = _body(got).split(b"\n\n")
    assert events[0] + b"\n\n" == _EVENT and events[-2:] == [b"data: [DONE]", b""], events
    assert len(events) == 4 and events[1].startswith(b"data: "), events
    error = json.loads(events[1][6:])["error"]
    assert error["message"].startswith("engine replica 0 broke off its stream"), error
