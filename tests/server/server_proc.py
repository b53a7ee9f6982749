"""Start real `paged-server` processes on free loopback ports and talk to them over HTTP.

`real` servers run `python -m paged_server` over a tiny random llama (CPU); `fake` servers run the
same server code over tests/server/fake_engine.py, for HTTP behaviour that does not depend on the
model and must stay fast.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

HERE = Path(__file__).parent
MAX_MODEL_LEN = 128
HEADERS = {"Content-Type": "application/json"}


@dataclass
class ServerProc:
    proc: subprocess.Popen | None  # None: a server in this process
    url: str
    lines: list[str] = field(default_factory=list)
    ssl_context: ssl.SSLContext | None = None  # how to trust an https:// server's certificate

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname

    @property
    def port(self) -> int:
        return urlsplit(self.url).port

    def conn(self, timeout: float = 30.0) -> http.client.HTTPConnection:
        if self.url.startswith("https://"):
            return http.client.HTTPSConnection(
                self.host, self.port, timeout=timeout, context=self.ssl_context
            )
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def request(
        self,
        method: str,
        path: str,
        body: object = None,
        headers: dict[str, str] | None = None,
        timeout: float = 60.0,
    ):
        """(status, headers, parsed JSON or text) on a fresh connection."""
        c = self.conn(timeout)
        try:
            data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
            hdrs = {**HEADERS, **(headers or {})}
            c.request(method, path, body=data, headers=hdrs)
            r = c.getresponse()
            raw = r.read().decode()
            ctype = r.getheader("Content-Type", "")
            return r.status, dict(r.getheaders()), json.loads(raw) if "json" in ctype else raw
        finally:
            c.close()

    def stream(self, body: dict, path: str = "/v1/completions") -> list[dict]:
        """All SSE events of one streaming request; asserts the stream ends with [DONE]."""
        conn = self.conn(timeout=120)
        try:
            conn.request("POST", path, json.dumps({**body, "stream": True}), HEADERS)
            r = conn.getresponse()
            assert r.status == 200, r.read()
            events = []
            for line in r:
                if line.startswith(b"data: "):
                    payload = line[6:].strip()
                    if payload == b"[DONE]":
                        return events
                    events.append(json.loads(payload))
            raise AssertionError("stream ended without [DONE]")
        finally:
            conn.close()

    def metrics(self) -> dict[str, float]:
        _, _, text = self.request("GET", "/metrics")
        return parse_metrics(text)

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Wait until nothing runs or waits and no KV block is used; returns the last metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (
                m["paged:num_requests_running"] == 0
                and m["paged:num_requests_waiting"] == 0
                and m["paged:kv_cache_usage_perc"] == 0
            )
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.1)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


def exchange(server: ServerProc, data: bytes) -> bytes:
    """Everything the server sends back on one raw connection given `data`, until it closes
    the connection."""
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(data)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except ConnectionResetError:  # closed with request bytes unread
            pass
        return out


def launch(
    args: list[str], *, fake: bool, timeout: float = 180.0, env: dict[str, str] | None = None
) -> ServerProc:
    if fake:
        cmd = [sys.executable, str(HERE / "fake_server.py")]
    else:
        cmd = [sys.executable, "-m", "paged_server"]
    cmd += [*args, "--host", "127.0.0.1", "--port", "0"]
    # The fake engine takes 20 ms a step, so 100 tokens outlast a client's disconnect.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FAKE_STEP_TIME": "0.02", **(env or {})}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    server = ServerProc(proc, "")
    ready = threading.Event()

    def pump() -> None:  # keep reading so the pipe never blocks the server
        for line in proc.stdout:
            server.lines.append(line)
            if "serving on " in line and not ready.is_set():
                server.url = line.split("serving on ")[1].split()[0]
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(timeout) or not server.url:
        proc.kill()
        raise RuntimeError("server did not start:\n" + "".join(server.lines[-50:]))
    return server


COMMON_ARGS = [
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--served-model-name",
    "tiny",
    "--client-timeout",
    "3",
    "--timeout-keep-alive",
    "2",
]
REAL_ARGS = ["--dtype", "float32", "--num-gpu-blocks-override", "512", *COMMON_ARGS]
API_KEY = "sk-test-key"


@contextlib.contextmanager
def serve_in_process(args: list[str], engine: object) -> Iterator[tuple[ServerProc, object]]:
    """`paged-server ARGS` over `engine` in this process: (its HTTP handle, its app)."""
    from paged_server.cli import build_app
    from paged_server.cli_args import build_parser
    from paged_server.http import Server

    parsed = build_parser().parse_args(args)
    client, app = build_app(parsed, engine)
    server = Server(("127.0.0.1", 0), app, keep_alive_timeout=2, io_timeout=3)
    client.start()
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    host, port = server.server_address[:2]
    try:
        yield ServerProc(None, f"http://{host}:{port}"), app
    finally:
        server.shutdown()
        server.server_close()
        client.stop()


@contextlib.contextmanager
def data_parallel_front(replicas: list[ServerProc]) -> Iterator[ServerProc]:
    """The data-parallel front (ReplicaRouter) over servers already running, in this process."""
    from types import SimpleNamespace

    from paged_server.data_parallel import Replica, ReplicaRouter
    from paged_server.http import Server

    live = SimpleNamespace(poll=lambda: None)  # a replica process that is running
    router = ReplicaRouter([Replica(i, live, r.host, r.port) for i, r in enumerate(replicas)])
    front = Server(("127.0.0.1", 0), router, io_timeout=3)
    threading.Thread(target=front.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield ServerProc(None, "http://{}:{}".format(*front.server_address[:2]))
    finally:
        front.shutdown()
        front.server_close()


GREEDY_PROMPTS = ["Hello, my name is", "The capital of France is", "one two three"]


def greedy_answers(server: ServerProc) -> tuple[list[str], str, str]:
    """Greedy completions, one chat answer and one streamed completion through the official
    openai client: what two servers over the same model must agree on."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0)
    prompts = GREEDY_PROMPTS
    comp = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=8,
        temperature=0,
    )
    stream = client.completions.create(
        model="tiny", prompt=prompts[0], max_tokens=8, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].text for c in stream if c.choices)
    return [c.text for c in comp.choices], chat.choices[0].message.content, streamed


def chat_stream(server, script: str, **extra) -> dict:
    """A streamed chat completion of `server` (serve_in_process over a ScriptedEngine playing
    `script`): its deltas joined per field (reasoning, content, tool calls by index) and its
    last finish_reason."""
    server.engine.script = script
    body = {"messages": [{"role": "user", "content": "Hi"}], **extra}
    out: dict = {"reasoning_content": "", "reasoning": "", "content": "", "calls": {}}
    for event in server.http.stream(body, "/v1/chat/completions"):
        (choice,) = event["choices"]
        delta = choice["delta"]
        for key in ("reasoning_content", "reasoning", "content"):
            out[key] += delta.get(key) or ""
        for tc in delta.get("tool_calls", []):
            c = out["calls"].setdefault(tc["index"], {"id": tc.get("id"), "arguments": ""})
            c["name"] = tc["function"].get("name", c.get("name"))
            c["arguments"] += tc["function"].get("arguments", "")
        out["finish"] = choice["finish_reason"] or out.get("finish")
    return out


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name (labels dropped): value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = float(value)
    return out


def offline_chat(llm: object, messages: list[dict], mm: dict, max_tokens: int) -> object:
    """Offline greedy answer to a conversation (Hugging Face's parts form) rendered by the
    model's chat template, with `mm` as its multi_modal_data: what a chat request carrying the
    same media must give. (ids, prompt_ids, text); call it before a server's loop runs the
    engine (two threads stepping one engine would race)."""
    from types import SimpleNamespace

    from paged_engine import SamplingParams

    tok = llm.llm_engine.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = {"prompt_token_ids": tok.encode(text, add_special_tokens=False)}
    (out,) = llm.generate(
        [{**prompt, "multi_modal_data": mm}],
        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        use_tqdm=False,
    )
    ids, prompt_ids = list(out.outputs[0].token_ids), list(out.prompt_token_ids)
    return SimpleNamespace(ids=ids, prompt_ids=prompt_ids, text=text)


def fill_host(messages: list[dict], host: str) -> list[dict]:
    """`messages` with "{host}" in their image / video URLs replaced by `host` (a local HTTP
    server's address, known only once the test runs)."""
    for m in messages:
        for part in m["content"] if isinstance(m["content"], list) else ():
            for key in ("image_url", "video_url"):
                value = part.get(key)
                if isinstance(value, dict) and isinstance(value.get("url"), str):
                    value["url"] = value["url"].replace("{host}", host)
    return messages


def typed_events(server: ServerProc, path: str, body: dict | None) -> list[dict]:
    """Every event of a stream of typed events (`event: <type>` then `data: <json>` whose
    `type` is that name: the Responses and Messages APIs'), checking the framing. POSTs `body`
    (with "stream": true); a GET when it is None."""
    conn = server.conn(30)
    try:
        if body is None:
            conn.request("GET", path, headers=HEADERS)
        else:
            conn.request("POST", path, json.dumps({**body, "stream": True}), HEADERS)
        r = conn.getresponse()
        assert r.status == 200, r.read()
        assert r.getheader("Content-Type") == "text/event-stream"
        events, name = [], None
        for raw in r:
            line = raw.rstrip(b"\r\n")
            if line.startswith(b"event: "):
                name = line[7:].decode()
            elif line.startswith(b"data: "):
                event = json.loads(line[6:])
                assert event["type"] == name, (name, event)
                events.append(event)
                name = None
            else:
                assert line == b"", line
    finally:
        conn.close()
    return events


@contextlib.contextmanager
def local_http(handler: type) -> Iterator[str]:
    """A standard-library HTTP server answering with `handler` (a test's stand-in for another
    service: an object store, an OpenAI API) on a free port: its base URL."""
    from http.server import ThreadingHTTPServer

    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
