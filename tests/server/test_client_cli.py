"""`paged-server chat` / `complete` (client_cli.py): vLLM's terminal clients, against the real
server (streams, usage stats) and a recording stand-in (what each turn sends)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import ClassVar

from server_proc import ServerProc, local_http


def _client(*args: str, stdin: str = "", env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "paged_server", *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=120, env=env)


def test_quick_completion_and_chat_stream_from_the_server(real_server: ServerProc) -> None:
    url = f"{real_server.url}/v1"
    r = _client("complete", "--url", url, "-q", "hello", "--max-tokens", "4", "--stats")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "Using model: tiny"
    assert lines[-2].startswith("TTFT: ") and "(4 tokens in " in lines[-1], r.stdout
    r = _client("chat", "--url", url, "--model-name", "tiny", "-q", "hi there")
    assert r.returncode == 0 and r.stdout.startswith("Using model: tiny\n"), r.stderr
    assert len(r.stdout.splitlines()) >= 2  # the answer's text (it may hold newlines)


class _Recorder(BaseHTTPRequestHandler):
    """An OpenAI API stand-in: lists one model, answers each chat turn "answer N" in two
    chunks, refuses a message saying "fail", and keeps every request it got."""

    seen: ClassVar[list[tuple[str, dict, dict]]] = []

    def do_GET(self) -> None:
        self.seen.append((self.path, dict(self.headers), {}))
        self._send(200, {"object": "list", "data": [{"id": "m1"}, {"id": "m2"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append((self.path, dict(self.headers), body))
        if body["messages"][-1]["content"] == "fail":
            return self._send(400, {"error": {"message": "no failing here", "code": 400}})
        n = sum(m["role"] == "user" for m in body["messages"])
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for piece in ("answer", f" {n}"):
            chunk = {"choices": [{"index": 0, "delta": {"content": piece}}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def _send(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def _recorder() -> Iterator[str]:
    _Recorder.seen = []
    with local_http(_Recorder) as url:
        yield f"{url}/v1"


def test_chat_keeps_the_conversation_and_survives_a_refused_turn() -> None:
    import os

    env = {**os.environ, "OPENAI_API_KEY": "sk-from-env"}
    with _recorder() as url:
        args = ("chat", "--url", url, "--system-prompt", "be brief")
        r = _client(*args, stdin="first\nfail\nsecond\n", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "Using model: m1",  # the first listed
        "Please enter a message for the chat model:",
        "answer 1",
        "answer 2",
    ]
    assert "[error] 400" in r.stderr and "no failing here" in r.stderr
    posts = [(h, b) for path, h, b in _Recorder.seen if path == "/v1/chat/completions"]
    assert [b["messages"] for _, b in posts][-1] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "answer 1"},
        {"role": "user", "content": "second"},  # the refused turn left no trace
    ]
    assert all(b["stream"] and b["model"] == "m1" for _, b in posts)
    assert all(h["Authorization"] == "Bearer sk-from-env" for h, _ in posts)


def test_an_unreachable_server_is_one_clear_line() -> None:
    with _recorder() as url:
        pass  # closed: nothing listens there any more
    r = _client("complete", "--url", url, "-q", "x")
    assert r.returncode == 1 and r.stderr.startswith("paged-server complete: cannot reach "), r
