"""vLLM `serve` flags that paged-server accepts: the ones it acts on (--uvicorn-log-level,
--disable-uvicorn-access-log, --enable-request-id-headers, --enable-force-include-usage,
--async-scheduling, --override-pooler-config, structured-output backends, --logprobs-mode,
--uds, --log-config-file, --allowed-media-domains) and the ones it ignores with one warning
(vllm_flags.py)."""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from fake_engine import FakeEngine
from server_proc import COMMON_ARGS, HEADERS, MAX_MODEL_LEN, ServerProc, launch

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
    for argv in (["--chat-template-content-format", "xml"], ["--config-format", "bogus"]):
        with pytest.raises(SystemExit):
            parse_args(["m", *argv])
    parse_args(["m", "--chat-template-content-format", "string", "--config-format", "hf"])
    parse_args(["m", "--chat-template-content-format", "openai"])  # vLLM's three formats


def test_log_error_stack_logs_each_error_answer_with_its_stack(served: ServerProc, caplog):
    with caplog.at_level(logging.WARNING, logger="paged_server"):
        status, _, r = served.request("POST", "/v1/completions", {"prompt": "x", "n": 0})
        assert status == 400, r
    (record,) = [x for x in caplog.records if "answered 400" in x.getMessage()]
    assert "POST /v1/completions answered 400" in record.getMessage()
    assert record.exc_info is not None and record.exc_info[0].__name__ == "APIError"


# ---- --uds, --log-config-file, --allowed-media-domains ----------------------------------------
class _UnixConnection(http.client.HTTPConnection):
    """HTTP over a Unix domain socket (what `curl --unix-socket` does)."""

    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=10)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(self.path)


def test_uds_serves_http_on_a_unix_socket(tmp_path) -> None:
    """paged-server --uds PATH: the banner names it, requests (a stream too) are served over
    it, a stale socket file left by an earlier server is replaced, and stopping removes it."""
    path = str(tmp_path / "paged.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)
    stale.close()  # the file stays, no one listens: a crashed server's leftover
    server = launch(["--uds", path, *COMMON_ARGS], fake=True)
    try:
        assert server.url == f"unix:{path}"
        conn = _UnixConnection(path)
        conn.request("GET", "/health")
        health = conn.getresponse()
        assert health.status == 200 and json.loads(health.read()) == {"status": "ok"}
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body), HEADERS)
        r = conn.getresponse()
        raw = r.read().decode()
        assert r.status == 200 and raw.rstrip().endswith("data: [DONE]"), raw
        conn.close()
    finally:
        assert server.stop() == 0
    assert not os.path.exists(path)


def test_log_config_file(tmp_path, capsys) -> None:
    """--log-config-file: a logging.config dictionary applied at start; a file that is not one
    stops the server naming the flag."""
    from paged_server.cli import configure

    log_file = tmp_path / "paged.log"
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "handlers": {"f": {"class": "logging.FileHandler", "filename": str(log_file)}},
        "loggers": {"paged_server.test": {"handlers": ["f"], "level": "INFO"}},
    }
    path = tmp_path / "log.json"
    path.write_text(json.dumps(config))
    configure(parse_args(["m", "--log-config-file", str(path)]))
    logger = logging.getLogger("paged_server.test")
    logger.info("configured from the file")
    for h in logger.handlers:
        h.flush()
    assert "configured from the file" in log_file.read_text()
    for h in list(logger.handlers):
        logger.removeHandler(h)
        h.close()
    for bad in ("[1, 2]", "{oops", '{"version": 7}'):
        path.write_text(bad)
        with pytest.raises(SystemExit, match="--log-config-file"):
            configure(parse_args(["m", "--log-config-file", str(path)]))
    with pytest.raises(SystemExit, match="--log-config-file"):
        configure(parse_args(["m", "--log-config-file", str(tmp_path / "missing.json")]))


def test_allowed_media_domains_reach_the_loader() -> None:
    from paged_server.cli import build_app

    args = parse_args(["m", "--allowed-media-domains", "images.example.com", "CDN.example.com"])
    _, app = build_app(args, FakeEngine(max_model_len=MAX_MODEL_LEN))
    assert app.media.domains == {"images.example.com", "cdn.example.com"}
    _, app = build_app(parse_args(["m"]), FakeEngine(max_model_len=MAX_MODEL_LEN))
    assert app.media.domains is None


# The audit of vLLM's `serve` flags (engine args, FrontendArgs, serve's own): the ones paged
# acts on or accepts at the value it serves, and vLLM's forms of writing them.
ACCEPTED = [
    (["--max-model-len", "32k"], "max_model_len", 32000),
    (["--max-model-len=1K"], "max_model_len", 1024),
    (["--max-model-len", "auto"], "max_model_len", None),  # the model's own length
    (["--max-model-len", "-1"], "max_model_len", None),
    (["--max-num-batched-tokens", "16k"], "max_num_batched_tokens", 16000),
    (["--kv-offloading-size", "4", "--kv-offloading-backend", "native"], "cpu_offload_gib", 4.0),
    (["--optimization-level", "2"], "compilation_config", 2),
    (["--optimization-level", "2", "-cc", '{"level": 1}'], "compilation_config", {"level": 1}),
    (["-O3"], "compilation_config", 3),
    (["-O.level=3"], "compilation_config", {"level": 3}),
    (["--compilation-config.level", "3"], "compilation_config", {"level": 3}),
    (
        ["--speculative-config.method", "ngram", "--speculative-config.num_speculative_tokens=4"],
        "speculative_config",
        {"method": "ngram", "num_speculative_tokens": 4},
    ),
    (
        ["--hf-overrides.rope_scaling.factor", "2.0", "--hf-overrides.rope_scaling.rope_type=yarn"],
        "hf_overrides",
        {"rope_scaling": {"factor": 2.0, "rope_type": "yarn"}},
    ),
    (["--hf-overrides.architectures+", "A,B"], "hf_overrides", {"architectures": ["A", "B"]}),
    (["--max_model_len", "2048"], "max_model_len", 2048),
    (["--no_enable_prefix_caching"], "enable_prefix_caching", False),
    (["--enable-log-requests", "--no-enable-log-requests"], "enable_log_requests", False),
    (["--no-enable-log-requests", "--enable-log-requests"], "enable_log_requests", True),
    (["--trust-remote-code", "--no-trust-remote-code"], "trust_remote_code", False),
    (["--language-model-only"], "limit_mm_per_prompt", {"image": 0, "video": 0, "audio": 0}),
    (["--cuda-graph-sizes", "1", "2", "4"], "vllm_cuda_graph_sizes", ["1", "2", "4"]),
    (["--cudagraph-capture-sizes", "8", "16"], "vllm_cudagraph_capture_sizes", ["8", "16"]),
    (["--no-enable-dbo"], "vllm_enable_dbo", None),
    (["--cpu-offload-gb", "0"], "vllm_cpu_offload_gb", "0"),
    (["-dcp", "1", "--nnodes", "1", "--node-rank", "0"], "vllm_node_rank", "0"),
    (["--mamba-cache-dtype", "auto"], "vllm_mamba_cache_dtype", "auto"),
    (["--fingerprint-mode", "none"], "vllm_fingerprint_mode", "none"),
    (["--api-key", "k"], "api_key", "k"),
]


@pytest.mark.parametrize(("argv", "dest", "value"), ACCEPTED)
def test_vllm_flags_and_forms_parse_to_their_effect(argv, dest, value) -> None:
    assert getattr(parse_args(["m", *argv]), dest) == value


REFUSED = [
    ["--tokens-only"],
    ["--tool-server", "demo"],
    ["--middleware", "a.b"],
    ["--headless"],
    ["--skip-tokenizer-init"],
    ["--enable-per-request-metrics"],
    ["--disable-sliding-window"],
    ["--cpu-offload-gb", "4"],
    ["-dcp", "2"],
    ["--nnodes", "2"],
    ["--kv-offloading-backend", "lmcache"],
    ["--fingerprint-mode", "full"],
    ["--optimization-level", "4"],
    ["--max-model-len", "32 k"],
    ["--api-key", "a", "b"],
    ["--config", "serve.json"],
]


@pytest.mark.parametrize("argv", REFUSED)
def test_what_paged_cannot_honour_is_refused_naming_the_flag(capsys, argv) -> None:
    with pytest.raises(SystemExit):
        parse_args(["m", *argv])
    assert argv[0] in capsys.readouterr().err


def test_the_new_ignored_flags_are_named_in_the_warning(caplog) -> None:
    args = parse_args(["m", "--otlp-traces-endpoint", "http://c:4317", "--enable-log-deltas"])
    with caplog.at_level(logging.WARNING, logger="paged_server"):
        assert sorted(warn_ignored(args)) == ["--enable-log-deltas", "--otlp-traces-endpoint"]
    assert warn_ignored(parse_args(["m", "--cpu-offload-gb", "0", "--no-enable-dbo"])) == []


def test_config_file_flags_come_before_the_command_lines(tmp_path) -> None:
    """vLLM's `--config serve.yaml`: keys as flag names (dashes or underscores), true a switch,
    false its --no- form, a list one flag with its items, a mapping its JSON; the command line
    wins over the file."""
    path = tmp_path / "serve.yaml"
    path.write_text(
        "port: 9000\nmax_model_len: 2k\nenable-prefix-caching: false\ntrust-remote-code: true\n"
        "enforce-eager: false\nserved-model-name: [a, b]\ncompilation-config:\n  level: 3\n"
    )
    args = parse_args(["serve", "m", "--config", str(path), "--port", "9001"])
    assert (args.model, args.port, args.max_model_len) == ("m", 9001, 2000)
    assert args.enable_prefix_caching is False and args.trust_remote_code is True
    assert args.enforce_eager is False and args.served_model_name == ["a", "b"]
    assert args.compilation_config == {"level": 3}
    path.write_text("model: m2\n")
    assert parse_args([f"--config={path}"]).model == "m2"


def test_vllm_api_key_variable(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert parse_args(["m"]).api_key == "from-env"
    assert parse_args(["m", "--api-key", "flag"]).api_key == "flag"
    monkeypatch.delenv("VLLM_API_KEY")
    assert parse_args(["m"]).api_key is None


def test_new_forms_reach_the_engine(monkeypatch) -> None:
    seen = {}
    monkeypatch.setattr(paged_engine, "LLMEngine", lambda config: seen.setdefault("c", config))
    build_engine(parse_args(["m", "--kv-offloading-size", "2", "--optimization-level", "1"]))
    config = seen.pop("c")
    assert (config.cpu_offload_gib, config.compilation_config) == (2.0, 1)


def test_replicas_get_the_plain_command_line(tmp_path) -> None:
    """--data-parallel-size from a config file or in underscores is the router's, not passed
    on to its replicas (each would start replicas of its own)."""
    from paged_server.data_parallel import replica_argv

    path = tmp_path / "serve.yaml"
    path.write_text("data_parallel_size: 2\nport: 8001\n")
    args = parse_args(["m", "--config", str(path), "--tensor_parallel_size", "1"])
    assert args.data_parallel_size == 2
    assert replica_argv(args.command_line) == ["m", "--tensor-parallel-size", "1"]
