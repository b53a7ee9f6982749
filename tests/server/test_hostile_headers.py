"""Regressions found by a long hostile soak of paged-server: header sections the standard-library
parser reads only in part must be refused, not served; HTTP/1.0 keep-alive must be announced.

Python's header parser (email.feedparser) takes the first line without a colon for the end of
the headers: every header after it, Content-Length included, was dropped and the request served
without them, and the unread body then parsed as the next request on the connection (request
smuggling behind a proxy that reads the headers whole). Folded lines (obs-fold) and NUL bytes
were kept inside header values. Each is now a 400 in OpenAI's error shape that closes the
connection (RFC 9112 5.2, RFC 9110 5.5); a clean request on the next connection is served.
The same run found HTTP/1.0 keep-alive answers missing their `Connection: keep-alive`.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest
from fake_engine import FakeEngine
from server_proc import MAX_MODEL_LEN, ServerProc, exchange, serve_in_process

BODY = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
# the smuggled "body": a second request a front proxy never saw
SMUGGLED = b"GET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n"
CL = f"Content-Length: {len(SMUGGLED)}\r\n"


@pytest.fixture(scope="module")
def fake() -> Iterator[ServerProc]:
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN, step_time=0.001)
    args = ["--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "tiny"]
    with serve_in_process(args, engine) as (http, _app):
        yield http


def request(head: str, body: bytes) -> bytes:
    return f"POST /v1/completions HTTP/1.1\r\n{head}Host: t\r\n\r\n".encode() + body


@pytest.mark.parametrize(
    "head",
    [
        f"nocolon\r\n{CL}",  # a line that is no header
        f"Bad Name: x\r\n{CL}",  # a space in a name
        f": x\r\n{CL}",  # no name
        f" X: y\r\n{CL}",  # a first line that continues
        f"Content-Type: application/json\r\n folded\r\n{CL}",
        f"X-A: a\x00b\r\n{CL}",  # a NUL in a value
        # a multipart upload's Content-Type: the parser's body defects must not hide this one
        f"Content-Type: multipart/form-data; boundary=b\r\nx\r\n{CL}",
    ],
)
def test_a_header_section_read_in_part_is_a_400_that_closes(fake, head: str) -> None:
    out = exchange(fake, request(head, SMUGGLED))
    assert out.count(b"HTTP/1.1 ") == 1, out  # one answer: the smuggled request is not served
    status_line, _, rest = out.partition(b"\r\n")
    assert status_line.split()[1] == b"400", out
    headers, _, payload = rest.partition(b"\r\n\r\n")
    assert b"Connection: close" in headers
    error = json.loads(payload)["error"]
    assert error["code"] == 400 and "header" in error["message"]


def test_clean_headers_still_keep_the_connection(fake) -> None:
    odd = "X-Odd:\tvalue \xe9\r\n"  # a tab and a non-ASCII byte are fine in a value
    head = f"Content-Type: application/json\r\n{odd}Content-Length: {len(BODY)}\r\n"
    out = exchange(fake, request(head, BODY) + b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert out.count(b"HTTP/1.1 200 OK") == 2, out
    # a multipart Content-Type on its own is clean (the parser notes a missing body part)
    multipart = f"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: {len(BODY)}\r\n"
    out = exchange(fake, request(multipart, BODY))
    assert not out.startswith(b"HTTP/1.1 400"), out


def test_an_http10_keep_alive_answer_says_so(fake) -> None:
    """An HTTP/1.0 client (ApacheBench -k, old proxies) keeps a connection only when the answer
    carries `Connection: keep-alive`; without it, one that reads to the end waited out the
    server's keep-alive timeout on every request."""
    with socket.create_connection((fake.host, fake.port), timeout=10) as sock:
        f = sock.makefile("rb")
        for _ in range(2):  # the second request on the same connection
            sock.sendall(b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            assert f.readline().split()[1] == b"200"
            headers = {}
            while (line := f.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                headers[name.strip().lower()] = value.strip()
            assert headers["connection"] == "keep-alive"
            f.read(int(headers["content-length"]))
    plain = exchange(fake, b"GET /health HTTP/1.0\r\n\r\n")  # no keep-alive asked: closed
    assert b"Connection: close" in plain and plain.count(b"HTTP/1.") == 1


@pytest.mark.parametrize(
    "ctype",
    [
        "text/plain",  # what a browser page sends cross-origin without a CORS preflight
        "application/x-www-form-urlencoded",  # curl -d without -H, the other simple type
        "multipart/form-data; boundary=b",
        "application/jsonx",
        "",
    ],
)
def test_a_json_route_refuses_other_content_types_with_a_415(fake, ctype: str) -> None:
    head = f"Content-Type: {ctype}\r\nContent-Length: {len(BODY)}\r\n"
    out = exchange(fake, request(head, BODY))
    status_line, _, rest = out.partition(b"\r\n")
    assert status_line.split()[1] == b"415", out
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["param"] == "Content-Type" and repr(ctype) in error["message"]
    assert ("curl -d" in error["message"]) == ctype.startswith("application/x-www-form")


@pytest.mark.parametrize(
    "head",
    [
        "Content-Type: Application/JSON; charset=utf-8\r\n",
        "Content-Type: application/ld+json\r\n",
        "",
    ],
)
def test_json_types_and_a_missing_type_are_served(fake, head: str) -> None:
    out = exchange(
        fake, request(f"{head}Content-Length: {len(BODY)}\r\nConnection: close\r\n", BODY)
    )
    assert out.startswith(b"HTTP/1.1 200 OK"), out
