"""Review of the /metrics exposition (session 6): what a scraper reads when no replica answers
the data-parallel front, and the `le` bounds vLLM's prometheus_client writes for token-count
buckets past a million (1-2-5 buckets up to a long max_model_len)."""

from __future__ import annotations

import socket
import threading
from types import SimpleNamespace

from server_proc import ServerProc
from test_metrics_peers import PROMETHEUS_ACCEPT, _stats, buckets, parse

from paged_server.data_parallel import Replica, ReplicaRouter
from paged_server.exposition import merge_expositions, num, to_openmetrics
from paged_server.http import Server
from paged_server.metrics import Metrics


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_replica_answering_is_a_valid_exposition_in_both_formats() -> None:
    """Every replica down (restarting, crashed): the front's /metrics is an empty exposition,
    not a blank line, which OpenMetrics (what Prometheus asks for) refuses as a whole scrape."""
    assert merge_expositions([]) == merge_expositions([("0", "")]) == ""
    assert to_openmetrics("") == "# EOF\n"
    assert to_openmetrics("# TYPE a gauge\n\na 1\n\n") == "# TYPE a gauge\na 1\n# EOF\n"
    live = SimpleNamespace(poll=lambda: None)
    router = ReplicaRouter([Replica(0, live, "127.0.0.1", _closed_port())], timeout=2.0)
    server = Server(("127.0.0.1", 0), router, io_timeout=3)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        http = ServerProc(None, "http://{}:{}".format(*server.server_address[:2]))
        accept = {"Accept": PROMETHEUS_ACCEPT}
        status, headers, text = http.request("GET", "/metrics", headers=accept)
        assert status == 200 and headers["Content-Type"].startswith("application/openmetrics")
        assert parse(text, openmetrics=True) == {}
        status, _, text = http.request("GET", "/metrics")
        assert status == 200 and text == ""
    finally:
        server.shutdown()
        server.server_close()


def test_bounds_past_a_million_as_prometheus_client_writes_them() -> None:
    """vLLM renders with prometheus_client, whose floatToGoString writes Go's form (an exponent
    from 1e6 on: le="1e+06"); Prometheus 2 keeps `le` as sent, so a fleet of vLLM and paged
    servers summed `by (le)` would get two series for one bound."""
    assert [num(v) for v in (1e6, 2e6, 5e7, 1234567.0, 1.5e15, 1e16, 123456.0, 0.001)] == [
        "1e+06", "2e+06", "5e+07", "1.234567e+06", "1.5e+15", "1e+16", "123456.0", "0.001",
    ]  # fmt: skip
    assert [num(v) for v in (-2e6, 1e-05, 0.0, 3, float("inf"))] == [
        "-2e+06", "1e-05", "0.0", "3", "+Inf",
    ]  # fmt: skip
    m = Metrics("m", "vllm", max_model_len=2_000_000)
    m.latency.prompt_tokens.observe(1_500_000)
    text = m.render(_stats())
    assert 'vllm:request_prompt_tokens_bucket{engine="0",le="1e+06",model_name="m"} 0' in text
    assert 'vllm:request_prompt_tokens_bucket{engine="0",le="2e+06",model_name="m"} 1' in text
    assert 'vllm:request_prompt_tokens_sum{engine="0",model_name="m"} 1.5e+06' in text
    family = parse(text)["vllm:request_prompt_tokens"]
    assert buckets(family)[-3:] == [500_000.0, 1e6, 2e6]
    assert parse(to_openmetrics(text), openmetrics=True)


def test_every_finish_reason_of_the_engine_is_a_series_from_the_start() -> None:
    """vLLM creates `request_success_total` for each FinishReason before any request, its
    "repetition" too (repetition_detection, which paged serves): rate() over a series that
    appears with its first increase misses that increase."""
    text = Metrics("m").render(_stats())
    success = parse(text)["paged:request_success_total"].samples
    assert {lab["finished_reason"]: v for _, lab, v in success} == {
        "abort": 0, "error": 0, "length": 0, "repetition": 0, "stop": 0,
    }  # fmt: skip
