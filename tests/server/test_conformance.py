"""What real clients send and expect, beyond the other server tests: request bodies in chunked
transfer encoding (curl, httpx and requests send them for streamed uploads), `Expect:
100-continue`, strict framing, JSON without NaN, OpenAI's retrieve-model route, vLLM's /ping,
`max_tokens: null`, and an echoed stream's logprobs. Over the in-process fake engine, and the
real tiny model where the engine's own output matters."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest
from fake_engine import FakeEngine
from server_proc import MAX_MODEL_LEN, ServerProc, serve_in_process

ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "tiny", "org/tiny-2"]
BODY = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def fake() -> Iterator[ServerProc]:
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN, step_time=0.001)
    with serve_in_process(ARGS, engine) as (http, _app):
        yield http


class Conn:
    """One raw keep-alive connection: send bytes, read whole responses (1xx included)."""

    def __init__(self, server: ServerProc) -> None:
        self.sock = socket.create_connection((server.host, server.port), timeout=10)
        self.file = self.sock.makefile("rb")

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def response(self) -> tuple[int, dict[str, str], bytes]:
        status = int(self.file.readline().split()[1])
        headers = {}
        while (line := self.file.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        body = self.file.read(int(headers.get("content-length", 0)))
        return status, headers, body

    def closed(self) -> bool:
        try:
            return self.file.read(1) == b""
        except ConnectionResetError:  # closed with unread request bytes: a reset
            return True

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def post(head: str, body: bytes, path: str = "/v1/completions") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: t\r\n{head}\r\n".encode() + body


def chunked(body: bytes) -> bytes:
    """`body` in two chunks, the first with an extension, ended by a trailer."""
    a, b = body[:7], body[7:]
    return b"%x;ext=1\r\n%s\r\n%x\r\n%s\r\n0\r\nX-Trailer: t\r\n\r\n" % (len(a), a, len(b), b)


def test_chunked_request_bodies_are_read_and_the_connection_reused(fake) -> None:
    c = Conn(fake)
    try:
        for _ in range(2):  # the second request on the same connection
            c.send(post("Transfer-Encoding: chunked\r\n", chunked(BODY)))
            status, headers, body = c.response()
            assert status == 200, body
            assert json.loads(body)["usage"]["completion_tokens"] == 2
            assert "close" not in headers.get("connection", "")
        # with a Content-Length as well: a 400 that closes, as llhttp (uvicorn's parser)
        # answers (RFC 9112 6.3: a smuggling attempt; test_http_framing.py has the rest)
        c.send(post("Content-Length: 3\r\nTransfer-Encoding: chunked\r\n", chunked(BODY)))
        status, headers, body = c.response()
        assert status == 400 and "Transfer-Encoding" in json.loads(body)["error"]["message"]
        assert headers["connection"] == "close" and c.closed()
    finally:
        c.close()


@pytest.mark.parametrize(
    ("head", "body", "status"),
    [
        ("Transfer-Encoding: gzip, chunked\r\n", chunked(BODY), 501),
        ("Transfer-Encoding: chunked, gzip\r\n", chunked(BODY), 400),  # chunked not last
        ("Transfer-Encoding: chunked\r\n", b"zz\r\n{}\r\n0\r\n\r\n", 400),  # not hex
        ("Transfer-Encoding: chunked\r\n", b"2\r\n{}XX0\r\n\r\n", 400),  # no CRLF after data
        ("Transfer-Encoding: chunked\r\n", b"7fffffff\r\n{", 413),  # over the body limit
        ("Content-Length: 33\r\nContent-Length: 5\r\n", BODY, 400),  # conflicting lengths
        ("Content-Length: +33\r\n", BODY, 400),  # not 1*DIGIT
    ],
)
def test_bad_framing_is_an_error_that_closes(fake, head: str, body: bytes, status: int) -> None:
    c = Conn(fake)
    try:
        c.send(post(head, body))
        got, headers, payload = c.response()
        assert got == status, payload
        assert set(json.loads(payload)["error"]) == {"message", "type", "param", "code"}
        assert headers["connection"] == "close" and c.closed()
    finally:
        c.close()


def test_expect_100_continue_only_when_the_body_is_wanted(fake) -> None:
    c = Conn(fake)
    try:
        c.send(post(f"Expect: 100-continue\r\nContent-Length: {len(BODY)}\r\n", b""))
        assert c.response()[0] == 100
        c.send(BODY)
        assert c.response()[0] == 200
        # refused before the body is read: no 100, the client need not upload it
        c.send(post("Expect: 100-continue\r\nContent-Length: 999999999\r\n", b""))
        status, headers, _ = c.response()
        assert status == 413 and headers["connection"] == "close"
    finally:
        c.close()


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_and_infinity_are_not_json(fake, constant: bytes) -> None:
    schema = b'{"type": "number", "maximum": %s}' % constant
    for raw in (
        b'{"prompt": "x", "temperature": %s}' % constant,
        b'{"prompt": "x", "guided_json": %s}' % schema,
    ):
        status, _, body = fake.request("POST", "/v1/completions", raw)
        assert status == 400 and "not valid JSON" in body["error"]["message"], body


def test_retrieve_model_and_ping(fake) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=fake.url + "/v1", api_key="x", max_retries=0)
    listed = {m.id: m.model_dump() for m in client.models.list().data}
    for name in ("tiny", "org/tiny-2"):  # a served name may hold "/"
        assert client.models.retrieve(name).model_dump() == listed[name]
    status, _, body = fake.request("GET", "/v1/models/org%2Ftiny-2")
    assert status == 200 and body["id"] == "org/tiny-2"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert fake.request("DELETE", "/v1/models/tiny")[0] == 405
    assert fake.request("GET", "/ping")[0] == 200
    assert fake.request("POST", "/ping", {})[0] == 200


def test_completion_max_tokens_null_fills_the_context(fake) -> None:
    def usage(extra: dict) -> dict:
        status, _, body = fake.request("POST", "/v1/completions", {"prompt": "abc", **extra})
        assert status == 200, body
        return body["usage"]

    assert usage({})["completion_tokens"] == 16  # absent: OpenAI's default
    u = usage({"max_tokens": None})  # null: the rest of the context, as in vLLM
    assert u["prompt_tokens"] + u["completion_tokens"] == MAX_MODEL_LEN


def test_chat_checks_name_and_names_messages_for_a_long_prompt(fake) -> None:
    msgs = [{"role": "user", "content": "hi", "name": 7}]
    status, _, body = fake.request("POST", "/v1/chat/completions", {"messages": msgs})
    assert status == 400 and body["error"]["param"] == "messages[0].name"
    msgs = [{"role": "user", "content": "x" * MAX_MODEL_LEN}]
    status, _, body = fake.request("POST", "/v1/chat/completions", {"messages": msgs})
    assert status == 400 and body["error"]["param"] == "messages"
    assert str(MAX_MODEL_LEN) in body["error"]["message"]


def test_echoed_stream_offsets_continue_after_the_prompt() -> None:
    # steps of 20 ms: the stream has its chunks even on a loaded machine (1 ms steps could
    # all land in one chunk before the HTTP thread wrote the first)
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN, step_time=0.02)
    req = {"prompt": "Hello", "max_tokens": 4, "echo": True, "logprobs": 1}
    with serve_in_process(ARGS, engine) as (http, _app):
        events = http.stream(req)
    chunks = [e["choices"][0] for e in events]
    assert "".join(c["text"] for c in chunks).startswith("Hello")
    offsets = [o for c in chunks for o in c["logprobs"]["text_offset"]]
    tokens = [t for c in chunks for t in c["logprobs"]["tokens"]]
    # each token's offset is the length of the text before it, the echoed prompt included
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]
    assert "".join(tokens).startswith("Hello") and len(chunks) > 1


def test_echoed_stream_carries_the_prompt_logprobs(real_server: ServerProc) -> None:
    req = {"prompt": "Hello world", "max_tokens": 3, "echo": True, "logprobs": 1}
    req["temperature"] = 0
    _, _, whole = real_server.request("POST", "/v1/completions", req)
    want = whole["choices"][0]
    chunks = [e["choices"][0] for e in real_server.stream(req)]
    lps = [c["logprobs"] for c in chunks]
    n_prompt = whole["usage"]["prompt_tokens"]
    assert "".join(c["text"] for c in chunks) == want["text"]
    assert [t for lp in lps for t in lp["tokens"]] == want["logprobs"]["tokens"]
    got = [x for lp in lps for x in lp["token_logprobs"]]
    assert got[0] is None and None not in got[1:]  # the prompt's own, from the engine
    assert got[1:n_prompt] == pytest.approx(want["logprobs"]["token_logprobs"][1:n_prompt])
    assert lps[0]["text_offset"] == want["logprobs"]["text_offset"][: len(lps[0]["tokens"])]
    if len(lps) > 1:  # the next chunk's offsets count the echoed prompt too
        assert lps[1]["text_offset"][0] == len(chunks[0]["text"])
