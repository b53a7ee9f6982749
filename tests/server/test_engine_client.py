"""The engine client in this process: the engine thread (commands + step_core), the output
thread (process_outputs, dispatch), aborts, failures, the queue limit and shutdown."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from fake_engine import FakeEngine

from paged_engine.sampling_params import RequestOutputKind
from paged_server.engine_client import EngineClient
from paged_server.errors import APIError
from paged_server.metrics import Metrics


def _run(
    client: EngineClient,
    prompts: list,
    max_tokens: int,
    stream: bool = False,
    ids: str = "r",
    **params,
) -> list:
    """Every output of each prompt, in order."""
    params = client.make_params({"max_tokens": max_tokens, **params}, beam=False, stream=stream)
    group = client.add([f"{ids}{i}" for i in range(len(prompts))], prompts, params)
    outputs: list[list] = [[] for _ in prompts]
    deadline = time.monotonic() + 10
    while not group.done and time.monotonic() < deadline:
        for i, out in group.next(0.1):
            outputs[i].append(out)
    return outputs


def test_engine_client_generates_aborts_and_reports_errors() -> None:
    engine = FakeEngine(step_time=0.01)
    client = EngineClient(engine, metrics=Metrics("fake"))
    client.start()
    try:
        prompts = [{"prompt": "ab", "prompt_token_ids": [1, 100, 101]}, {"prompt_token_ids": [5]}]
        out = _run(client, prompts, 3)
        assert [len(o) for o in out] == [1, 1]  # FINAL_ONLY: the whole result, once
        assert [len(o[0].outputs[0].token_ids) for o in out] == [3, 3]
        assert [o[0].prompt for o in out] == ["ab", None] and all(o[0].finished for o in out)
        streamed = _run(client, prompts, 3, stream=True)
        assert [len(o) for o in streamed] == [3, 3]  # DELTA: one new token per step
        for whole, deltas in zip(out, streamed):
            assert "".join(d.outputs[0].text for d in deltas) == whole[0].outputs[0].text
        params = client.make_params({"max_tokens": 200}, beam=False, stream=True)
        group = client.add(["long"], [{"prompt_token_ids": [5]}], params)
        group.next(5)
        client.abort(["long"])
        deadline = time.monotonic() + 5
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.has_unfinished_requests() and client.num_in_flight() == 0
        params = client.make_params({}, beam=False, stream=False)
        bad = client.add(["ok", "bad"], [{"prompt_token_ids": [5] * n} for n in (1, 300)], params)
        with pytest.raises(APIError) as e:  # the engine's ValueError arrives as a 400
            bad.wait_added(5)
        assert e.value.status == 400
        client.abort(bad.request_ids)
        with pytest.raises(APIError) as e:
            client.make_params({"temperature": -1.0}, beam=False, stream=False)
        assert e.value.param == "temperature"
    finally:
        client.stop()
    assert not client.alive


def test_a_client_whose_caller_runs_the_loop_is_alive_before_the_loop_starts() -> None:
    """paged-server announces itself between start(False) and run_engine_loop(): a /health
    in that window must not say the engine is down, and requests sent then are served."""
    import threading

    client = EngineClient(FakeEngine(step_time=0.0))
    client.start(engine_thread=False)
    loop = threading.Thread(target=client.run_engine_loop)
    try:
        assert client.alive  # /health answers 200
        params = client.make_params({"max_tokens": 2}, beam=False, stream=False)
        group = client.add(["early"], [{"prompt_token_ids": [5]}], params)
        loop.start()
        group.wait_added(5.0)
        out = []
        deadline = time.monotonic() + 10
        while not group.done and time.monotonic() < deadline:
            out += [o for _, o in group.next(0.1)]
        assert out and out[-1].finished and len(out[-1].outputs[0].token_ids) == 2
    finally:
        client.stop()
        loop.join(10)
    assert not client.alive and not loop.is_alive()


def test_streams_ask_for_deltas_and_the_rest_for_the_final_output_only() -> None:
    for stream, kind in [(True, RequestOutputKind.DELTA), (False, RequestOutputKind.FINAL_ONLY)]:
        params = EngineClient.make_params({"n": 2}, beam=False, stream=stream)
        assert params.output_kind == kind and params.n == 2
        assert EngineClient.make_params({}, beam=True, stream=stream).output_kind == kind


@pytest.mark.parametrize("stream", [False, True])
def test_latency_metrics_from_deltas_and_final_outputs(stream: bool) -> None:
    """FINAL_ONLY sends no per-step outputs: TTFT and inter-token gaps come from the engine's
    token times, with the same sum and count as per-step observation."""
    client = EngineClient(FakeEngine(step_time=0.01), metrics=Metrics("fake"))
    client.start()
    try:
        _run(client, [{"prompt_token_ids": [5]}], 5, stream=stream)
    finally:
        client.stop()  # joins the output thread: its last observations are in
    m = client.metrics
    assert m.ttft._count == 1 and m.e2e._count == 1 and m.finished["length"] == 1
    assert m.itl._count == 4 and 0.035 < m.itl._sum < 1.0  # 4 gaps of about 10 ms


def test_queue_limit_counts_requests_not_yet_seen_by_the_engine() -> None:
    client = EngineClient(FakeEngine(), max_queued_requests=2)
    client.stats = SimpleNamespace(num_waiting=1)
    client.check_queue()
    client._pending_adds = 1  # added but not drained yet: still counts as waiting
    with pytest.raises(APIError) as e:
        client.check_queue()
    assert e.value.status == 429 and e.value.headers["Retry-After"]


def test_engine_errors_name_the_first_parameter_they_mention() -> None:
    from paged_server.engine_client import _guess_param

    fields = {"n", "best_of", "max_tokens", "min_tokens", "temperature", "stop"}
    assert _guess_param("n/best_of/beam_width=2 exceeds max_num_seqs=1", fields) == "n"
    assert _guess_param("min_tokens must be <= max_tokens=5, got 9.", fields) == "min_tokens"
    assert _guess_param("temperature must be non-negative, got -1.", fields) == "temperature"
    assert _guess_param("prompt is too long: 300 tokens", fields) == "prompt"


def test_engine_failure_fails_only_the_requests_in_flight() -> None:
    class Flaky(FakeEngine):
        fail = True

        def step_core(self):
            if self.fail:
                self.fail = False
                raise RuntimeError("boom")
            return super().step_core()

    client = EngineClient(Flaky(step_time=0.0))
    client.start()
    try:
        with pytest.raises(APIError) as e:
            _run(client, [{"prompt_token_ids": [5]}], 2)
        assert e.value.status == 500
        out = _run(client, [{"prompt_token_ids": [6]}], 2)  # the loop lives on
        assert out[0][-1].finished and client.alive
    finally:
        client.stop()


def test_a_dead_engine_fails_what_is_in_flight_then_refuses_with_503() -> None:
    from paged_engine.executor.base import EngineDeadError

    class Dying(FakeEngine):
        def step_core(self):
            raise EngineDeadError("rank 1 exited with code -9")

    client = EngineClient(Dying(step_time=0.0))
    deaths = []
    client.on_engine_death = lambda: deaths.append(client.failure)
    client.start()
    try:
        assert client.failure is None
        with pytest.raises(APIError) as e:
            _run(client, [{"prompt_token_ids": [5]}], 2)
        assert e.value.status == 500 and "rank 1 exited" in e.value.message
        assert not client.alive  # /health answers 503
        assert "rank 1 exited" in client.failure and deaths == [client.failure]
        params = client.make_params({"max_tokens": 2}, beam=False, stream=False)
        group = client.add(["later"], [{"prompt_token_ids": [6]}], params)
        with pytest.raises(APIError) as e:  # refused when added, as the route sees it
            group.wait_added(5.0)
        assert e.value.status == 503 and "rank 1 exited" in e.value.message
        assert len(deaths) == 1  # told once, however often the engine fails after
    finally:
        client.stop()


def test_a_rank_lost_while_idle_is_found_without_a_request() -> None:
    """The idle loop asks the engine's check_health about once a second: /health turns 503
    and paged-server is told, with nothing in flight."""
    engine = FakeEngine(step_time=0.0)
    client = EngineClient(engine)
    deaths = []
    client.on_engine_death = lambda: deaths.append(client.failure)
    client.start()
    try:
        time.sleep(0.2)
        assert client.alive and not deaths
        engine.die_at = time.monotonic()
        assert _wait_for(lambda: bool(deaths), 5.0)
        assert not client.alive and "exited with -9" in deaths[0]
        assert "step_core" not in engine.threads  # no step ran: the health check found it
    finally:
        client.stop()


# ---- the output thread ----------------------------------------------------------------------
def _stream_text(client: EngineClient, prompt: dict, **kwargs) -> tuple[str, object]:
    """The joined text of one streamed request, and its last output."""
    out = _run(client, [prompt], stream=True, **kwargs)[0]
    return "".join(o.outputs[0].text for o in out), out[-1]


def _wait_for(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)
    return cond()


def test_the_output_stage_runs_on_its_own_thread() -> None:
    engine = FakeEngine(step_time=0.001)
    client = EngineClient(engine)
    client.start()
    try:
        text, _ = _stream_text(client, {"prompt_token_ids": [5]}, max_tokens=12)
        _run(client, [{"prompt_token_ids": [5]}], max_tokens=12, stop=[text[3:5]])
        assert _wait_for(lambda: "finish_seqs" in engine.threads)
    finally:
        client.stop()
    engine_side = ("add_request", "step_core", "finish_seqs")
    assert all(engine.threads[m] == {"engine-loop"} for m in engine_side), engine.threads
    assert engine.threads["process_outputs"] == {"engine-output"}
    assert engine.tokenizer.threads == {"engine-output"}  # detokenizing is the output stage's


def test_a_stop_string_seen_by_the_output_thread_frees_the_sequence() -> None:
    engine = FakeEngine(step_time=0.005)
    client = EngineClient(engine)
    client.start()
    try:
        prompt = {"prompt_token_ids": [5]}
        text, _ = _stream_text(client, prompt, max_tokens=12)
        stop = text[4:6]
        tokens = engine.gen_tokens
        streamed, last = _stream_text(client, prompt, max_tokens=200, stop=[stop])
        assert streamed == text[: text.index(stop)]
        assert (last.outputs[0].finish_reason, last.outputs[0].stop_reason) == ("stop", stop)
        # The engine thread freed it: long before max_tokens, and the stats show it.
        assert _wait_for(lambda: not engine.has_unfinished_requests())
        # the engine knows it by its internal id: the caller's plus a random suffix
        assert [(r.rsplit("-", 1)[0], i, s) for r, i, s in engine.stopped] == [("r0", 0, stop)]
        assert engine.gen_tokens - tokens < 20
        assert _wait_for(lambda: client.stats.num_running == 0)
    finally:
        client.stop()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_stop_string_frees_the_sequence_in_the_real_engine(
    tiny_model: str, async_scheduling: bool
) -> None:
    from paged_engine import LLMEngine

    engine = LLMEngine(
        model=tiny_model,
        dtype="float32",
        max_model_len=128,
        num_gpu_blocks_override=64,
        async_scheduling=async_scheduling,
    )
    client = EngineClient(engine)
    client.start()
    try:
        prompt = {"prompt_token_ids": [1, 20, 30, 40]}
        text, _ = _stream_text(client, prompt, max_tokens=24, temperature=0.0, ignore_eos=True)
        stop = text[len(text) // 2 :][:3]
        tokens = engine.get_stats().generation_tokens_total
        streamed, last = _stream_text(
            client, prompt, max_tokens=100, temperature=0.0, ignore_eos=True, stop=[stop]
        )
        assert streamed == text[: text.index(stop)]
        assert last.outputs[0].finish_reason == "stop"
        assert _wait_for(lambda: engine.get_num_unfinished_requests() == 0)
        stats = engine.get_stats()
        assert stats.num_running == 0 and stats.num_used_blocks == 0
        assert stats.generation_tokens_total - tokens < 40  # not max_tokens = 100
    finally:
        client.stop()
        engine.shutdown()


def test_stop_joins_both_threads_and_fails_what_is_in_flight() -> None:
    client = EngineClient(FakeEngine(step_time=0.005))
    client.start()
    params = client.make_params({"max_tokens": 200}, beam=False, stream=True)
    group = client.add(["long"], [{"prompt_token_ids": [5]}], params)
    assert group.wait_added(5) and group.next(5)
    client.stop()
    assert not client._thread.is_alive() and not client._output_thread.is_alive()
    assert not client.alive and client.num_in_flight() == 0
    with pytest.raises(APIError) as e:
        for _ in range(50):
            group.next(0.1)
    assert e.value.status == 503


def test_an_output_stage_error_fails_its_requests_and_the_next_succeeds() -> None:
    class Broken(FakeEngine):
        def process_outputs(self, core_outputs):
            if any(co.request_id.rsplit("-", 1)[0] == "r0" for co in core_outputs):
                raise RuntimeError("boom")
            return super().process_outputs(core_outputs)

    engine = Broken(step_time=0.002)
    client = EngineClient(engine)
    client.start()
    try:
        with pytest.raises(APIError) as e:
            _run(client, [{"prompt_token_ids": [5]}], max_tokens=50)
        assert e.value.status == 500
        assert _wait_for(lambda: not engine.has_unfinished_requests())  # freed in the engine
        assert client.num_in_flight() == 0 and client.alive
        out = _run(client, [{"prompt_token_ids": [5]}, {"prompt_token_ids": [6]}], 3, ids="s")
        assert all(o[-1].finished for o in out)
        assert engine.threads["abort_request"] == {"engine-loop"}
    finally:
        client.stop()
