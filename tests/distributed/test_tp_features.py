"""Per-request features at world size 2 (TP=2 and PP=2 on gloo ranks) give the single-process
engine's outputs: identical tokens (greedy and seeded), logprobs within 1e-4. The model has one
KV head and a 509-token vocabulary, so the LM head's last shard is padded: every feature that
indexes the vocabulary (whole-vocab and chosen-id logprobs, penalties, logit_bias on ids of the
last shard, bad_words, allowed_token_ids, JSON-schema masks) runs on gathered logits whose
padding must be cut. Also: suffix and n-gram speculation with those features (suffix under PP=2
too), adapters loaded and removed mid-run, an fp8 KV cache with an abort mid-run, pooling over
chunked prompts, sleep / wake_up across stages and with steps in flight, and what pipeline
parallelism refuses by name.
(test_parallel_parity.py covers n > 1, beams, prompt logprobs, prefix caching and preemption;
test_lora_tp.py several adapters in one batch; tests/engine/*: ngram and draft-model
speculation, sleep, collective_rpc and reset_prefix_cache under TP.)"""

from __future__ import annotations

import random

import pytest

from paged_engine import LLM, LoRARequest, SamplingParams
from paged_engine.sampling_params import RequestOutputKind
from paged_engine.structured_output.params import StructuredOutputsParams
from paged_engine.testing import write_lora_adapter, write_tiny_model

pytest.importorskip("transformers")

LP_TOL = 1e-4
VOCAB = 509  # shards of 255: the second holds 254 ids and one pad row
# A pool of 12 blocks of 16 tokens and 32-token steps: prompts are chunked, some sequences are
# preempted and recomputed, and the shared prefix hits the prefix cache.
ENGINE = {
    "dtype": "float32",
    "max_model_len": 128,
    "block_size": 16,
    "num_gpu_blocks_override": 12,
    "max_num_batched_tokens": 32,
    "max_logprobs": -1,
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(
        tmp_path_factory.mktemp("m"), "llama", seed=2, num_key_value_heads=1, vocab_size=VOCAB
    )


def _feature_requests() -> list[tuple[dict, SamplingParams]]:
    rng = random.Random(5)
    system = [rng.randrange(3, 500) for _ in range(20)]

    def prompt(n: int) -> dict:
        return {"prompt_token_ids": system + [rng.randrange(3, 500) for _ in range(n)]}

    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
        "required": ["a", "b"],
    }
    g = {"temperature": 0, "ignore_eos": True}
    last_shard = {300: 3.0, 508: 5.0, 256: -100.0}  # ids past the first shard's 255
    return [
        (prompt(12), SamplingParams(max_tokens=4, logprobs=-1, prompt_logprobs=-1, **g)),
        (
            prompt(9),
            SamplingParams(
                max_tokens=10,
                repetition_penalty=1.4,
                frequency_penalty=0.7,
                presence_penalty=0.5,
                logit_bias={7: 4.0, **last_shard},
                logprobs=2,
                **g,
            ),
        ),
        (prompt(7), SamplingParams(max_tokens=8, bad_words=["ab", "hello"], logprobs=2, **g)),
        (prompt(7), SamplingParams(max_tokens=6, allowed_token_ids=[3, 260, 505, 508], **g)),
        (prompt(30), SamplingParams(max_tokens=12, temperature=0, min_tokens=4, stop=["e", "a"])),
        (
            prompt(5),
            SamplingParams(
                max_tokens=24,
                temperature=0,
                structured_outputs=StructuredOutputsParams(json=schema),
            ),
        ),
        (
            prompt(3),
            SamplingParams(
                max_tokens=8, temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, seed=11, logprobs=3
            ),
        ),
        (prompt(6), SamplingParams(max_tokens=4, logprobs=3, logprob_token_ids=[3, 254, 508], **g)),
        (prompt(6), SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=5, logprobs=-1)),
        (
            prompt(8),
            SamplingParams(
                max_tokens=6,
                temperature=1.0,
                seed=9,
                logit_bias={508: 3.0, 254: 3.0},
                bad_words=["ab"],
                repetition_penalty=1.3,
                logprobs=2,
            ),
        ),
        (prompt(4), SamplingParams(n=2, best_of=3, max_tokens=6, temperature=1.0, seed=3)),
        # repetitive: suffix speculation drafts from it
        ({"prompt_token_ids": [5, 6, 7, 8, 9] * 6}, SamplingParams(max_tokens=20, **g)),
    ]


def _summary(out) -> tuple[list, list | None]:
    seqs = []
    for c in out.outputs:
        lps = [sorted((t, x.logprob) for t, x in d.items()) for d in c.logprobs or []]
        seqs.append((list(c.token_ids), c.text, c.finish_reason, lps))
    prompt_lps = None
    if out.prompt_logprobs is not None:
        prompt_lps = [
            None if d is None else sorted((t, x.logprob) for t, x in d.items())
            for d in out.prompt_logprobs
        ]
    return seqs, prompt_lps


def _assert_same_lps(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is not None:
            assert [t for t, _ in g] == [t for t, _ in w]  # the same ids, whole vocab included
            assert [x for _, x in g] == pytest.approx([x for _, x in w], abs=LP_TOL)


def _assert_same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for (g_seqs, g_prompt), (w_seqs, w_prompt) in zip(got, want):
        assert [s[:3] for s in g_seqs] == [s[:3] for s in w_seqs]  # tokens, text, finish
        for g, w in zip(g_seqs, w_seqs):
            _assert_same_lps(g[3], w[3])
        assert (g_prompt is None) == (w_prompt is None)
        _assert_same_lps(g_prompt or [], w_prompt or [])


def _generate(llm: LLM, requests: list) -> list:
    outs = llm.generate([p for p, _ in requests], [sp for _, sp in requests], use_tqdm=False)
    return [_summary(o) for o in outs]


@pytest.fixture(scope="module")
def reference(model):
    requests = _feature_requests()
    llm = LLM(str(model), **ENGINE)
    try:
        want = _generate(llm, requests)
    finally:
        llm.llm_engine.shutdown()
    vocab_rows = want[0][0][0][3]
    assert all(len(row) == VOCAB for row in vocab_rows)  # logprobs=-1: no padding id
    return requests, want


@pytest.mark.parametrize(
    ("tp", "pp", "extra"),
    [
        (2, 1, {}),
        (1, 2, {"enable_sleep_mode": True}),
        (2, 1, {"speculative_config": {"method": "suffix", "num_speculative_tokens": 3}}),
        (2, 1, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}),
        (1, 2, {"speculative_config": {"method": "suffix", "num_speculative_tokens": 3}}),
    ],
    ids=["tp2", "pp2-sleep", "tp2-suffix", "tp2-ngram", "pp2-suffix"],
)
def test_vocab_indexing_features_match_one_process(model, reference, tp, pp, extra):
    requests, want = reference
    llm = LLM(str(model), tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE, **extra)
    try:
        _assert_same(_generate(llm, requests), want)
        stats = llm.llm_engine.get_stats()
        assert stats.prefix_cache_hits > 0
        if "speculative_config" in extra:
            assert stats.spec_decode_num_accepted_tokens > 0
        else:  # (drafted steps hold fewer sequences at once)
            assert stats.num_preemptions > 0
        if extra.get("enable_sleep_mode"):  # every stage frees and restores its weights and KV
            llm.sleep(level=2)
            llm.wake_up(tags=["weights"])
            assert len(llm.collective_rpc("reload_weights")) == 2
            llm.wake_up()
        assert llm.reset_prefix_cache()
        _assert_same(_generate(llm, requests[:3]), want[:3])
    finally:
        llm.llm_engine.shutdown()


def _prompts(k: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(4, 30))] for _ in range(k)]


def _finished(engine, got: dict) -> None:
    for o in engine.step():
        if o.finished:
            c = o.outputs[0]
            lps = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]
            got[o.request_id] = (list(c.token_ids), lps, c.finish_reason)


def _lora_run(model, a, b, **kwargs) -> tuple[dict, bool, list[int]]:
    """Adapters joining a running batch, one removed between runs, its files loaded again
    under a new id."""
    la, lb = LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))
    llm = LLM(str(model), enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2, **kwargs)
    engine = llm.llm_engine
    try:
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
        ps = _prompts(4, seed=1)
        engine.add_request("r0", ps[0], sp, lora_request=la)
        engine.add_request("r1", ps[1], sp)
        got: dict = {}
        for step in range(1000):
            if not engine.has_unfinished_requests():
                break
            _finished(engine, got)
            if step == 2:
                engine.add_request("r2", ps[2], sp, lora_request=lb)
                engine.add_request("r3", ps[3], sp, lora_request=la)
        removed = engine.remove_lora(1)
        engine.add_request("r4", ps[0], sp, lora_request=lb)
        engine.add_request("r5", ps[0], sp, lora_request=LoRARequest("a2", 3, str(a)))
        while engine.has_unfinished_requests():
            _finished(engine, got)
        return got, removed, sorted(engine.list_loras())
    finally:
        engine.shutdown()


def _assert_same_runs(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for rid, (tokens, lps, reason) in want.items():
        assert got[rid][0] == tokens and got[rid][2] == reason, rid
        assert got[rid][1] == pytest.approx(lps, abs=LP_TOL), rid


def test_adapters_added_and_removed_mid_run_under_tensor_parallelism(model, tmp_path):
    a = write_lora_adapter(tmp_path / "a", model, rank=4, seed=1)
    b = write_lora_adapter(tmp_path / "b", model, rank=8, seed=2)
    kw = {"dtype": "float32", "max_model_len": 128}
    want = _lora_run(model, a, b, **kw)
    got = _lora_run(model, a, b, tensor_parallel_size=2, async_scheduling=True, **kw)
    _assert_same_runs(got[0], want[0])
    assert got[1:] == want[1:] == (True, [2, 3])
    assert want[0]["r5"][0] == want[0]["r0"][0] != want[0]["r4"][0]  # a again, not b


def _fp8_abort_run(model, **kwargs) -> tuple[dict, int]:
    llm = LLM(str(model), dtype="float32", max_model_len=128, kv_cache_dtype="fp8", **kwargs)
    engine = llm.llm_engine
    try:
        sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
        ps = _prompts(4, seed=7)
        for i, p in enumerate(ps):
            engine.add_request(f"q{i}", p, sp)
        got: dict = {}
        for step in range(1000):
            if not engine.has_unfinished_requests():
                break
            _finished(engine, got)
            if step == 3:
                engine.abort_request(["q1", "q2"])
                engine.add_request("q4", ps[1], sp)  # reuses the freed rows and blocks
        return got, engine.get_stats().num_used_blocks
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_fp8_kv_cache_and_an_abort_mid_run_match_one_process(model, tp, pp):
    want = _fp8_abort_run(model)
    got = _fp8_abort_run(model, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert sorted(want[0]) == ["q0", "q3", "q4"] and want[1] == got[1] == 0
    _assert_same_runs(got[0], want[0])


def _pooled(model, **kwargs) -> tuple[list, list]:
    llm = LLM(
        str(model),
        dtype="float32",
        max_model_len=128,
        runner="pooling",
        max_num_batched_tokens=32,  # the prompts are pooled over several chunks
        block_size=16,
        **kwargs,
    )
    rng = random.Random(0)
    system = [rng.randrange(3, 500) for _ in range(40)]
    prompts = [
        {"prompt_token_ids": system + [rng.randrange(3, 500) for _ in range(rng.randint(2, 50))]}
        for _ in range(3)
    ]
    try:
        embeds = [o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)]
        rows = llm.encode(prompts[:2], pooling_task="token_embed", use_tqdm=False)
        return embeds, [o.outputs.data.tolist() for o in rows]
    finally:
        llm.llm_engine.shutdown()


def test_pooling_over_chunked_prompts_matches_one_process(model):
    want_embeds, want_rows = _pooled(model)
    for parallel in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        embeds, rows = _pooled(model, **parallel)
        for g, w in zip(embeds, want_embeds, strict=True):
            assert g == pytest.approx(w, abs=1e-5)
        for g, w in zip(rows, want_rows, strict=True):
            assert len(g) == len(w)
            for g_row, w_row in zip(g, w):
                assert g_row == pytest.approx(w_row, abs=1e-5)


def test_pipeline_parallelism_refuses_speculation_by_name(model):
    # (LoRA adapters run under pipeline stages: test_lora_pp.py; n-gram, suffix, draft
    # model, EAGLE-1 and MTP speculation too: test_spec_pp.py)
    with pytest.raises(ValueError, match=r"speculative_config .*'eagle3'.* pipeline_parallel"):
        LLM(
            str(model),
            pipeline_parallel_size=2,
            speculative_config={"method": "eagle3", "model": "some/head"},
        )


def _pause_run(engine, tag: str, prompts: list, pause) -> tuple[list, list]:
    """Token ids and finish reasons of `prompts`; `pause(engine)` after 3 steps, then 3 steps
    (the steps in flight return), then `resume(engine)`."""
    sp = SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    got: dict[str, list[int]] = {f"{tag}{i}": [] for i in range(len(prompts))}
    reasons: dict[str, str | None] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, sp)

    def collect() -> None:
        for o in engine.step():
            got[o.request_id] += o.outputs[0].token_ids
            if o.finished:
                reasons[o.request_id] = o.outputs[0].finish_reason

    for _ in range(3):
        collect()
    if pause is not None:
        pause[0](engine)
        for _ in range(3):
            collect()
        pause[1](engine)
    for _ in range(1000):
        if not engine.can_step():
            break
        collect()
    return list(got.values()), [reasons.get(rid) for rid in got]


@pytest.mark.parametrize(
    ("tp", "pp", "extra"),
    [(2, 1, {"async_scheduling": True}), (1, 2, {})],
    ids=["tp2-async", "pp2"],
)
def test_sleep_and_pause_with_steps_in_flight(model, tp, pp, extra):
    """Sleeping (mode "keep", "wait", "abort") or pausing while steps are in flight across the
    ranks (async scheduling; micro-batches on two stages): the kept requests finish with the
    tokens of an uninterrupted run, the aborted keep a prefix of them, no block stays used."""
    llm = LLM(
        str(model),
        dtype="float32",
        max_model_len=128,
        enable_sleep_mode=True,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        **extra,
    )
    engine = llm.llm_engine
    try:
        prompts = _prompts(4, seed=3)
        want, _ = _pause_run(engine, "plain", prompts, None)
        wake = (lambda e: e.wake_up(), lambda e: e.resume_generation())
        for mode in ("keep", "wait", "pause", "abort"):
            if mode == "pause":
                pause = (lambda e: e.pause_generation(mode="keep"), wake[1])
            else:
                pause = (lambda e, m=mode: e.sleep(level=1, mode=m), wake[0])
            got, reasons = _pause_run(engine, mode, prompts, pause)
            if mode == "abort":
                assert reasons == ["abort"] * len(prompts)
                assert all(g == w[: len(g)] for g, w in zip(got, want))
            else:
                assert got == want and reasons == ["length"] * len(prompts), mode
            assert engine.get_stats().num_used_blocks == 0
    finally:
        engine.shutdown()
