"""Hostile and unusual peers at the connection level (raw sockets, not request bodies): a chunked
body trickled inside its size or trailer lines, blank lines before a request line, a body of
many tiny chunks, more connections than file descriptors. Over the in-process fake engine
(io_timeout 3 s)."""

from __future__ import annotations

import errno
import io
import json
import select
import socket
import socketserver
import threading
import time
import tracemalloc
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from fake_engine import FakeEngine
from server_proc import MAX_MODEL_LEN, ServerProc, serve_in_process

from paged_server.http import Handler, Server

ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "tiny"]
BODY = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"


@pytest.fixture(scope="module")
def fake() -> Iterator[ServerProc]:
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN, step_time=0.001)
    with serve_in_process(ARGS, engine) as (http, _app):
        yield http


def statuses(sock: socket.socket, want: int, timeout: float = 10.0) -> list[int]:
    """The status codes of the first `want` responses on `sock` (fewer if it closes first)."""
    file = sock.makefile("rb")
    sock.settimeout(timeout)
    out = []
    while len(out) < want and (line := file.readline()):
        out.append(int(line.split()[1]))
        length = 0
        while (h := file.readline()) not in (b"\r\n", b""):
            name, _, value = h.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        file.read(length)
    return out


@pytest.mark.parametrize(
    ("start", "drip"),
    [
        (b"", b"0"),  # a chunk-size line of leading zeros
        (b"1;", b"a"),  # a chunk extension
        (b"2\r\n{}\r\n0\r\nX-Trailer: ", b"a"),  # a trailer field
    ],
)
def test_a_trickled_chunked_body_line_is_a_408_within_the_body_deadline(
    fake, start: bytes, drip: bytes
) -> None:
    """A byte every 0.5 s never trips the per-receive timeout (3 s); the body's deadline must,
    inside a size or trailer line as inside chunk data (a line read whole would wait 3 s per
    byte of its 4 KiB)."""
    with socket.create_connection((fake.host, fake.port), timeout=10) as s:
        s.sendall(HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + start)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10 and not select.select([s], [], [], 0.5)[0]:
            s.sendall(drip)
        answered = time.monotonic() - t0
        assert statuses(s, 1) == [408] and 2.5 < answered < 6.0


def test_blank_lines_before_a_request_line_are_skipped(fake) -> None:
    """A CRLF after a body (RFC 9112 2.2: a server should skip it) must not drop the next
    request on the connection."""
    post = HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
    with socket.create_connection((fake.host, fake.port), timeout=10) as s:
        s.sendall(post + b"\r\n" + b"\r\n\r\nGET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        assert statuses(s, 2) == [200, 200]


def test_many_tiny_chunks_cost_the_memory_of_the_body_only() -> None:
    """25k one-byte chunks (150 KB on the wire): the body is 25 KB, and reading it must not
    hold a Python object per chunk (~90 bytes each: 2.2 MB here, ~1 GiB at the 16 MiB limit)."""
    handler = object.__new__(Handler)
    handler.rfile = io.BufferedReader(io.BytesIO(b"1\r\n \r\n" * 25_000 + b"0\r\n\r\n"))
    handler.server = SimpleNamespace(io_timeout=60.0, max_body_bytes=16 << 20)
    handler.close_connection = False
    tracemalloc.start()
    try:
        body = handler._read_chunked()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert body == b" " * 25_000
    assert peak < 1 << 19, f"reading a 25 KB chunked body peaked at {peak} bytes"


def test_accepting_while_out_of_descriptors_does_not_spin(monkeypatch) -> None:
    """accept() failing with EMFILE leaves the connection pending and the listening socket
    readable: the accept loop must pause, not retry at once (a core at 100% until a descriptor
    frees)."""
    server = Server(("127.0.0.1", 0), None, io_timeout=3)
    tries = []
    accept = socketserver.TCPServer.get_request

    def exhausted(self):
        if self is not server:
            return accept(self)
        tries.append(time.monotonic())
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(socketserver.TCPServer, "get_request", exhausted)
    loop = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    loop.start()
    try:
        with socket.create_connection(server.server_address[:2], timeout=5):
            time.sleep(1.2)
    finally:
        server.shutdown()
        server.server_close()
        loop.join(5)
    assert 1 <= len(tries) <= 4, f"{len(tries)} accept attempts in 1.2 s"


def test_head_on_a_streamed_get_sends_the_headers_alone(fake) -> None:
    """HEAD runs the GET route; on a streamed one (a stored background response's events) the
    SSE body must stay unsent, or the client reads it as the next response."""
    status, _, text = fake.request(
        "POST",
        "/v1/responses",
        {"input": "hi", "max_output_tokens": 3, "background": True, "store": True, "stream": True},
    )
    assert status == 200, text
    created = json.loads(text.split("data: ", 1)[1].split("\n", 1)[0])
    head = b"HEAD /v1/responses/%s?stream=true HTTP/1.1\r\nHost: t\r\n\r\n" % (
        created["response"]["id"].encode()
    )
    with socket.create_connection((fake.host, fake.port), timeout=10) as s:
        s.sendall(head + b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        file = s.makefile("rb")
        assert file.readline().startswith(b"HTTP/1.1 200")
        while file.readline() not in (b"\r\n", b""):
            pass
        assert file.readline().startswith(b"HTTP/1.1 200")  # the next response, no SSE bytes
