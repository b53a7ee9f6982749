"""Framing and paths as vLLM's server (uvicorn's httptools parser, llhttp, and Starlette's
routing) takes them: ambiguous framing is a 400 that closes before any route runs (a
request-smuggling defence: llhttp's src/llhttp/http.ts and its test/request/content-length.md
and transfer-encoding.md), a percent-encoded path routes as its decoded form, and an accept
loop out of file descriptors warns once per episode, not twice a second. Over the in-process
fake engine."""

from __future__ import annotations

import errno
import json
import logging
import socket
import socketserver
import time
from collections.abc import Iterator

import pytest
from fake_engine import FakeEngine
from server_proc import MAX_MODEL_LEN, ServerProc, exchange, serve_in_process

from paged_server import http as paged_http
from paged_server.http import Server

# "a%41": a served name holding "%", which one decoding of the path must leave as it is
ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "tiny", "a%41"]
BODY = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
NEXT = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"  # what a smuggled body would hold


@pytest.fixture(scope="module")
def fake() -> Iterator[ServerProc]:
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN, step_time=0.001)
    with serve_in_process(ARGS, engine) as (http, _app):
        yield http


def post(head: bytes, body: bytes = BODY, path: bytes = b"/v1/completions") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n%s\r\n%s" % (
        path,
        head,
        body,
    )


def chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


def status_of(out: bytes) -> int:
    return int(out.split(b" ", 2)[1])


def assert_refused(out: bytes, status: int = 400) -> dict:
    """One answer, `status`, OpenAI's error shape, the connection closed after it."""
    assert out.count(b"HTTP/1.1 ") == 1, out  # the rest of the bytes was never served
    assert status_of(out) == status, out
    head, _, payload = out.partition(b"\r\n\r\n")
    assert b"\r\nConnection: close" in head, out
    error = json.loads(payload)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


LEN = b"%d" % len(BODY)


@pytest.mark.parametrize(
    ("head", "body"),
    [
        # both framings, in either order, whatever the values (llhttp 9: an error)
        (b"Content-Length: %s\r\nTransfer-Encoding: chunked\r\n" % LEN, chunked(BODY)),
        (b"Transfer-Encoding: chunked\r\nContent-Length: %s\r\n" % LEN, chunked(BODY)),
        (b"Content-Length: 0\r\nTransfer-Encoding: identity\r\n", BODY),
        # two Content-Lengths, even equal ones ("Duplicate Content-Length")
        (b"Content-Length: %s\r\nContent-Length: %s\r\n" % (LEN, LEN), BODY),
        (b"Content-Length: 5\r\nContent-Length: %s\r\n" % LEN, BODY),
        # not 1*DIGIT: a sign, inner space, hex, empty; past 64 bits
        (b"Content-Length: +%s\r\n" % LEN, BODY),
        (b"Content-Length: -0\r\n", BODY),
        (b"Content-Length: 1 2\r\n", BODY),
        (b"Content-Length: 0x10\r\n", BODY),
        (b"Content-Length:\r\n", BODY),
        (b"Content-Length: 18446744073709551616\r\n", BODY),
        (b"Content-Length: %s\r\n" % (b"9" * 5000), BODY),  # past int()'s 4300 digits too
        # a Transfer-Encoding whose last coding is not chunked, or that has chunked twice
        (b"Transfer-Encoding: chunked, gzip\r\n", chunked(BODY)),
        (b"Transfer-Encoding: chunked\r\nTransfer-Encoding: gzip\r\n", chunked(BODY)),
        (b"Transfer-Encoding: chunked, chunked\r\n", chunked(BODY)),
        (b"Transfer-Encoding: chunked,\r\n", chunked(BODY)),
        (b"Transfer-Encoding: identity\r\n", BODY),
        (b"Transfer-Encoding: gzip\r\n", BODY),
        (b"Transfer-Encoding:\r\n", BODY),
        # whitespace before the colon, and a folded (obs-fold) line
        (b"Content-Length : %s\r\n" % LEN, BODY),
        (b"X-A\t: a\r\nContent-Length: %s\r\n" % LEN, BODY),
        (b"X-A: a\r\n\tb\r\nContent-Length: %s\r\n" % LEN, BODY),
        (b"Content-Length:\r\n %s\r\n" % LEN, BODY),
    ],
)
def test_ambiguous_framing_is_a_400_that_closes(fake, head: bytes, body: bytes) -> None:
    assert_refused(exchange(fake, post(head, body) + NEXT))


def test_ambiguous_framing_is_refused_before_any_route(fake) -> None:
    """llhttp refuses it while parsing, so a route that reads no body (or a 404) never runs."""
    for target in (b"/health", b"/no/such/route"):
        head = b"GET %s HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\nContent-Length: 0\r\n\r\n"
        error = assert_refused(exchange(fake, head % target + NEXT))
        assert "Content-Length" in error["message"]
    get = b"GET /health HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip\r\n\r\n"
    assert "Transfer-Encoding" in assert_refused(exchange(fake, get + NEXT))["message"]


@pytest.mark.parametrize(
    "head",
    [
        b"Content-Length: \t%s \t\r\n" % LEN,  # whitespace around the digits (llhttp: fine)
        b"Content-Length: %s%s\r\n" % (b"0" * 5000, LEN),  # leading zeros, past int()'s limit
        b"Transfer-Encoding: Chunked\r\n",  # a coding's name is case-insensitive
        b"Transfer-Encoding: chunked \r\n",
    ],
)
def test_clear_framing_is_served_on_a_kept_connection(fake, head: bytes) -> None:
    body = chunked(BODY) if b"Transfer" in head else BODY
    out = exchange(
        fake, post(head, body) + NEXT + b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n"
    )
    assert out.count(b"HTTP/1.1 200 OK") == 3, out


def test_a_coding_before_chunked_is_a_501(fake) -> None:
    """llhttp lets "gzip, chunked" through (chunked ends it); paged undoes chunked alone."""
    out = exchange(fake, post(b"Transfer-Encoding: gzip, chunked\r\n", chunked(BODY)) + NEXT)
    assert assert_refused(out, 501)["code"] == "unsupported_transfer_encoding"


# ---- percent-encoded paths -----------------------------------------------------------------
@pytest.mark.parametrize(
    "path",
    ["/v1/%6dodels", "/%76%31/models", "/v1%2Fmodels", "/v1/models?x=%2F%00"],
)
def test_a_percent_encoded_path_routes_as_decoded(fake, path: str) -> None:
    """uvicorn decodes the path into scope["path"], and Starlette routes on it (%2F included)."""
    status, _, body = fake.request("GET", path)
    assert status == 200 and body["object"] == "list", body


@pytest.mark.parametrize(
    "path",
    [
        "/v1/models%00",  # a NUL ends nothing
        "/v1/models%3Fx",  # a decoded "?" is part of the path, not a query
        "/v1/../v1/models",  # dot segments are not folded (Starlette: neither)
        "/v1/%2e%2e/v1/models",
        "/v1%2F%2Fmodels",  # nor repeated slashes
        "//x/v1/models",  # an origin-form path, not an authority "x" before "/v1/models"
        "/v1/m%ffodels",  # invalid UTF-8: U+FFFD
    ],
)
def test_a_decoded_path_still_matches_routes_exactly(fake, path: str) -> None:
    status, _, body = fake.request("GET", path)
    assert status == 404 and body["error"]["code"] == "not_found", body


def test_a_model_name_is_decoded_once(fake) -> None:
    assert fake.request("GET", "/v1/models/a%2541")[2]["id"] == "a%41"
    assert fake.request("GET", "/v1/models/a%41")[0] == 404  # "aA": no such model
    assert fake.request("GET", "/v1/models/%74iny")[2]["id"] == "tiny"


def test_the_access_log_shows_the_path_as_sent(fake, caplog) -> None:
    """Decoded, a path may hold a line break: the log line keeps the bytes that came."""
    with caplog.at_level(logging.DEBUG, logger="paged_server"):
        assert fake.request("GET", "/v1/models%0Ax")[0] == 404
        deadline = time.monotonic() + 10  # the line is logged after the answer is sent
        while time.monotonic() < deadline:
            lines = [r.getMessage() for r in caplog.records if "/v1/models" in r.getMessage()]
            if any("GET /v1/models%0Ax 404" in line for line in lines):
                break
            time.sleep(0.01)
    assert any("GET /v1/models%0Ax 404" in line for line in lines), lines
    assert not any("\n" in line for line in lines), lines


# ---- out of descriptors ----------------------------------------------------------------------
def test_out_of_descriptors_warns_once_per_episode(monkeypatch, caplog) -> None:
    """Each refused accept pauses 0.5 s; the warning comes when refusals start, then every
    _ACCEPT_REMIND seconds, and once more (with the count) when an accept succeeds again."""
    server = Server(("127.0.0.1", 0), None, io_timeout=3)
    accept = socketserver.TCPServer.get_request
    refusals = [0]

    def flaky(self):
        if refusals[0]:
            refusals[0] -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return accept(self)

    monkeypatch.setattr(socketserver.TCPServer, "get_request", flaky)
    monkeypatch.setattr(paged_http, "_ACCEPT_PAUSE", 0.0)
    clients = []
    try:
        with caplog.at_level(logging.WARNING, logger="paged_server"):
            for remind in (60.0, 0.0):  # the second episode: a reminder at each later refusal
                monkeypatch.setattr(paged_http, "_ACCEPT_REMIND", remind)
                clients.append(socket.create_connection(server.server_address[:2], timeout=5))
                refusals[0] = 5
                for _ in range(5):
                    with pytest.raises(OSError):
                        server.get_request()
                conn, _ = server.get_request()
                conn.close()
    finally:
        for c in clients:
            c.close()
        server.server_close()
    messages = [r.getMessage() for r in caplog.records]
    starts = [m for m in messages if m.startswith("cannot accept connections")]
    ends = [m for m in messages if m.startswith("accepting connections again")]
    reminders = [m for m in messages if m.startswith("still cannot accept")]
    assert len(starts) == 2 and len(ends) == 2 and len(reminders) == 4, messages
    assert all("(5 accepts refused)" in m for m in ends), ends
    assert len(messages) == 8, messages
