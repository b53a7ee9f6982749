"""Failures a long run of mixed, hostile traffic found, each reproduced in seconds."""

from __future__ import annotations

import threading

from server_proc import COMMON_ARGS, serve_in_process


def test_a_request_too_big_for_the_kv_pool_fails_alone(tiny_model: str) -> None:
    """n sequences that outgrow the whole KV pool together used to stop the scheduler, and the
    server failed every request in flight with a 500. Now that request alone gets a 400 naming
    max_tokens; a request beside it finishes and the pool is empty afterwards."""
    from paged_engine import LLMEngine

    # 16 blocks x 16 tokens: 4 sequences of 120 tokens need 32 blocks.
    engine = LLMEngine(
        model=tiny_model, dtype="float32", max_model_len=128, num_gpu_blocks_override=16
    )
    try:
        with serve_in_process(COMMON_ARGS, engine) as (http, _app):
            small = {"prompt": [5, 6, 7], "max_tokens": 60, "ignore_eos": True, "temperature": 0}
            results: dict[str, tuple[int, object]] = {}

            def run(name: str, body: dict) -> None:
                status, _, payload = http.request("POST", "/v1/completions", body)
                results[name] = (status, payload)

            big = {**small, "n": 4, "max_tokens": 120, "temperature": 1.0}
            threads = [
                threading.Thread(target=run, args=("small", small)),
                threading.Thread(target=run, args=("big", big)),
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            status, payload = results["big"]
            assert status == 400, payload
            assert payload["error"]["param"] == "max_tokens"
            held = f"({engine.block_manager.num_total_blocks} blocks)"  # what /metrics counts
            assert (
                "KV-cache blocks" in payload["error"]["message"]
                and held in payload["error"]["message"]
            )
            status, payload = results["small"]
            assert status == 200, payload
            assert payload["usage"]["completion_tokens"] == 60
            # the engine goes on serving, and nothing is left holding blocks
            status, _, payload = http.request("POST", "/v1/completions", small)
            assert status == 200, payload
            m = http.wait_idle()
            assert m["paged:kv_cache_used_blocks"] == 0
            assert m["paged:num_requests_running"] == m["paged:num_requests_waiting"] == 0
    finally:
        engine.shutdown()


def test_a_fan_out_landing_on_a_swapped_out_request_swaps_in_with_it(tiny_model: str) -> None:
    """n > 1 under preemption by swap with async scheduling: a request swapped out while its
    first sample was in flight forked when the sample landed, and the forks had no CPU table,
    so the next schedule() raised KeyError and the server failed every request in flight with
    a 500. Now the forks share the parent's CPU table: every answer is the one an engine with
    room for all gives, and both pools are empty afterwards."""
    from paged_engine import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [5 + i] * 60 + list(range(10, 10 + i))} for i in range(6)]
    params = [SamplingParams(n=3, temperature=1.0, seed=i, max_tokens=8) for i in range(6)]
    kw = {"dtype": "float32", "max_model_len": 128, "async_scheduling": True}
    kw["max_num_batched_tokens"] = 40
    tight = LLM(
        tiny_model, num_gpu_blocks_override=16, preemption_mode="swap", swap_space=0.01, **kw
    )
    got = tight.generate(prompts, params, use_tqdm=False)
    engine = tight.llm_engine
    assert engine.scheduler.num_swap_preemptions > 0
    cpu = engine.block_manager.cpu
    assert not cpu.tables and cpu.num_free_blocks == cpu.num_total_blocks
    roomy = LLM(tiny_model, num_gpu_blocks_override=200, **kw)
    want = roomy.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]


def test_a_request_reusing_the_id_of_one_in_flight_leaves_that_one_alone(tiny_model: str) -> None:
    """A client's `request_id` equal to another request's in flight: the engine refused the
    second (id in use), and the server's clean-up of that refusal aborted the first by the same
    id, whose stream then hung without [DONE] until the client timed out. Then the second got
    a 400; now, as in vLLM (each engine request has an internal id of its own), both are
    served under the id the client chose, and the first streams to its end."""
    import json
    from http.client import IncompleteRead

    from paged_engine import LLMEngine

    engine = LLMEngine(
        model=tiny_model, dtype="float32", max_model_len=128, num_gpu_blocks_override=32
    )
    try:
        with serve_in_process(COMMON_ARGS, engine) as (http, _app):
            body = {"prompt": [5, 6], "max_tokens": 120, "ignore_eos": True, "request_id": "dup"}
            usage = {"stream": True, "stream_options": {"include_usage": True}}
            conn = http.conn(timeout=20)
            conn.request("POST", "/v1/completions", json.dumps({**body, **usage}))
            r = conn.getresponse()
            assert r.status == 200
            events = [r.readline()]  # the first event: the request is in flight
            status, _, payload = http.request("POST", "/v1/completions", {**body, "max_tokens": 2})
            assert status == 200 and payload["id"] == "cmpl-dup", payload
            assert payload["usage"]["completion_tokens"] == 2
            try:
                events += list(r)
            except (TimeoutError, IncompleteRead) as e:
                raise AssertionError("the first request's stream was cut") from e
            finally:
                conn.close()
            data = [e for e in events if e.startswith(b"data: ")]
            assert data[-1].strip() == b"data: [DONE]"
            assert json.loads(data[-2][6:])["usage"]["completion_tokens"] == 120
            assert http.wait_idle()["paged:kv_cache_used_blocks"] == 0
    finally:
        engine.shutdown()
