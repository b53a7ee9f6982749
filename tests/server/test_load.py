"""Concurrency, disconnects, a full waiting queue, stuck clients and shutdown, over real sockets."""

from __future__ import annotations

import json
import signal
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from server_proc import API_KEY, COMMON_ARGS, ServerProc, launch


def _health_latencies(server: ServerProc, stop: threading.Event) -> list[float]:
    out = []
    while not stop.is_set():
        t0 = time.monotonic()
        assert server.request("GET", "/health", timeout=10)[0] == 200
        out.append(time.monotonic() - t0)
        time.sleep(0.02)
    return out


def test_200_concurrent_streams_all_complete(server: ServerProc) -> None:
    n = 200
    body = {"prompt": "count with me:", "max_tokens": 4, "ignore_eos": True}
    stop = threading.Event()
    with ThreadPoolExecutor(n + 1) as pool:
        health = pool.submit(_health_latencies, server, stop)
        t0 = time.monotonic()
        results = list(pool.map(lambda i: server.stream({**body, "seed": i}), range(n)))
        wall = time.monotonic() - t0
        stop.set()
        lat = health.result()
    for events in results:
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(1 for e in events for c in e["choices"] if c["text"] or c["finish_reason"]) >= 1
    print(
        f"\n{n} concurrent streams in {wall:.2f}s; /health under load: "
        f"median {statistics.median(lat) * 1e3:.1f} ms, max {max(lat) * 1e3:.1f} ms "
        f"over {len(lat)} probes"
    )
    assert max(lat) < 2.0
    server.wait_idle()


def _open_and_drop(server: ServerProc, stream: bool) -> None:
    """Start a long request, then vanish: mid-stream, or while waiting for a JSON answer."""
    body = {"prompt": "a long story:", "max_tokens": 100, "ignore_eos": True, "stream": stream}
    s = socket.create_connection((server.host, server.port), timeout=30)
    data = json.dumps(body).encode()
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(data), data)
    )
    if stream:
        got = b""
        while got.count(b"data: ") < 2:  # a token or two arrived: the request is running
            got += s.recv(4096)
    else:
        time.sleep(0.3)
    s.close()


def test_disconnects_abort_and_free_kv(server: ServerProc) -> None:
    before = server.metrics().get("paged:request_aborted_total", 0)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: _open_and_drop(server, stream=i % 2 == 0), range(16)))
    m = server.wait_idle()
    assert m["paged:num_requests_running"] == 0
    assert m["paged:kv_cache_usage_perc"] == 0
    assert m["paged:kv_cache_used_blocks"] == 0
    assert m["paged:request_aborted_total"] > before
    status, _, body = server.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 200, body


def test_stuck_clients_do_not_slow_the_engine(server: ServerProc) -> None:
    """Clients that never read hold only their own HTTP thread: once the engine has produced
    their tokens it is free again, while their writes are still pending."""
    body = {"prompt": "hi", "max_tokens": 16, "ignore_eos": True}

    def timed() -> float:
        t0 = time.monotonic()
        assert server.request("POST", "/v1/completions", body)[0] == 200
        return time.monotonic() - t0

    alone = min(timed() for _ in range(3))
    stuck = []
    for _ in range(10):  # streaming requests whose client never reads a byte
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        s.connect((server.host, server.port))
        data = json.dumps(
            {"prompt": "hi", "max_tokens": 64, "n": 4, "ignore_eos": True, "stream": True}
        ).encode()
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
            % (len(data), data)
        )
        stuck.append(s)
    try:
        server.wait_idle()  # the engine finished them; their sockets are still full
        beside = min(timed() for _ in range(3))
        health = server.request("GET", "/health")[0]
    finally:
        for s in stuck:
            s.close()
    print(
        f"\n16-token request: {alone * 1e3:.0f} ms alone, {beside * 1e3:.0f} ms beside 10 "
        "stuck streaming clients"
    )
    assert health == 200
    assert beside < 3 * alone + 0.5
    server.wait_idle()


def test_full_queue_answers_429_then_recovers(guarded_server: ServerProc) -> None:
    s = guarded_server
    auth = {"Authorization": f"Bearer {API_KEY}"}
    body = {"prompt": "wait for it", "max_tokens": 24, "ignore_eos": True}
    with ThreadPoolExecutor(8) as pool:
        resps = list(pool.map(lambda _: s.request("POST", "/v1/completions", body, auth), range(8)))
    codes = sorted(r[0] for r in resps)
    assert 200 in codes and 429 in codes, codes
    for status, headers, payload in resps:
        if status == 429:
            assert headers["Retry-After"] and payload["error"]["code"] == "queue_full"
    s.wait_idle()
    assert s.request("POST", "/v1/completions", body, auth)[0] == 200


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_finishes_in_flight_requests_and_exits_0(sig: int) -> None:
    server = launch(COMMON_ARGS, fake=True)
    result = {}

    def slow_request() -> None:  # 60 tokens at 20 ms a step: about 1.2 s
        result["resp"] = server.request(
            "POST", "/v1/completions", {"prompt": "x", "max_tokens": 60, "ignore_eos": True}
        )

    t = threading.Thread(target=slow_request)
    t.start()
    deadline = time.monotonic() + 30  # the engine has it: the signal lands mid-request
    while server.metrics()["paged:num_requests_running"] < 1:
        assert time.monotonic() < deadline and t.is_alive(), "the request never ran"
        time.sleep(0.02)
    server.proc.send_signal(sig)
    t.join(20)
    assert result["resp"][0] == 200
    assert result["resp"][2]["usage"]["completion_tokens"] == 60
    assert server.proc.wait(20) == 0
    assert any("shutting down" in line for line in server.lines)


LOST_RANK = "paged-worker-1 (pid 4242) exited with -9"


def _wait_health(server: ServerProc, status: int, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        got, _, body = server.request("GET", "/health")
        if got == status or time.monotonic() > deadline:
            assert got == status, body
            return body
        time.sleep(0.1)


def test_a_lost_rank_while_idle_shuts_the_server_down_with_exit_code_1(tmp_path) -> None:
    """As vLLM's server: a dead engine ends the process, for a supervisor to restart. The loss
    is found while idle (the engine loop's health check), not at the next request. The rank
    dies when the test says (a file), not after a time a loaded machine can outlast at start."""
    lost = tmp_path / "rank-lost"
    server = launch(COMMON_ARGS, fake=True, env={"FAKE_DEAD_FILE": str(lost)})
    assert server.request("GET", "/health")[0] == 200
    lost.touch()
    assert server.proc.wait(20) == 1, "".join(server.lines[-20:])
    log = "".join(server.lines)
    assert "shutting down" in log and "exiting with code 1: " in log and LOST_RANK in log


def test_keep_alive_on_engine_death_answers_503_naming_the_lost_rank(tmp_path) -> None:
    lost = tmp_path / "rank-lost"  # the rank dies when told, as in the test above
    server = launch(
        COMMON_ARGS,
        fake=True,
        env={"FAKE_DEAD_FILE": str(lost), "PAGED_KEEP_ALIVE_ON_ENGINE_DEATH": "1"},
    )
    try:
        assert server.request("GET", "/health")[0] == 200
        lost.touch()
        body = _wait_health(server, 503)
        assert LOST_RANK in body["error"]["message"]
        status, _, body = server.request("POST", "/v1/completions", {"prompt": "x"})
        assert status == 503 and LOST_RANK in body["error"]["message"], body
        assert server.request("GET", "/v1/models")[0] == 200  # the HTTP side still answers
    finally:
        assert server.stop() == 1, "".join(server.lines[-20:])
