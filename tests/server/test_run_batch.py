"""`paged-server run-batch` (run_batch.py): OpenAI's batch file format offline. Each line is
answered as the server answers the same body over HTTP; failures are records, in order."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import ClassVar

import pytest
from server_proc import (
    COMMON_ARGS,
    MAX_MODEL_LEN,
    REAL_ARGS,
    ServerProc,
    local_http,
    serve_in_process,
)

HI = [{"role": "user", "content": "hi"}]
CHAT = {"model": "tiny", "messages": HI, "max_tokens": 4, "temperature": 0.0}
COMPLETION = {"prompt": ["hello", "one two"], "max_tokens": 5, "temperature": 0.0, "n": 1}
EMBED = {"input": ["hello", "world"]}
SCORE = {"queries": "a b", "documents": ["c", "d"]}
RESPONSE = {"input": "hi", "max_output_tokens": 4, "temperature": 0.0}
MESSAGE = {"model": "tiny", "messages": HI, "max_tokens": 4, "temperature": 0.0}
EXACT = {"ignore_eos": True}  # as many tokens as max_tokens asks
GOOD = [
    ("chat", "/v1/chat/completions", CHAT),
    ("cmpl", "/v1/completions", COMPLETION),
    ("emb", "/v1/embeddings", EMBED),
    ("score", "/score", SCORE),
    ("resp", "/v1/responses", RESPONSE),
    ("msg", "/v1/messages", MESSAGE),
]


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _run(args: list[str], module: str = "paged_server") -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", module, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _texts(body: dict) -> list:
    """What a greedy answer says, whichever API answered (ids and timings apart)."""
    if "choices" in body:
        return [c.get("text") or c["message"]["content"] for c in body["choices"]]
    if "content" in body:  # Anthropic's message
        return [b.get("text") for b in body["content"]]
    if body.get("object") == "response":
        return [c.get("text") for item in body["output"] for c in item.get("content", [])]
    return [round(d.get("score", 0.0), 5) for d in body["data"]]


def test_each_line_answers_as_the_server_answers_its_body(
    real_server: ServerProc, tiny_model: str, tmp_path: Path
) -> None:
    lines = [_line(cid, url, body) for cid, url, body in GOOD]
    lines[2:2] = [""]  # a blank line is skipped, as in vLLM
    bad = [
        _line("wrong-model", "/v1/completions", {"model": "nope", "prompt": "x"}),
        _line("stream", "/v1/chat/completions", {**CHAT, "stream": True}),
        _line("unknown-url", "/v1/nothing", {}),
        _line("bad-param", "/v1/completions", {"prompt": "x", "max_tokens": -1}),
        _line("bad-msg", "/v1/messages", {"model": "tiny", "messages": []}),
        json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {}}),
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),
        "not json at all",
        '{"custom_id": "nan", "method": "POST", "url": "/v1/completions", "body": NaN}',
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(lines + bad) + "\n")
    out = tmp_path / "out.jsonl"
    r = _run(
        ["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(out), tiny_model, *REAL_ARGS]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{len(GOOD) + len(bad)} lines ({len(bad)} failed)" in r.stderr
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(records) == len(GOOD) + len(bad)
    for (cid, url, body), rec in zip(GOOD, records):  # in the input's order
        assert rec["custom_id"] == cid and rec["error"] is None, rec
        assert rec["id"].startswith("batch_req_") and rec["response"]["status_code"] == 200
        got = rec["response"]["body"]
        assert rec["response"]["request_id"] == got["id"]
        status, _, want = real_server.request("POST", url, body)
        assert status == 200, want
        if url == "/v1/embeddings":
            for g, w in zip(got["data"], want["data"]):
                assert g["embedding"] == pytest.approx(w["embedding"], abs=1e-5)
        else:
            assert _texts(got) == _texts(want), (got, want)
        assert got.get("usage") == want.get("usage")
    failed = {rec["custom_id"]: rec for rec in records[len(GOOD) :]}
    assert list(failed) == [
        *("wrong-model", "stream", "unknown-url", "bad-param", "bad-msg", "get", None)
    ]  # None: the three lines without a custom_id
    status = {cid: rec["response"]["status_code"] for cid, rec in failed.items()}
    assert status == {
        "wrong-model": 404,
        "stream": 400,
        "unknown-url": 400,
        "bad-param": 400,
        "bad-msg": 400,
        "get": 400,
        None: 400,
    }
    # the route's own error body (the Messages API's in Anthropic's shape), and `error`
    assert failed["wrong-model"]["error"]["code"] == "model_not_found"
    assert failed["bad-param"]["response"]["body"]["error"]["param"] == "max_tokens"
    assert failed["bad-msg"]["response"]["body"]["type"] == "error"
    assert "stream" in failed["stream"]["error"]["message"]
    assert "/v1/chat/completions" in failed["unknown-url"]["error"]["message"]
    id_less = [rec["error"]["message"] for rec in records[-3:]]
    assert "custom_id" in id_less[0] and "line 15 is not JSON" in id_less[1], id_less
    assert "NaN" in id_less[2]


class _Store(BaseHTTPRequestHandler):
    """An object store: GET serves the input, PUT keeps the body; `fail_puts` first PUTs 503."""

    files: ClassVar[dict[str, bytes]] = {}
    fail_puts: ClassVar[int] = 0

    def do_GET(self) -> None:
        data = self.files.get(self.path)
        self.send_response(200 if data is not None else 404)
        self.send_header("Content-Length", str(len(data or b"")))
        self.end_headers()
        self.wfile.write(data or b"")

    def do_PUT(self) -> None:
        data = self.rfile.read(int(self.headers["Content-Length"]))
        if type(self).fail_puts > 0:
            type(self).fail_puts -= 1
            self.send_response(503)
        else:
            self.files[self.path] = data
            self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def _store() -> Iterator[str]:
    _Store.files, _Store.fail_puts = {}, 0
    with local_http(_Store) as url:
        yield url


def test_input_and_output_urls_under_vllms_module_path(tiny_model: str, tmp_path: Path) -> None:
    lines = [
        _line(f"r{i}", "/v1/completions", {"prompt": f"x {i}", "max_tokens": 1 + i % 4, **EXACT})
        for i in range(12)
    ]
    tmp_dir = tmp_path / "staging"
    tmp_dir.mkdir()
    with _store() as url:
        _Store.files["/batch/in.jsonl"] = ("\n".join(lines) + "\n").encode()
        args = ["-i", f"{url}/batch/in.jsonl", "-o", f"{url}/batch/out.jsonl"]
        args += ["--output-tmp-dir", str(tmp_dir), "--model", tiny_model, *REAL_ARGS]
        r = _run(args, "paged_server.entrypoints.openai.run_batch")
        assert r.returncode == 0, r.stderr[-3000:]
        records = [json.loads(x) for x in _Store.files["/batch/out.jsonl"].splitlines()]
    assert [rec["custom_id"] for rec in records] == [f"r{i}" for i in range(12)]
    usage = [rec["response"]["body"]["usage"]["completion_tokens"] for rec in records]
    assert usage == [1 + i % 4 for i in range(12)]
    assert list(tmp_dir.iterdir()) == []  # the staged output is removed once uploaded


def test_missing_paths_fail_before_the_model_loads(tmp_path: Path) -> None:
    t0 = time.monotonic()
    r = _run(["run-batch", "-i", str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "o.jsonl")])
    assert r.returncode == 2 and "none.jsonl': no such file" in r.stderr, r.stderr
    (tmp_path / "in.jsonl").write_text("")
    r = _run(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "d" / "o")])
    assert r.returncode == 2 and "no directory" in r.stderr, r.stderr
    r = _run(["run-batch", "-o", str(tmp_path / "o.jsonl")])
    assert r.returncode == 2 and "--input-file" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 60  # no engine started


@pytest.fixture(scope="module")
def batch_app(tiny_model: str) -> Iterator[object]:
    """The routes over a real engine in this process (run_batch's functions take them)."""
    from paged_engine import LLM

    llm = LLM(tiny_model, dtype="float32", max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64)
    with serve_in_process(COMMON_ARGS, llm.llm_engine) as (_, app):
        yield app


def test_records_keep_the_input_order_and_a_stop_ends_the_reading(
    batch_app, monkeypatch, caplog
) -> None:
    import io
    import logging

    from paged_server import run_batch as module
    from paged_server.run_batch import run_batch

    monkeypatch.setattr(module, "PROGRESS_EVERY", 0.01)

    # long answers first: later lines finish first, and wait for them to be written
    lines = [
        _line(f"r{i}", "/v1/completions", {"prompt": "a", "max_tokens": 24 - 2 * i, **EXACT})
        for i in range(10)
    ]
    lines = [x.encode() for x in lines]
    lines[0] = b"\xef\xbb\xbf" + lines[0]  # a byte order mark (Windows editors write one)
    sink = io.StringIO()
    with caplog.at_level(logging.INFO, logger="paged_server"):
        summary = run_batch(batch_app, iter(lines), sink, window=4)
    assert any("lines read so far done" in r.getMessage() for r in caplog.records)  # progress
    got = [json.loads(x) for x in sink.getvalue().splitlines()]
    assert [r["custom_id"] for r in got] == [f"r{i}" for i in range(10)]
    assert [r["response"]["body"]["usage"]["completion_tokens"] for r in got] == [
        24 - 2 * i for i in range(10)
    ]
    assert (summary.lines, summary.failed, summary.stopped) == (10, 0, False)

    stop = threading.Event()

    def source() -> Iterator[bytes]:
        yield from lines[:3]
        stop.set()  # a signal arrived: the lines read so far finish, no more start
        yield from lines[3:]

    sink = io.StringIO()
    summary = run_batch(batch_app, source(), sink, window=2, stop=stop)
    assert summary.stopped and summary.lines == 3 == len(sink.getvalue().splitlines())


def test_metrics_server_serves_metrics_and_health_only(batch_app) -> None:
    from paged_server.http import Server
    from paged_server.run_batch import MetricsRoutes

    server = Server(("127.0.0.1", 0), MetricsRoutes(batch_app), io_timeout=3)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    http = ServerProc(None, f"http://127.0.0.1:{server.server_address[1]}")
    try:
        status, _, text = http.request("GET", "/metrics")
        assert status == 200 and "paged:num_requests_running" in text
        assert http.request("GET", "/health")[0] == 200
        assert http.request("GET", "/v1/models")[0] == 404
        assert http.request("POST", "/metrics", {})[0] == 405
    finally:
        server.shutdown()
        server.server_close()


def test_upload_retries_then_names_the_url(monkeypatch, tmp_path: Path) -> None:
    from paged_server import run_batch

    monkeypatch.setattr(run_batch, "UPLOAD_RETRY_DELAY", 0.0)
    path = tmp_path / "out.jsonl"
    path.write_text('{"a": 1}\n')
    with _store() as url:
        _Store.fail_puts = 2  # two 503s, then taken
        run_batch.upload(f"{url}/o.jsonl", str(path), timeout=10)
        assert _Store.files["/o.jsonl"] == b'{"a": 1}\n' and _Store.fail_puts == 0
        _Store.fail_puts = run_batch.UPLOAD_ATTEMPTS
        with pytest.raises(OSError, match=f"{url}/o2.jsonl"):
            run_batch.upload(f"{url}/o2.jsonl", str(path), timeout=10)


def test_hostile_lines_are_4xx_records_never_500(batch_app) -> None:
    """Any JSON in any of a line's fields, or bytes that are not JSON, gives one well-formed
    record with a 200 or a 4xx; the batch goes on."""
    hypothesis = pytest.importorskip("hypothesis")
    from fuzz_text import any_json

    from paged_server.run_batch import BATCH_URLS, run_line

    st = hypothesis.strategies
    values = any_json()
    body = st.fixed_dictionaries({}, optional={
        "model": st.just("tiny") | values, "prompt": values, "messages": values, "input": values,
        "max_tokens": st.integers(-1, 3) | values, "stream": values, "n": values,
        "queries": values, "documents": values, "query": values,
    })  # fmt: skip
    line = st.fixed_dictionaries({}, optional={
        "custom_id": st.text(max_size=4) | values, "method": st.just("POST") | values,
        "url": st.sampled_from(BATCH_URLS) | values, "body": body | values,
    })  # fmt: skip
    raw = line.map(lambda d: json.dumps(d).encode()) | st.binary(max_size=20)

    @hypothesis.settings(max_examples=60, deadline=None, database=None)
    @hypothesis.given(raw)
    def check(data: bytes) -> None:
        rec = run_line(batch_app, data, 7)
        status = rec["response"]["status_code"]
        assert status == 200 or 400 <= status < 500, rec
        assert (rec["error"] is None) == (status == 200), rec
        assert rec["id"].startswith("batch_req_") and json.dumps(rec)

    check()
    ok = _line("ok", "/v1/completions", {"prompt": "a", "max_tokens": 2, **EXACT}).encode()
    assert run_line(batch_app, ok)["response"]["body"]["usage"]["completion_tokens"] == 2
