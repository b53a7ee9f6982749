"""Regressions found by a review of this session's server changes: the 415 of a JSON route
names the Content-Type it refused without echoing a header of up to 64 KB whole."""

from __future__ import annotations

import json

from test_hostile_headers import (
    BODY,
    exchange,
    fake,  # noqa: F401 (a fixture: the in-process fake server)
)


def test_a_415_does_not_echo_a_huge_content_type(fake) -> None:  # noqa: F811
    ctype = "text/plain; x=" + "y" * 30_000
    head = f"Content-Type: {ctype}\r\nContent-Length: {len(BODY)}\r\nHost: t\r\n\r\n"
    out = exchange(fake, f"POST /v1/completions HTTP/1.1\r\n{head}".encode() + BODY)
    assert out.split(b"\r\n", 1)[0].split()[1] == b"415", out[:200]
    error = json.loads(out.partition(b"\r\n\r\n")[2])["error"]
    assert error["param"] == "Content-Type" and "text/plain" in error["message"]
    assert len(error["message"]) < 400, error["message"][:120]
