"""vLLM `serve` flags that paged-server accepts: the ones it acts on (--uvicorn-log-level,
--disable-uvicorn-access-log, --enable-request-id-headers, --enable-force-include-usage,
--async-scheduling, --override-pooler-config, structured-output backends, --logprobs-mode) and
the ones it ignores with one warning (vllm_flags.py)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest
from fake_engine import FakeEngine
from server_proc import COMMON_ARGS, MAX_MODEL_LEN, ServerProc

import paged_engine
from paged_server.cli import build_engine, parse_args
from paged_server.vllm_flags import IGNORED, warn_ignored


def test_every_ignored_flag_parses_and_is_named_in_one_warning(caplog) -> None:
    argv = ["m"]
    for flag, (takes_value, _) in IGNORED.items():
        argv += [flag, "1"] if takes_value else [flag]
    args = parse_args(argv)
    with caplog.at_level(logging.WARNING, logger="paged_server"):
        assert warn_ignored(args) == list(IGNORED)
    [record] = [r for r in caplog.records if "ignoring vLLM flags" in r.getMessage()]
    assert all(flag in record.getMessage() for flag in IGNORED)
    assert warn_ignored(parse_args(["m"])) == []


def test_flags_paged_acts_on(monkeypatch) -> None:
    assert parse_args(["m", "--uvicorn-log-level", "trace"]).log_level == "debug"
    assert parse_args(["m", "--log-level", "WARNING"]).log_level == "warning"
    assert parse_args(["m", "--override-pooler-config", '{"pooling_type": "MEAN"}']).pooler_config
    seen = {}
    monkeypatch.setattr(paged_engine, "LLMEngine", lambda config: seen.setdefault("c", config))
    build_engine(parse_args(["m", "--async-scheduling"]))
    assert seen.pop("c").async_scheduling is True
    build_engine(parse_args(["m", "--no-async-scheduling"]))
    assert seen.pop("c").async_scheduling is False
    build_engine(parse_args(["m"]))
    assert seen.pop("c").async_scheduling is None  # auto: on for CUDA
    for argv in (
        ["--guided-decoding-backend", "xgrammar"],
        ["--structured-outputs-config", '{"backend": "auto"}'],
        ["--logprobs-mode", "raw_logprobs"],
    ):
        parse_args(["m", *argv])


@pytest.mark.parametrize(
    "argv",
    [
        ["--uvicorn-log-level", "loud"],
        ["--guided-decoding-backend", "nope"],
        ["--structured-outputs-config", '{"backend": "auto", "disable_any_whitespace": true}'],
        ["--logprobs-mode", "processed_logits"],
    ],
)
def test_bad_values_are_refused_naming_the_flag(capsys, argv) -> None:
    with pytest.raises(SystemExit):
        parse_args(["m", *argv])
    assert argv[0] in capsys.readouterr().err


@pytest.fixture(scope="module")
def served() -> Iterator[ServerProc]:
    """A server built from the flags: request ids, no access log, usage always streamed, load
    tracked, error answers logged with their stacks."""
    from paged_server.cli import build_app
    from paged_server.http import Server

    flags = ["--enable-request-id-headers", "--disable-uvicorn-access-log"]
    flags += ["--enable-force-include-usage", "--enable-server-load-tracking", "--log-error-stack"]
    args = parse_args(["m", *flags, *COMMON_ARGS])
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN, step_time=0.001)
    client, app = build_app(args, engine)
    server = Server(
        ("127.0.0.1", 0),
        app,
        access_log=not args.disable_uvicorn_access_log,
        request_id_headers=args.enable_request_id_headers,
        log_error_stack=args.log_error_stack,
    )
    client.start()
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield ServerProc(None, "http://{}:{}".format(*server.server_address[:2]))
    finally:
        server.shutdown()
        server.server_close()
        client.stop()


def test_request_id_headers_echo_or_make_one(served: ServerProc) -> None:
    status, headers, _ = served.request("GET", "/health", headers={"X-Request-Id": "abc-123"})
    assert status == 200 and headers["X-Request-Id"] == "abc-123"
    status, headers, _ = served.request("GET", "/v1/models")
    assert status == 200 and len(headers["X-Request-Id"]) == 32
    status, headers, _ = served.request("GET", "/nope", headers={"X-Request-Id": "x" * 300})
    assert status == 404 and headers["X-Request-Id"] != "x" * 300  # too long: a new one


def test_force_include_usage_ends_every_stream_with_usage(served: ServerProc) -> None:
    events = served.stream({"prompt": "hello", "max_tokens": 3})
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert "usage" in served.stream(chat, "/v1/chat/completions")[-1]


def test_no_access_log_lines_at_info(served: ServerProc, caplog) -> None:
    with caplog.at_level(logging.DEBUG, logger="paged_server"):
        assert served.request("GET", "/health")[0] == 200
        deadline = time.monotonic() + 5  # the line is logged after the answer is sent
        while time.monotonic() < deadline:
            lines = [r for r in caplog.records if "GET /health 200" in r.getMessage()]
            if lines:
                break
            time.sleep(0.01)
    assert lines and all(r.levelno == logging.DEBUG for r in lines)


def test_load_counts_the_requests_being_answered(served: ServerProc) -> None:
    assert served.request("GET", "/load")[2] == {"server_load": 0}
    done = threading.Event()
    body = {"prompt": "hello", "max_tokens": MAX_MODEL_LEN - 8, "stream": True}

    statuses = []

    def slow() -> None:
        statuses.append(served.request("POST", "/v1/completions", body, timeout=60)[0])
        done.set()

    threading.Thread(target=slow, daemon=True).start()
    seen = set()
    while not done.is_set():
        seen.add(served.request("GET", "/load")[2]["server_load"])
    assert statuses == [200] and 1 in seen
    deadline = time.monotonic() + 5
    while served.request("GET", "/load")[2]["server_load"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert served.request("GET", "/load")[2] == {"server_load": 0}


def test_load_is_zero_without_tracking(real_server: ServerProc) -> None:
    assert real_server.request("GET", "/load")[2] == {"server_load": 0}
    for argv in (["--chat-template-content-format", "openai"], ["--config-format", "mistral"]):
        with pytest.raises(SystemExit):
            parse_args(["m", *argv])
    parse_args(["m", "--chat-template-content-format", "string", "--config-format", "hf"])


def test_log_error_stack_logs_each_error_answer_with_its_stack(served: ServerProc, caplog):
    with caplog.at_level(logging.WARNING, logger="paged_server"):
        status, _, r = served.request("POST", "/v1/completions", {"prompt": "x", "n": 0})
        assert status == 400, r
    (record,) = [x for x in caplog.records if "answered 400" in x.getMessage()]
    assert "POST /v1/completions answered 400" in record.getMessage()
    assert record.exc_info is not None and record.exc_info[0].__name__ == "APIError"
