"""Regressions found by a review of this session's server changes: the 415 of a JSON route
names the Content-Type it refused without echoing a header of up to 64 KB whole."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest
from fake_engine import FakeEngine
from server_proc import MAX_MODEL_LEN, ServerProc, serve_in_process

BODY = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def fake() -> Iterator[ServerProc]:
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN, step_time=0.001)
    args = ["--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "tiny"]
    with serve_in_process(args, engine) as (http, _app):
        yield http


def test_a_415_does_not_echo_a_huge_content_type(fake) -> None:
    ctype = "text/plain; x=" + "y" * 30_000
    head = f"Content-Type: {ctype}\r\nContent-Length: {len(BODY)}\r\nHost: t\r\n\r\n"
    with socket.create_connection((fake.host, fake.port), timeout=10) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\n{head}".encode() + BODY)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
    assert out.split(b"\r\n", 1)[0].split()[1] == b"415", out[:200]
    error = json.loads(out.partition(b"\r\n\r\n")[2])["error"]
    assert error["param"] == "Content-Type" and "text/plain" in error["message"]
    assert len(error["message"]) < 400, error["message"][:120]
