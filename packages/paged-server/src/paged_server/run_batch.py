"""`paged-server run-batch -i IN -o OUT [MODEL] [flags]`: OpenAI's batch file format, offline, as
vLLM's `vllm run-batch` (`python -m vllm.entrypoints.openai.run_batch`) runs it.

An input line is `{"custom_id", "method": "POST", "url", "body"}`; its output line, written in
the input's order as soon as the lines before it are done, is `{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}`. Each line runs through the server's own routes
(app.py) in this process, without sockets: a body is checked and answered exactly as over HTTP.
A line that fails (not JSON, an unknown url, a stream, the route's 4xx) becomes an output line
with its status, the route's error body and `error` `{"code", "message"}`; the others run on.

Input and output: local paths, `-` (stdin / stdout), or http(s) URLs (the input read by GET; the
output written to a temporary file in --output-tmp-dir, then PUT, retried).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import urlsplit

from paged_server.errors import APIError, bad_request
from paged_server.http import parse_json_body

if TYPE_CHECKING:
    from paged_server.app import OpenAIApp
    from paged_server.http import Handler

log = logging.getLogger("paged_server")

# The routes a line may name (POST, a JSON answer): every API that runs the model.
BATCH_URLS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/messages",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/classify",
    "/v1/classify",
    "/pooling",
)
UPLOAD_ATTEMPTS = 5
UPLOAD_RETRY_DELAY = 5.0  # seconds between PUT attempts
PROGRESS_EVERY = 5.0  # seconds between progress log lines


class BatchHandler:
    """One line's request as the routes see it (the part of http.Handler they use): the body is
    already parsed, and the answer is kept instead of sent. A batch output line holds one whole
    answer, so a route starting a stream is refused."""

    client_address = ("run-batch", 0)

    def __init__(self, url: str, body: Any) -> None:
        self.path = url
        self.headers: dict[str, str] = {}
        self.log_extra = ""
        self.status = 0
        self.answer: Any = None
        self._body = body

    def read_json(self) -> Any:
        return self._body

    def send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        self.status, self.answer = status, obj

    def send_bytes(
        self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None
    ) -> None:
        self.status = status
        is_json = content_type.startswith("application/json")
        self.answer = json.loads(body) if is_json else body.decode()

    def start_stream(self) -> None:
        raise _no_stream()

    def client_gone(self) -> bool:
        return False  # the batch waits for every line


def _no_stream() -> APIError:
    return bad_request("a batch line cannot stream: leave 'stream' out or false", "stream")


def _parse_line(raw: bytes | str, lineno: int) -> dict[str, Any]:
    line = parse_json_body(raw, f"line {lineno} is not JSON")
    if not isinstance(line, dict):
        raise bad_request(f"line {lineno} must be a JSON object")
    return line


def run_line(app: OpenAIApp, raw: bytes | str, lineno: int = 1) -> dict[str, Any]:
    """The output record of input line number `lineno` (never raises: a failure is the
    record's error)."""
    custom_id = None
    try:
        line = _parse_line(raw, lineno)
        custom_id = line.get("custom_id")
        if not isinstance(custom_id, str):
            custom_id = None
            raise bad_request(f"line {lineno}: 'custom_id' must be a string", "custom_id")
        if line.get("method") != "POST":
            raise bad_request("'method' must be \"POST\"", "method")
        url = line.get("url")
        path = urlsplit(url).path.rstrip("/") if isinstance(url, str) else None
        if path not in BATCH_URLS:
            raise bad_request(
                f"url {url!r} is not served in a batch; one of {', '.join(BATCH_URLS)}", "url"
            )
        body = line.get("body")
        if not isinstance(body, dict):
            raise bad_request("'body' must be a JSON object", "body")
        if body.get("stream"):
            raise _no_stream()
        h = BatchHandler(url, body)
        app.dispatch(h, "POST", path)  # type: ignore[arg-type]  # a Handler's duck
        status, answer = h.status, h.answer
    except APIError as e:
        status, answer = e.status, json.loads(e.body())
    except Exception as e:  # a bug answered as the server answers it: one line's 500
        log.exception("run-batch: line %r failed", custom_id)
        err = APIError(500, f"internal error: {type(e).__name__}")
        status, answer = err.status, json.loads(err.body())
    rid = answer.get("id") if isinstance(answer, dict) else None
    error = None
    if status != 200:
        detail = answer.get("error") if isinstance(answer, dict) else None
        detail = detail if isinstance(detail, dict) else {}
        code = detail.get("code") or detail.get("type") or status
        error = {"code": str(code), "message": str(detail.get("message", answer))}
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {
            "status_code": status,
            "request_id": rid if isinstance(rid, str) else f"batch-{uuid.uuid4().hex}",
            "body": answer,
        },
        "error": error,
    }


class OrderedWriter:
    """Output records in the input's order, each written (and flushed, for `tail -f`) as soon
    as every record before it is: memory holds only the finished records behind the oldest
    unfinished line."""

    def __init__(self, sink: IO[str]) -> None:
        self._sink = sink
        self._held: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self.written = 0
        self.failed = 0

    def put(self, index: int, record: dict[str, Any]) -> None:
        with self._lock:
            self._held[index] = record
            if self.written not in self._held:  # an earlier line is still running
                return
            while self.written in self._held:
                out = self._held.pop(self.written)
                self._sink.write(json.dumps(out) + "\n")
                self.written += 1
                self.failed += out["error"] is not None
            self._sink.flush()


@dataclass
class BatchSummary:
    lines: int  # output records written
    failed: int  # of which with an error
    seconds: float
    stopped: bool  # interrupted before every input line ran


def run_batch(
    app: OpenAIApp,
    source: Iterable[bytes],
    sink: IO[str],
    *,
    window: int,
    stop: threading.Event | None = None,
) -> BatchSummary:
    """Run every non-blank line of `source`, at most `window` at once (the engine batches
    them), writing the records to `sink` in order. `stop` set: no further line starts."""
    stop = stop or threading.Event()
    writer = OrderedWriter(sink)
    slots = threading.Semaphore(window)
    t0 = time.monotonic()
    submitted = 0
    ended = threading.Event()

    def report() -> None:  # every PROGRESS_EVERY seconds until the batch ends
        while not ended.wait(PROGRESS_EVERY):
            log.info("run-batch: %d of %d lines read so far done", writer.written, submitted)

    def finish(index: int, fut: Future) -> None:
        try:
            writer.put(index, fut.result())
        finally:
            slots.release()

    def take_slot() -> bool:  # False once stopped (or the engine failed: lines would only 503)
        while not stop.is_set() and app.client.alive:
            if slots.acquire(timeout=0.5):
                return True
        return False

    threading.Thread(target=report, name="run-batch-progress", daemon=True).start()
    try:
        with ThreadPoolExecutor(window, thread_name_prefix="run-batch") as pool:
            for lineno, raw in enumerate(source, 1):
                if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark
                    raw = raw[3:]
                if not raw.strip():
                    continue
                if not take_slot():
                    break
                pool.submit(run_line, app, raw, lineno).add_done_callback(
                    lambda f, i=submitted: finish(i, f)
                )
                submitted += 1
    finally:
        ended.set()
    seconds = time.monotonic() - t0
    stopped = stop.is_set() or not app.client.alive
    return BatchSummary(writer.written, writer.failed, seconds, stopped)


# ---- files and URLs --------------------------------------------------------------------------
def _is_url(where: str) -> bool:
    return where.startswith(("http://", "https://"))


@contextmanager
def open_input(where: str, timeout: float) -> Iterator[Iterable[bytes]]:
    """The input's lines as bytes (each parsed on its own: a line that is not UTF-8 is that
    line's 400): a local path, `-` for stdin, or an http(s) URL read by GET as it arrives."""
    if where == "-":
        yield sys.stdin.buffer
    elif _is_url(where):
        with urllib.request.urlopen(where, timeout=timeout) as resp:
            yield resp
    else:
        with open(where, "rb") as f:
            yield f


@contextmanager
def open_output(where: str, tmp_dir: str | None, timeout: float) -> Iterator[IO[str]]:
    """Where the records go: a local path (written as they finish), `-` for stdout, or an
    http(s) URL: a temporary file in `tmp_dir` (the system's by default), PUT once complete."""
    if where == "-":
        yield sys.stdout
        return
    if not _is_url(where):
        with open(where, "w", encoding="utf-8") as f:
            yield f
        return
    fd, tmp = tempfile.mkstemp(prefix="paged-batch-", suffix=".jsonl", dir=tmp_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            yield f
        upload(where, tmp, timeout)
    finally:
        os.unlink(tmp)


def upload(url: str, path: str, timeout: float) -> None:
    """PUT the file at `url` (a presigned object-store URL, say); retried UPLOAD_ATTEMPTS times,
    UPLOAD_RETRY_DELAY apart. OSError naming the last failure."""
    size = os.path.getsize(path)
    for attempt in range(1, UPLOAD_ATTEMPTS + 1):
        try:
            with open(path, "rb") as f:
                req = urllib.request.Request(
                    url,
                    data=f,
                    method="PUT",
                    headers={"Content-Length": str(size), "Content-Type": "application/jsonl"},
                )
                with urllib.request.urlopen(req, timeout=timeout) as resp:
                    resp.read()
            log.info("run-batch: uploaded %d bytes to %s", size, url)
            return
        except OSError as e:  # urllib's HTTPError (a status >= 400) and URLError are OSErrors
            if attempt == UPLOAD_ATTEMPTS:
                raise OSError(f"could not PUT the output to {url}: {e}") from e
            log.warning("run-batch: PUT to %s failed (%s); retrying", url, e)
            time.sleep(UPLOAD_RETRY_DELAY)


# ---- command line ----------------------------------------------------------------------------
class MetricsRoutes:
    """--enable-metrics: the engine's Prometheus metrics (GET /metrics) and GET /health over HTTP
    while the batch runs; every other route is a 404."""

    def __init__(self, app: OpenAIApp) -> None:
        self.app = app

    def dispatch(self, h: Handler, method: str, path: str) -> None:
        fn = {"/metrics": self.app.metrics, "/health": self.app.health}.get(path.rstrip("/"))
        if fn is None:
            raise APIError(404, f"route {path} not found (run-batch serves /metrics, /health)")
        if method not in ("GET", "HEAD"):
            raise APIError(405, f"method {method} not allowed; use GET", headers={"Allow": "GET"})
        fn(h)

    def record(self, path: str, status: int) -> None:
        pass


def add_batch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run-batch")
    g.add_argument(
        "-i",
        "--input-file",
        required=True,
        help="the batch: a JSONL file, - for stdin, or an http(s) URL read by GET",
    )
    g.add_argument(
        "-o",
        "--output-file",
        required=True,
        help="the results: a JSONL file, - for stdout, or an http(s) URL written by PUT",
    )
    g.add_argument(
        "--output-tmp-dir",
        default=None,
        help="where the output is written before its PUT to an URL (default: the system's)",
    )
    g.add_argument(
        "--enable-metrics",
        action="store_true",
        help="serve GET /metrics (Prometheus) and /health on --url:--port while the batch runs",
    )
    g.add_argument(
        "--url", default=None, help="the metrics server's address (vLLM's; default: --host)"
    )
    g.add_argument(
        "--io-timeout",
        type=float,
        default=300.0,
        help="seconds an input GET or output PUT may stall (default 300)",
    )


def _path_problem(source: str, sink: str, tmp_dir: str | None) -> str | None:
    """Why the local input cannot be read or the output not written, or None."""
    if source != "-" and not _is_url(source) and not os.path.isfile(source):
        return f"--input-file {source!r}: no such file"
    if sink != "-" and not _is_url(sink):
        parent = os.path.dirname(os.path.abspath(sink))
        if not os.path.isdir(parent):
            return f"--output-file {sink!r}: no directory {parent!r}"
        if os.path.isdir(sink):
            return f"--output-file {sink!r} is a directory"
    if tmp_dir is not None and not os.path.isdir(tmp_dir):
        return f"--output-tmp-dir {tmp_dir!r}: no such directory"
    return None


def main(argv: list[str]) -> int:
    """`paged-server run-batch ...`; 0 once every line has its record (some may be errors), 1
    when the engine failed or the run was interrupted, 2 when it could not start."""
    from paged_server.cli import (
        bind,
        build_app,
        build_engine,
        configure,
        serves_rank0,
        start_engine,
    )
    from paged_server.cli_args import build_parser, parse_args

    parser = build_parser()
    parser.prog = "paged-server run-batch"
    parser.usage = "paged-server run-batch -i INPUT -o OUTPUT [MODEL] [options]"
    parser.description = (
        "Run a file of OpenAI batch requests offline (vLLM's `vllm run-batch`): one record per "
        "line, in order. Every paged-server flag applies."
    )
    parser.epilog = None
    add_batch_args(parser)
    args = parse_args(argv, parser)
    configure(args)
    if serves_rank0(args):  # rank 0 runs the batch
        build_engine(args)
        return 0
    if args.data_parallel_size != 1:
        print("paged-server run-batch: runs one engine (no --data-parallel-size)", file=sys.stderr)
        return 2
    problem = _path_problem(args.input_file, args.output_file, args.output_tmp_dir)
    if problem is not None:  # before the model loads
        print(f"paged-server run-batch: {problem}", file=sys.stderr)
        return 2
    server = None
    if args.enable_metrics:
        args.host = args.url or args.host
        server = bind(args)
        if server is None:
            return 2
    engine = start_engine(args, "paged-server run-batch")  # None: it said why
    app = None
    if engine is not None:
        try:
            client, app = build_app(args, engine)
        except ValueError as e:  # an invalid --lora-modules adapter, a media setting
            print(f"paged-server run-batch: cannot start: {e}", file=sys.stderr)
            engine.shutdown()
    if app is None:
        if server is not None:
            server.server_close()
        return 2
    app.api_key = None  # lines are not HTTP requests: nothing to authenticate
    if server is not None:
        server.app = MetricsRoutes(app)
        server.server_activate()
        threading.Thread(target=server.serve_forever, args=(0.1,), daemon=True).start()
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        stop.set()  # no more lines start; those running are aborted, their records say so
        client.abort_all()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    outcome: list[BatchSummary | BaseException] = []

    def drive() -> None:
        try:
            window = 2 * int(getattr(engine.config, "max_num_seqs", 256))
            with (
                open_input(args.input_file, args.io_timeout) as source,
                open_output(args.output_file, args.output_tmp_dir, args.io_timeout) as sink,
            ):
                outcome.append(run_batch(app, source, sink, window=window, stop=stop))
        except BaseException as e:  # reported on the main thread
            outcome.append(e)
        finally:
            client.stop()

    client.start(engine_thread=False)
    driver = threading.Thread(target=drive, name="run-batch", daemon=True)
    driver.start()
    client.run_engine_loop()  # on the thread that loaded the engine, until drive() stops it
    driver.join()
    if server is not None:
        server.shutdown()
        server.server_close()
    engine.shutdown()  # stops worker ranks (tensor / pipeline parallelism)
    result = outcome[0] if outcome else RuntimeError("the batch did not run")
    if isinstance(result, BaseException):
        print(f"paged-server run-batch: {result}", file=sys.stderr)
        return 1
    print(
        f"paged-server run-batch: {result.lines} lines ({result.failed} failed) in "
        f"{result.seconds:.1f} s -> {args.output_file}",
        file=sys.stderr,
    )
    if client.failure is not None:
        print(f"paged-server run-batch: the engine failed: {client.failure}", file=sys.stderr)
        return 1
    return 1 if result.stopped else 0
