"""`paged-server --data-parallel-size 2`: two engine replicas behind one front answer like one
server, share the load, report both in /metrics, and stop with the front."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from procs import wait_gone
from server_proc import REAL_ARGS, greedy_answers, launch

from paged_server.data_parallel import _estimate_tokens, _label, replica_argv

openai = pytest.importorskip("openai")


def test_two_replicas_serve_like_one(real_server, tiny_model):
    want = greedy_answers(real_server)
    server = launch(["--model", tiny_model, "--data-parallel-size", "2", *REAL_ARGS], fake=False)
    try:
        with open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children") as f:
            replicas = [int(p) for p in f.read().split()]
        assert len(replicas) == 2
        assert greedy_answers(server) == want
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0)

        def one(i: int) -> str:
            return (
                client.completions.create(
                    model="tiny", prompt=f"request {i}", max_tokens=16, temperature=0
                )
                .choices[0]
                .text
            )

        with ThreadPoolExecutor(8) as pool:
            assert len(list(pool.map(one, range(8)))) == 8
        status, _, text = server.request("GET", "/metrics")
        assert status == 200
        done = {
            line.split("replica=")[1][1]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("paged:request_success_total") and 'finished_reason="length"' in line
        }
        assert set(done) == {"0", "1"} and all(v > 0 for v in done.values()), text
        status, _, body = server.request("GET", "/health")
        assert status == 200 and body["replicas"] == 2
        status, _, body = server.request("POST", "/v1/completions", {"model": "tiny"})
        assert status == 400 and body["error"]["param"] == "prompt"  # a replica's own answer
    finally:
        assert server.stop() == 0, "".join(server.lines[-30:])
    assert wait_gone(replicas, timeout=30) == []


def test_replica_argv_drops_the_routers_options():
    argv = ["serve", "m", "-dp", "2", "--port", "8000", "--host=0.0.0.0", "-tp", "2"]
    assert replica_argv(argv) == ["serve", "m", "-tp", "2"]
    assert replica_argv(["--data-parallel-size=3", "--model", "x"]) == ["--model", "x"]


def test_metric_labels_and_cost_estimate():
    assert _label('a{b="c"} 1', 'replica="0"') == 'a{b="c",replica="0"} 1'
    assert _label("a 1", 'replica="1"') == 'a{replica="1"} 1'
    assert _estimate_tokens({"max_tokens": 10, "n": 2}, 400) == 100 + 20
    assert _estimate_tokens([1, 2], 10) == 1
