"""`LLM.get_metrics()` (vLLM's): reader records named as vLLM's, counters and gauges from the
engine's stats, latency histograms over the requests the LLM's calls ran."""

from __future__ import annotations

import threading

import pytest

from paged_engine import LLM, SamplingParams, StructuredOutputsParams
from paged_engine.metrics_reader import Counter, Gauge, Histogram, Vector


def _by_name(metrics):
    out = {}
    for m in metrics:
        label = m.labels.get("finished_reason", m.labels.get("reason"))
        key = m.name if label is None else (m.name, label)
        out[key] = m
    return out


def test_metrics_after_generate(tiny_llama_dir):
    llm = LLM(
        str(tiny_llama_dir),
        max_model_len=64,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1},
    )
    lengths = [3, 6, 9]
    prompts = [{"prompt_token_ids": [5, 6, 7, 5, 6, 7]}] * 3
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    params.append(SamplingParams(temperature=0, max_tokens=20, stop_token_ids=list(range(500))))
    llm.generate([*prompts, {"prompt_token_ids": [9]}], params, use_tqdm=False)
    m = _by_name(llm.get_metrics())
    stats = llm.get_stats()
    assert m["vllm:generation_tokens"].value == stats.generation_tokens_total
    assert m["vllm:prompt_tokens"].value == stats.prompt_tokens_total
    assert isinstance(m["vllm:num_requests_running"], Gauge)
    assert m["vllm:num_requests_running"].value == 0
    assert m["vllm:kv_cache_usage_perc"].value == stats.kv_cache_usage
    assert m[("vllm:request_success", "length")].value == 3
    assert m[("vllm:request_success", "stop")].value == 1
    # every finish reason is a series from the start, as vLLM's registry has them
    assert m[("vllm:request_success", "repetition")].value == 0
    assert m[("vllm:request_success", "abort")].value == 0
    assert all(x.labels["engine"] == "0" and x.labels["model_name"] for x in m.values())
    ttft, itl, e2e = (
        m[f"vllm:{n}"]
        for n in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                  "e2e_request_latency_seconds")
    )  # fmt: skip
    assert isinstance(ttft, Histogram) and ttft.count == e2e.count == 4
    assert itl.count == sum(n - 1 for n in lengths)  # the stopped request emitted one token
    for h in (ttft, itl, e2e, m["vllm:request_queue_time_seconds"]):
        values = list(h.buckets.values())
        assert values == sorted(values) and h.buckets["+Inf"] == h.count
        assert h.sum >= 0
    # the per-request token histograms, bucketed 1-2-5 up to max_model_len as vLLM's
    max_tokens = m["vllm:request_params_max_tokens"]
    assert max_tokens.count == 4 and max_tokens.sum == sum(lengths) + 20
    assert list(max_tokens.buckets)[:4] == ["1.0", "2.0", "5.0", "10.0"], max_tokens.buckets
    assert m["vllm:request_generation_tokens"].sum == sum(lengths) + 1
    assert m["vllm:request_prompt_tokens"].sum == 6 * 3 + 1
    drafted = m["vllm:spec_decode_num_draft_tokens"]
    assert isinstance(drafted, Counter) and drafted.value == stats.spec_decode_num_draft_tokens
    per_pos = m["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert (
        isinstance(per_pos, Vector)
        and per_pos.values == stats.spec_decode_num_accepted_tokens_per_pos
    )
    llm.generate(["hi"], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert _by_name(llm.get_metrics())["vllm:e2e_request_latency_seconds"].count == 5


def test_a_request_added_to_the_engine_directly(tiny_llama_dir):
    """A request added through llm.llm_engine finishes inside an LLM call: the call returns its
    own outputs and observes only them."""
    llm = LLM(str(tiny_llama_dir), max_model_len=64)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    llm.llm_engine.add_request("direct", {"prompt_token_ids": [5, 6]}, params)
    (out,) = llm.generate(["hi"], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
    e2e = _by_name(llm.get_metrics())["vllm:e2e_request_latency_seconds"]
    assert e2e.count == 1


def test_bucket_keys_are_vllms_le_labels(tiny_llama_dir):
    """The reader's bucket keys are the `le` labels vLLM's registry gives ("1e+06" for a million,
    as prometheus_client writes it; str() gave "1000000.0")."""
    from paged_engine.engine.request_latency import RequestLatency
    from paged_engine.metrics_reader import snapshot

    llm = LLM(str(tiny_llama_dir), max_model_len=64)
    metrics = snapshot(llm.get_stats(), RequestLatency(2_000_000), "m")
    prompt = next(x for x in metrics if x.name == "vllm:request_prompt_tokens")
    assert list(prompt.buckets)[-3:] == ["1e+06", "2e+06", "+Inf"]
    ttft = next(x for x in metrics if x.name == "vllm:time_to_first_token_seconds")
    assert list(ttft.buckets)[:2] == ["0.001", "0.005"]


def test_a_request_whose_grammar_compiles_waits_deferred(tiny_llama_dir, monkeypatch):
    """A request held while its grammar compiles is waiting (num_requests_waiting, unfinished)
    for vLLM's `deferred` reason, not for capacity; once compiled it runs and the gauges
    fall back to 0."""
    pytest.importorskip("llguidance")
    llm = LLM(str(tiny_llama_dir), max_model_len=64)
    engine = llm.llm_engine
    structured = engine.engine_core.structured
    release = threading.Event()
    compile_now = structured._compile_now

    def held_compile(text):
        assert release.wait(60)
        return compile_now(text)

    monkeypatch.setattr(structured, "_compile_now", held_compile)
    so = StructuredOutputsParams(regex="[ab]+")
    engine.add_request(
        "held", "x", SamplingParams(temperature=0, max_tokens=3, structured_outputs=so)
    )

    def waiting() -> dict[str, float]:
        metrics = llm.get_metrics()
        by_reason = [m for m in metrics if m.name == "vllm:num_requests_waiting_by_reason"]
        total = next(m for m in metrics if m.name == "vllm:num_requests_waiting")
        return {"all": total.value} | {m.labels["reason"]: m.value for m in by_reason}

    assert engine.get_num_unfinished_requests() == 1
    assert waiting() == {"all": 1.0, "capacity": 0.0, "deferred": 1.0}
    release.set()
    while engine.has_unfinished_requests():
        engine.step()
    assert waiting() == {"all": 0.0, "capacity": 0.0, "deferred": 0.0}


@pytest.mark.parametrize("env", ["PAGED_COMPUTE_NANS_IN_LOGITS", "VLLM_COMPUTE_NANS_IN_LOGITS"])
def test_corrupted_requests_count_nan_logits_when_asked(tiny_llama_dir, monkeypatch, env):
    """vLLM's corrupted_requests: with its switch set, a request whose logits hold a NaN (a
    prompt reading an embedding row set to NaN) counts once, greedy, sampled, n > 1 or beams;
    the requests beside it run as before. Without the switch there is no such metric."""
    from paged_engine import BeamSearchParams

    llm = LLM(str(tiny_llama_dir), max_model_len=64)
    assert llm.get_stats().corrupted_requests is None
    assert "vllm:corrupted_requests" not in _by_name(llm.get_metrics())
    llm.llm_engine.shutdown()
    monkeypatch.setenv(env, "1")
    llm = LLM(str(tiny_llama_dir), max_model_len=64)
    clean = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(clean, greedy, use_tqdm=False)]
    llm.apply_model(lambda m: m.model.embed_tokens.weight.data[13].fill_(float("nan")))
    bad = {"prompt_token_ids": [5, 13, 7]}
    sampled = SamplingParams(temperature=1.0, n=2, max_tokens=3, ignore_eos=True, seed=0)
    outs = llm.generate([clean[0], bad, clean[1], bad], [greedy, greedy, greedy, sampled])
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == want
    assert llm.get_stats().corrupted_requests == 2
    llm.beam_search([bad], BeamSearchParams(beam_width=2, max_tokens=2))
    assert _by_name(llm.get_metrics())["vllm:corrupted_requests"].value == 3
    llm.llm_engine.shutdown()
    # with speculative decoding on
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
    llm = LLM(str(tiny_llama_dir), max_model_len=64, speculative_config=ngram)
    llm.apply_model(lambda m: m.model.embed_tokens.weight.data[13].fill_(float("nan")))
    llm.generate([{"prompt_token_ids": [5, 6, 5, 6, 5, 13]}], greedy, use_tqdm=False)
    assert llm.get_stats().corrupted_requests == 1
    llm.llm_engine.shutdown()
