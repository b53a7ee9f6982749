"""HTTP/1.1 edge cases against vLLM's stack (uvicorn over httptools/llhttp, Starlette's router):
an HTTP/1.0 request in chunked encoding (RFC 9112 6.1: served, then the connection closes), a
tab after `chunked` (llhttp: not chunked, a 400), and a trailing "/" (Starlette's
redirect_slashes: a 307 to the path without it, when that path is a route). Over the in-process
fake engine, raw sockets and the official openai client."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fake_engine import FakeEngine
from server_proc import (
    API_KEY,
    MAX_MODEL_LEN,
    ServerProc,
    data_parallel_front,
    exchange,
    serve_in_process,
)

ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "tiny", "org/tiny-é"]
BODY = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
NEXT = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"  # served only on a kept connection
CLOSE = b"\r\nConnection: close\r\n\r\n"


@pytest.fixture(scope="module")
def fake() -> Iterator[ServerProc]:
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN, step_time=0.001)
    with serve_in_process(ARGS, engine) as (http, _app):
        yield http


def chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


def answers(out: bytes) -> list[tuple[bytes, dict[str, str], bytes]]:
    """Every (status line, lowercased headers, body) in `out` (Content-Length framed)."""
    found = []
    while out:
        head, _, out = out.partition(b"\r\n\r\n")
        status, *lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        n = int(headers.get("content-length", 0))
        found.append((status.encode(), headers, out[:n]))
        out = out[n:]
    return found


# ---- HTTP/1.0 with Transfer-Encoding -------------------------------------------------------
def test_http10_chunked_is_served_then_the_connection_closes(fake) -> None:
    """RFC 9112 6.1: an HTTP/1.0 message with Transfer-Encoding has faulty framing, and the
    connection closes after it, even when the client asked to keep it. llhttp and h11 both read
    the body as chunked; uvicorn closes every HTTP/1.0 connection after its answer."""
    head = (
        b"POST /v1/completions HTTP/1.0\r\nHost: t\r\nConnection: keep-alive\r\n"
        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    got = answers(exchange(fake, head + chunked(BODY) + NEXT))
    assert len(got) == 1, got  # the request after it was never read
    status, headers, body = got[0]
    assert status.startswith(b"HTTP/1.1 200"), got
    assert headers["connection"] == "close"
    assert json.loads(body)["usage"]["completion_tokens"] == 2


def test_http10_keep_alive_without_transfer_encoding_still_persists(fake) -> None:
    head = b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"
    got = answers(exchange(fake, head + b"GET /health HTTP/1.0\r\n\r\n"))
    assert [h.get("connection") for _, h, _ in got] == ["keep-alive", "close"], got


def test_http10_with_both_framings_is_a_400(fake) -> None:
    head = (
        b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" % len(chunked(BODY))
    )
    got = answers(exchange(fake, head + chunked(BODY) + NEXT))
    assert len(got) == 1 and got[0][0].startswith(b"HTTP/1.1 400"), got


# ---- whitespace after "chunked" --------------------------------------------------------------
def post(te: bytes) -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: %s\r\n\r\n%s" % (te, chunked(BODY))
    )


@pytest.mark.parametrize("te", [b"chunked\t", b"chunked \t", b"gzip, chunked\t"])
def test_a_tab_after_chunked_is_a_400(fake, te: bytes) -> None:
    """llhttp (src/llhttp/http.ts, header_value_te_chunked_last) skips spaces only after
    "chunked": a tab makes it another coding, and a request not ending in chunked is refused
    ("Request has invalid `Transfer-Encoding`"). h11 would drop the tab; vLLM runs llhttp."""
    got = answers(exchange(fake, post(te) + NEXT))
    assert len(got) == 1, got
    status, headers, body = got[0]
    assert status.startswith(b"HTTP/1.1 400") and headers["connection"] == "close", got
    assert "Transfer-Encoding" in json.loads(body)["error"]["message"]


@pytest.mark.parametrize("te", [b"chunked  ", b"\tchunked", b"gzip\t,\tchunked"])
def test_whitespace_llhttp_skips_around_chunked(fake, te: bytes) -> None:
    """Spaces after chunked, tabs before a coding: chunked to llhttp ("gzip, ..." then
    reaches the body reader, which undoes chunked alone: a 501)."""
    got = answers(exchange(fake, post(te) + NEXT.replace(b"\r\n\r\n", CLOSE)))
    if te.startswith(b"gzip"):
        assert got[0][0].startswith(b"HTTP/1.1 501"), got
    else:
        assert [s[:12] for s, _, _ in got] == [b"HTTP/1.1 200"] * 2, got


# ---- trailing slashes --------------------------------------------------------------------------
def get(server: ServerProc, target: bytes, head: bytes) -> list:
    return answers(exchange(server, b"GET %s HTTP/1.1\r\n%s\r\n" % (target, head)))


@pytest.mark.parametrize(
    ("target", "location"),
    [
        (b"/v1/models/", "http://t/v1/models"),
        (b"/v1/models//", "http://t/v1/models"),  # every trailing "/" (rstrip)
        (b"/v1/models%2F", "http://t/v1/models"),  # the decoded path is the one routed
        (b"/health/?a=b%20c&d", "http://t/health?a=b%20c&d"),  # the query as sent
        (b"/v1/models/tiny/", "http://t/v1/models/tiny"),
        (b"/v1/models/org/tiny-%C3%A9/", "http://t/v1/models/org/tiny-%C3%A9"),  # re-encoded
        (b"/v1/completions/", "http://t/v1/completions"),  # GET: a 405 there, as Starlette
        (b"http://t/v1/models/", "http://t/v1/models"),  # absolute-form
    ],
)
def test_a_trailing_slash_redirects_like_starlette(fake, target: bytes, location: str) -> None:
    """starlette/routing.py Router.app: no route matches, the path without its trailing "/"
    does (for any method) -> RedirectResponse(URL(scope)): 307, an empty body, Location the
    Host header's absolute URL with the query kept, percent-encoded by quote()."""
    head = b"Host: t\r\nConnection: close\r\n"
    [(status, headers, body)] = get(fake, target, head)
    assert status.startswith(b"HTTP/1.1 307"), (status, headers, body)
    assert headers["location"] == location and headers["content-length"] == "0"
    assert body == b"" and "content-type" not in headers


def test_a_redirect_keeps_the_connection_and_head_gets_one_too(fake) -> None:
    out = get(
        fake,
        b"/v1/models/",
        b"Host: t\r\n\r\nHEAD /v1/models/ HTTP/1.1\r\nHost: t\r\nConnection: close\r\n",
    )
    assert [(s[:12], h["location"]) for s, h, _ in out] == [
        (b"HTTP/1.1 307", "http://t/v1/models")
    ] * 2


def test_without_a_host_the_location_names_the_address_reached(fake) -> None:
    out = answers(exchange(fake, b"GET /health/ HTTP/1.0\r\n\r\n"))
    assert out[0][1]["location"] == f"http://{fake.host}:{fake.port}/health", out


@pytest.mark.parametrize("target", [b"/no/such/", b"/v1/models2/", b"//", b"/v1/responses/x/y/"])
def test_a_trailing_slash_on_no_route_is_a_404(fake, target: bytes) -> None:
    [(status, _, body)] = get(fake, target, b"Host: t\r\nConnection: close\r\n")
    assert status.startswith(b"HTTP/1.1 404"), (status, body)
    assert json.loads(body)["error"]["code"] == "not_found"


def test_a_post_redirected_with_its_body_unread_closes(fake) -> None:
    """The unread body would be read as the next request: the 307 says Connection: close."""
    head = b"Host: t\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" % len(BODY)
    out = answers(exchange(fake, b"POST /v1/completions/ HTTP/1.1\r\n%s\r\n%s" % (head, BODY)))
    assert len(out) == 1 and out[0][0].startswith(b"HTTP/1.1 307"), out
    assert out[0][1]["connection"] == "close"


def test_the_api_key_is_checked_before_the_redirect() -> None:
    """vLLM's API-key middleware runs before Starlette's router."""
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN, step_time=0.001)
    with serve_in_process([*ARGS, "--api-key", API_KEY], engine) as (http, _app):
        status, headers, _ = http.request("GET", "/v1/models/")
        assert status == 401, headers
        auth = {"Authorization": f"Bearer {API_KEY}"}
        status, headers, _ = http.request("GET", "/v1/models/", headers=auth)
        assert status == 307 and headers["Location"].endswith("/v1/models"), headers


def test_the_data_parallel_front_redirects_too(fake) -> None:
    """The front relays no replica's Location: it answers the redirect itself."""
    with data_parallel_front([fake]) as front:
        status, headers, _ = front.request("GET", "/v1/models/", headers={"Host": "h:1"})
        assert (status, headers["Location"]) == (307, "http://h:1/v1/models"), headers
        status, _, body = front.request("GET", "/v1/models")
        assert status == 200 and body["data"][0]["id"] == "tiny", body


def test_real_clients_follow_the_redirect(fake) -> None:
    """The openai client (httpx, follow_redirects) repeats a POST and its body at the
    Location; urllib follows a GET."""
    import urllib.request

    with urllib.request.urlopen(fake.url + "/v1/models/", timeout=10) as r:
        assert r.status == 200 and r.url == fake.url + "/v1/models"
        assert json.loads(r.read())["object"] == "list"
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=fake.url + "/v1", api_key="EMPTY", max_retries=0)
    out = client.post(
        "/completions/",
        body={"model": "tiny", "prompt": "hello", "max_tokens": 2},
        cast_to=openai.types.Completion,
    )
    assert out.usage.completion_tokens == 2
