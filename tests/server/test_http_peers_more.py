"""HTTP/1.1 details real peers rely on, as vLLM's server (uvicorn over llhttp) treats them:
`Connection` is a list of options ("TE, close" from LWP, "keep-alive, close", two header lines);
the request line, header lines and a chunked body's size, extension and trailer lines are read
as strictly as llhttp reads them (CRLF only, no stray CR or LF, no whitespace in chunk lines: a
proxy in front that reads such a line otherwise frames the body otherwise, and the bytes after
it become a smuggled request); a leading "//" in the target is not folded away. Raw sockets
over the in-process fake engine."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
from fake_engine import FakeEngine
from server_proc import MAX_MODEL_LEN, ServerProc, exchange, serve_in_process

ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "tiny"]
BODY = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
CHUNKED = HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
# what the bytes after a misread chunk line would be: a request of their own
SMUGGLED = b"GET /no/such/route HTTP/1.1\r\nHost: t\r\n\r\n"
CLOSE = b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"


@pytest.fixture(scope="module")
def fake() -> Iterator[ServerProc]:
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN, step_time=0.001)
    with serve_in_process(ARGS, engine) as (http, _app):
        yield http


def answers(out: bytes) -> list[tuple[int, bytes]]:
    """(status, header section) of every response in `out`, in order."""
    heads = re.findall(rb"HTTP/1\.1 (\d{3}) [^\r\n]*\r\n(.*?)\r\n\r\n", out, re.S)
    return [(int(status), head) for status, head in heads]


@pytest.mark.parametrize(
    "connection",
    [
        b"Connection: TE, close\r\nTE: deflate\r\n",  # what Perl's LWP sends
        b"Connection: keep-alive, close\r\n",
        b"Connection: keep-alive\r\nConnection: Close\r\n",  # two lines: a list too
    ],
)
def test_close_among_connection_options_ends_the_connection(fake, connection: bytes) -> None:
    """RFC 9112 9.6: after answering a request with the "close" option, a server closes and
    serves no request sent after it on the connection (llhttp reads every token, uvicorn stops)."""
    first = b"GET /health HTTP/1.1\r\nHost: t\r\n%s\r\n" % connection
    got = answers(exchange(fake, first + b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"))
    assert [status for status, _ in got] == [200], got
    assert b"Connection: close" in got[0][1]


def test_keep_alive_among_http10_connection_options_persists(fake) -> None:
    """An HTTP/1.0 client asking for keep-alive in a list still gets it (llhttp: the token)."""
    first = b"GET /health HTTP/1.0\r\nConnection: Keep-Alive, TE\r\nTE: trailers\r\n\r\n"
    got = answers(exchange(fake, first + CLOSE))
    assert [status for status, _ in got] == [200, 200], got
    assert b"Connection: keep-alive" in got[0][1]


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@pytest.mark.parametrize(
    "body",
    [
        b"%x\n%s\r\n0\r\n\r\n" % (len(BODY), BODY),  # a bare LF ends the size line
        b"%x;a=1\n%s\r\n0\r\n\r\n" % (len(BODY), BODY),  # ... or an extension
        b"%x \r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY),  # a space after the size
        b" %x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY),  # ... or before it
        b"%x\t;a\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY),
        b"%x; a\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY),  # a space in an extension
        b"%x;a\rb\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY),  # a bare CR in one
        b'%x;a="b\r\n%s\r\n0\r\n\r\n' % (len(BODY), BODY),  # an unclosed quoted value
        b"0x%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY),
        b"1%s\r\n" % (b"0" * 16),  # past 64 bits
        chunk(BODY) + b"0\n\n",  # the last chunk's line and the end, bare LFs
        chunk(BODY) + b"0\r\nX-T: a\n\n",  # a trailer ended by bare LFs
        chunk(BODY) + b"0\r\nX-T a\r\n\r\n",  # a trailer line without a colon
        chunk(BODY) + b"0\r\nX-T: a\x00b\r\n\r\n",  # a NUL in a trailer value
    ],
)
def test_chunk_lines_llhttp_refuses_are_a_400_that_closes(fake, body: bytes) -> None:
    got = answers(exchange(fake, CHUNKED + body + SMUGGLED + CLOSE))
    assert [status for status, _ in got] == [400], got
    assert b"Connection: close" in got[0][1]


def test_a_bare_lf_in_a_chunk_extension_smuggles_no_request(fake) -> None:
    """A proxy that lets a bare LF through inside an extension frames this body as chunks of
    2 ("00"), then 2 + len(SMUGGLED) ("\\r\\n" + SMUGGLED), then the last: one request. Ending
    the size line at that LF reads "{}" as the chunk, "00" as the last, "%x" as a trailer and
    SMUGGLED as a request of its own: whatever happens, one answer only."""
    body = b"2;\n{}\r\n00\r\n%x\r\n\r\n%s\r\n0\r\n\r\n" % (2 + len(SMUGGLED), SMUGGLED)
    got = answers(exchange(fake, CHUNKED + body))
    assert [status for status, _ in got] == [400], got


@pytest.mark.parametrize(
    "body",
    [
        b"%X\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY),  # uppercase hex
        b"%s%x\r\n%s\r\n%s\r\n\r\n" % (b"0" * 20, len(BODY), BODY, b"0" * 20),  # leading zeros
        b'%x;a;b=c;q="x \\" y"\r\n%s\r\n0;z\r\n\r\n' % (len(BODY), BODY),  # extensions
        chunk(BODY[:7]) + chunk(BODY[7:]) + b"0\r\nX-T: a b\r\nX-U:\r\n\r\n",  # trailers
    ],
)
def test_chunk_lines_llhttp_takes_are_served_on_a_kept_connection(fake, body: bytes) -> None:
    got = answers(exchange(fake, CHUNKED + body + CLOSE))
    assert [status for status, _ in got] == [200, 200], got


@pytest.mark.parametrize(
    "head",
    [
        # the email parser splits at a bare CR: a Content-Length no proxy saw
        b"GET /health HTTP/1.1\r\nHost: t\r\nX-A: a\rContent-Length: %d\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: t\nContent-Length: %d\r\n\r\n",  # a bare LF
        b"GET /health HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\n",  # ... ending them
        b"GET /health HTTP/1.1\nHost: t\r\nContent-Length: %d\r\n\r\n",  # ... the request line
        b"GET /health HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\r\n\r\n",
    ],
)
def test_lines_not_ended_by_crlf_alone_are_a_400_that_closes(fake, head: bytes) -> None:
    """llhttp refuses a bare CR or LF in the head; read as line ends, they frame a body (here
    SMUGGLED) that a proxy passing them along in a value sent as a request of its own."""
    got = answers(exchange(fake, head % len(SMUGGLED) + SMUGGLED + CLOSE))
    assert [status for status, _ in got] == [400], got
    assert b"Connection: close" in got[0][1]


@pytest.mark.parametrize("target", [b"//health", b"//v1/models", b"///v1/models"])
def test_a_leading_double_slash_routes_as_sent(fake, target: bytes) -> None:
    """Starlette matches "//v1/models" against no route: a 404, the connection kept."""
    got = answers(exchange(fake, b"GET %s HTTP/1.1\r\nHost: t\r\n\r\n" % target + CLOSE))
    assert [status for status, _ in got] == [404, 200], got
