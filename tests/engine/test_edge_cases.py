"""Edge cases of the public engine API on tiny random models.

n > 1 / best_of, beam search corners, prompt logprobs against HF, max_model_len limits, seeds,
abort in every request state, long runs under a tiny KV pool, hostile input, detokenization.
Every test that generates also checks that no KV block leaks.
"""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest
import torch

from paged_engine import LLM, BeamSearchParams, EngineConfig, LLMEngine, SamplingParams

transformers = pytest.importorskip("transformers")

MAX_LEN = 96


def _prompts(count: int, seed: int = 0, lo: int = 3, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def _tp(ids: list[int]) -> dict:
    return {"prompt_token_ids": ids}


def _llm(path, **kw) -> LLM:
    kw.setdefault("max_model_len", MAX_LEN)
    return LLM(model=str(path), dtype="float32", **kw)


def _engine(path, **kw) -> LLMEngine:
    kw.setdefault("max_model_len", MAX_LEN)
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", **kw))


def _assert_idle(target: LLM | LLMEngine) -> None:
    stats = target.get_stats()
    assert stats.num_used_blocks == 0, "KV blocks leaked"
    assert stats.num_running == 0 and stats.num_waiting == 0


def _greedy_ids(llm: LLM, prompts, max_tokens: int = 8) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([_tp(p) for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _drain(engine: LLMEngine) -> dict[str, object]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.fixture(scope="module")
def llama_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return _llm(llama_dir)


@pytest.fixture(scope="module")
def hf_llama(llama_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    return model.eval()


# ---- n > 1 and best_of ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "extra",
    [
        {"stop": [" the", "e"]},
        {"stop_token_ids": list(range(5, 200))},
        {"min_tokens": 5, "stop_token_ids": list(range(5, 200))},
        {"max_tokens": 1},
        {"logprobs": 2},
        {"best_of": 5, "logprobs": 3},
        {"best_of": 4},
        {"best_of": 4, "max_tokens": 1, "stop_token_ids": list(range(0, 512))},
    ],
    ids=[
        "stop-str",
        "stop-ids",
        "min-tokens",
        "max-tokens-1",
        "logprobs",
        "best-of-lp",
        "best-of",
        "best-of-all-stop",
    ],
)
def test_parallel_sampling_outputs(llm, extra):
    params = SamplingParams(**{"n": 3, "temperature": 1.0, "seed": 7, "max_tokens": 8, **extra})
    prompts = _prompts(3, seed=1)
    outs = llm.generate([_tp(p) for p in prompts], params, use_tqdm=False)
    tok = llm.get_tokenizer()
    for out in outs:
        assert out.finished and [c.index for c in out.outputs] == [0, 1, 2]
        for c in out.outputs:
            assert c.finish_reason in ("stop", "length")
            assert 1 <= len(c.token_ids) <= params.max_tokens
            if c.finish_reason == "length":
                assert len(c.token_ids) == params.max_tokens
            if len(c.token_ids) < params.max_tokens:
                assert c.finish_reason == "stop"
            assert len(c.token_ids) >= min(params.min_tokens, params.max_tokens)
            if isinstance(c.stop_reason, int):
                assert c.token_ids[-1] == c.stop_reason
                assert c.stop_reason in params.stop_token_ids
                assert c.stop_reason not in c.token_ids[:-1]
                assert len(c.token_ids) > params.min_tokens or params.min_tokens == 0
            if isinstance(c.stop_reason, str):
                assert c.stop_reason in params.stop
            for s in params.stop:
                assert s not in c.text
            if params.logprobs is not None:
                assert len(c.logprobs) == len(c.token_ids)
                assert c.cumulative_logprob == pytest.approx(
                    sum(e[t].logprob for e, t in zip(c.logprobs, c.token_ids)), abs=1e-4
                )
                for entry, t in zip(c.logprobs, c.token_ids):
                    assert t in entry and len(entry) <= params.logprobs + 1
                    assert all(lp.logprob <= 0 for lp in entry.values())
                    assert {lp.rank for lp in entry.values()} >= set(range(1, params.logprobs + 1))
            elif not params.stop:
                # A stop token's text is not part of the output (vLLM).
                shown = c.token_ids[:-1] if isinstance(c.stop_reason, int) else c.token_ids
                assert c.text == tok.decode(shown, skip_special_tokens=True)
        if params.best_of and params.logprobs is not None:
            cums = [c.cumulative_logprob for c in out.outputs]
            assert cums == sorted(cums, reverse=True)
    _assert_idle(llm)


def test_best_of_returns_the_best_n(llm):
    """best_of=6, n=2 returns the two highest-cumulative-logprob samples of the same six that
    n=6 draws with the same seed (the samples do not depend on n)."""
    prompt = _tp(_prompts(1, seed=2)[0])
    base = dict(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True, logprobs=0)
    six = llm.generate(prompt, SamplingParams(n=6, **base), use_tqdm=False)[0].outputs
    two = llm.generate(prompt, SamplingParams(n=2, best_of=6, **base), use_tqdm=False)[0].outputs
    best = sorted(six, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in two] == [c.token_ids for c in best]
    assert [c.index for c in two] == [0, 1]
    _assert_idle(llm)


def test_seeded_parallel_sampling_is_reproducible(llama_dir, llm):
    prompts = _prompts(4, seed=3)
    params = SamplingParams(n=3, temperature=0.9, top_k=50, seed=99, max_tokens=6, ignore_eos=True)
    first = llm.generate(_tp(prompts[0]), params, use_tqdm=False)[0]
    # The same request inside a crowd, with prefill chunked into tiny pieces and a tiny pool.
    other = _llm(llama_dir, max_num_batched_tokens=5, num_gpu_blocks_override=16, max_num_seqs=6)
    mixed = other.generate(
        [_tp(p) for p in prompts[1:]] + [_tp(prompts[0])],
        [SamplingParams(n=2, temperature=1.0, max_tokens=6)] * 3 + [params],
        use_tqdm=False,
    )[-1]
    assert [c.token_ids for c in mixed.outputs] == [c.token_ids for c in first.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1, "samples should differ"
    _assert_idle(llm)
    _assert_idle(other)


# ---- beam search ---------------------------------------------------------------------------------
def test_beam_width_one_is_greedy(llm):
    prompts = _prompts(3, seed=4)
    greedy = _greedy_ids(llm, prompts, max_tokens=7)
    outs = llm.generate(
        [_tp(p) for p in prompts],
        BeamSearchParams(beam_width=1, max_tokens=7, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == greedy
    assert all(len(o.outputs) == 1 for o in outs)
    _assert_idle(llm)


def test_beam_max_tokens_one_is_top_k_first_tokens(llm):
    prompt = _tp(_prompts(1, seed=5)[0])
    ref = (
        llm.generate(
            prompt,
            SamplingParams(temperature=0, max_tokens=1, logprobs=5, ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .logprobs[0]
    )
    top = sorted(ref.items(), key=lambda kv: kv[1].rank)[:5]
    out = llm.generate(
        prompt, BeamSearchParams(beam_width=5, max_tokens=1, ignore_eos=True), use_tqdm=False
    )[0]
    assert [c.token_ids for c in out.outputs] == [[t] for t, _ in top]
    assert [c.cumulative_logprob for c in out.outputs] == pytest.approx(
        [lp.logprob for _, lp in top], abs=1e-4
    )
    assert all(c.finish_reason == "length" for c in out.outputs)
    _assert_idle(llm)


@pytest.mark.parametrize(
    ("length_penalty", "early_stopping"),
    [(1.0, True), (0.0, False), (2.0, "never"), (0.0, "never"), (-1.0, False)],
)
def test_beam_search_matches_hf_options(llm, hf_llama, length_penalty, early_stopping):
    prompts = _prompts(2, seed=6, lo=2, hi=12)
    params = SamplingParams(
        n=3,
        use_beam_search=True,
        temperature=0,
        max_tokens=6,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    outs = llm.generate([_tp(p) for p in prompts], params, use_tqdm=False)
    hf_llama.generation_config.pad_token_id = 2
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf_llama.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=6,
                num_beams=3,
                num_return_sequences=3,
                do_sample=False,
                early_stopping=early_stopping,
                length_penalty=length_penalty,
                eos_token_id=1,
            )
        ref_seqs = []
        for row in ref:
            gen = row[len(prompt) :].tolist()
            ref_seqs.append(gen[: gen.index(1) + 1] if 1 in gen else gen)
        assert [o.token_ids for o in out.outputs] == ref_seqs
    _assert_idle(llm)


def test_beam_search_under_preemption_and_chunking(llama_dir, llm):
    prompts = _prompts(4, seed=7, lo=10, hi=30)
    params = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)
    expected = llm.generate([_tp(p) for p in prompts], params, use_tqdm=False)
    tight = _llm(llama_dir, num_gpu_blocks_override=14, max_num_batched_tokens=16, block_size=8)
    got = tight.generate([_tp(p) for p in prompts], params, use_tqdm=False)
    for e, g in zip(expected, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in e.outputs]
    assert tight.get_stats().num_preemptions > 0
    _assert_idle(tight)


def test_wide_beam_relative_to_vocab(llama_dir):
    """beam_width * 2 candidates exceed the vocabulary: selection must still work."""
    llm = _llm(llama_dir, max_model_len=32, max_num_seqs=300)
    out = llm.generate(
        _tp([5, 6, 7]),
        BeamSearchParams(beam_width=260, max_tokens=2, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert len(out.outputs) == 260
    assert len({tuple(c.token_ids) for c in out.outputs}) == 260
    scores = [c.cumulative_logprob / len(c.token_ids) for c in out.outputs]
    assert scores == sorted(scores, reverse=True)
    _assert_idle(llm)


# ---- prompt logprobs -----------------------------------------------------------------------------
def _check_prompt_logprobs(out, hf_model, k: int) -> None:
    ids = out.prompt_token_ids
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(ids) and plp[0] is None
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    for pos in range(1, len(ids)):
        entry = plp[pos]
        tid = ids[pos]
        assert tid in entry
        assert entry[tid].logprob == pytest.approx(ref[pos - 1, tid].item(), abs=1e-3)
        top = ref[pos - 1].topk(k).indices.tolist() if k else []
        assert len(entry) <= k + 1
        for rank, t in enumerate(top, 1):
            assert t in entry and entry[t].rank == rank


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 7},
        {"num_gpu_blocks_override": 14, "block_size": 8, "max_num_seqs": 6},
        {"enable_prefix_caching": True, "block_size": 4},
    ],
    ids=["plain", "chunked", "preempted", "prefix-cached"],
)
def test_prompt_logprobs_match_hf(llama_dir, hf_llama, options):
    llm = _llm(llama_dir, **options)
    prompts = _prompts(4, seed=8, lo=1, hi=40)
    prompts.append(prompts[1] + [7, 8, 9])  # a prefix-cache hit candidate
    if options.get("enable_prefix_caching"):
        llm.generate(_tp(prompts[1]), SamplingParams(max_tokens=2), use_tqdm=False)
    params = SamplingParams(prompt_logprobs=3, max_tokens=12, ignore_eos=True, n=2, seed=1)
    outs = llm.generate([_tp(p) for p in prompts], params, use_tqdm=False)
    for out in outs:
        _check_prompt_logprobs(out, hf_llama, 3)
        assert len(out.outputs) == 2
    if "num_gpu_blocks_override" in options:
        assert llm.get_stats().num_preemptions > 0
    _assert_idle(llm)


def test_prompt_logprobs_in_bounded_slices(llama_dir, hf_llama, monkeypatch):
    """A step's prompt rows get their logits a slice at a time (3 rows here: model_runner's
    PROMPT_LOGPROBS_ELEMENTS), so a long prompt's [rows, V] logits never exist at once: the
    logprobs are still HF's, and no logits call holds more rows."""
    import paged_engine.worker.model_runner as model_runner

    llm = _llm(llama_dir)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    monkeypatch.setattr(model_runner, "PROMPT_LOGPROBS_ELEMENTS", 3 * runner.vocab_size + 1)
    rows: list[int] = []
    whole = runner.compute_logits
    monkeypatch.setattr(runner, "compute_logits", lambda h: rows.append(len(h)) or whole(h))
    params = SamplingParams(prompt_logprobs=2, max_tokens=2)
    for p in _prompts(3, seed=4, lo=8, hi=30):  # one at a time: sampling takes one row
        (out,) = llm.generate(_tp(p), params, use_tqdm=False)
        _check_prompt_logprobs(out, hf_llama, 2)
    assert max(rows) == 3 and rows.count(3) >= 6
    _assert_idle(llm)


@pytest.mark.parametrize("arch", ["gpt2", "opt", "qwen3", "gpt_neox"])
def test_prompt_logprobs_other_archs(tiny_model_factory, arch):
    path = tiny_model_factory(arch)
    llm = _llm(path, max_num_batched_tokens=9)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = llm.generate(
        [_tp(p) for p in _prompts(2, seed=9, lo=12, hi=30)],
        SamplingParams(prompt_logprobs=0, max_tokens=2),
        use_tqdm=False,
    )
    for out in outs:
        _check_prompt_logprobs(out, hf, 0)
    _assert_idle(llm)


# ---- max_model_len -------------------------------------------------------------------------------
def test_generation_stops_at_max_model_len(llm):
    tok = [5] * (MAX_LEN - 1)
    for params in (
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        SamplingParams(n=2, temperature=1.0, max_tokens=None, ignore_eos=True, seed=0),
        BeamSearchParams(beam_width=2, max_tokens=None, ignore_eos=True),
    ):
        out = llm.generate(_tp(tok), params, use_tqdm=False)[0]
        assert all(len(c.token_ids) == 1 and c.finish_reason == "length" for c in out.outputs)
    short = _prompts(1, seed=10, lo=80, hi=80)[0]
    for params in (
        SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
        SamplingParams(n=3, max_tokens=None, ignore_eos=True, stop=["zzzz"]),
        BeamSearchParams(beam_width=2, max_tokens=None, ignore_eos=True),
    ):
        out = llm.generate(_tp(short), params, use_tqdm=False)[0]
        for c in out.outputs:
            assert len(c.token_ids) == MAX_LEN - 80 and c.finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(_tp([5] * MAX_LEN), use_tqdm=False)
    _assert_idle(llm)


# ---- abort ---------------------------------------------------------------------------------------
def test_abort_in_every_state(llama_dir, llm):
    prompts = _prompts(3, seed=12, lo=20, hi=40)
    expected = _greedy_ids(llm, prompts, max_tokens=6)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    long = [9] * 60
    engine = _engine(llama_dir, max_num_batched_tokens=16, max_num_seqs=6, block_size=8)
    for i, p in enumerate(prompts):
        engine.add_request(f"keep{i}", p, greedy)
    engine.add_request("prefill", long, SamplingParams(max_tokens=30))
    engine.add_request("fork", prompts[0], SamplingParams(n=3, max_tokens=30, ignore_eos=True))
    engine.add_request("beam", prompts[1], BeamSearchParams(beam_width=2, max_tokens=30))
    engine.add_request("waiting", long, SamplingParams(max_tokens=30))
    engine.add_request("running", [5, 6], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.abort_request("waiting")  # never scheduled
    engine.step()
    engine.step()
    engine.abort_request("prefill")  # mid chunked prefill
    done: dict = {}
    for _ in range(12):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    engine.abort_request(["fork", "beam", "running"])  # after fork / mid beam / decoding
    engine.abort_request("fork")  # twice: a no-op
    done.update(_drain(engine))
    assert set(done) == {"keep0", "keep1", "keep2"}
    assert [done[f"keep{i}"].outputs[0].token_ids for i in range(3)] == expected
    _assert_idle(engine)
    # The ids are free again, and the engine serves normally.
    engine.add_request("fork", prompts[0], greedy)
    assert _drain(engine)["fork"].outputs[0].token_ids == expected[0]
    _assert_idle(engine)


# ---- long runs -----------------------------------------------------------------------------------
def test_many_requests_tiny_pool(llama_dir, llm):
    prompts = _prompts(200, seed=13, lo=1, hi=24)
    params = [
        BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
        if i % 11 == 5
        else SamplingParams(temperature=0, max_tokens=1 + i % 5, ignore_eos=True)
        if i % 7
        else SamplingParams(n=3, temperature=0.8, seed=i, max_tokens=9, ignore_eos=True)
        for i in range(len(prompts))
    ]
    roomy = llm.generate([_tp(p) for p in prompts], params, use_tqdm=False)
    tight = _llm(
        llama_dir,
        num_gpu_blocks_override=8,
        block_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=64,
    )
    got = tight.generate([_tp(p) for p in prompts], params, use_tqdm=False)
    assert tight.get_stats().num_preemptions > 0
    assert [[c.token_ids for c in o.outputs] for o in got] == [
        [c.token_ids for c in o.outputs] for o in roomy
    ]
    _assert_idle(tight)
    _assert_idle(llm)


# ---- sampling semantics --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def frequent_eos(tmp_path_factory, llama_dir, llm):
    """The llama dir with a token greedy decoding emits often added as an EOS id in
    generation_config.json (as chat models list their end-of-turn token there)."""
    prompts = _prompts(6, seed=14)
    ids = _greedy_ids(llm, prompts, max_tokens=8)
    common = max(range(5, 512), key=lambda t: sum(o.count(t) for o in ids))
    path = tmp_path_factory.mktemp("eos") / "llama"
    shutil.copytree(llama_dir, path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = [1, common]
    (path / "generation_config.json").write_text(json.dumps(gen))
    return _llm(path), common, prompts, ids


def test_generation_config_eos_ids_stop(frequent_eos):
    eos_llm, common, prompts, ids = frequent_eos
    outs = eos_llm.generate(
        [_tp(p) for p in prompts], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )
    for out, free in zip(outs, ids):
        c = out.outputs[0]
        if common in free:
            cut = free.index(common) + 1
            assert c.token_ids == free[:cut] and c.finish_reason == "stop"
            assert c.stop_reason is None  # an EOS, not a stop_token_ids hit
        else:
            assert c.token_ids == free
    _assert_idle(eos_llm)


def test_min_tokens_respects_ignore_eos(frequent_eos):
    """With ignore_eos, EOS is an ordinary token: min_tokens must not ban it."""
    eos_llm, _, prompts, ids = frequent_eos
    base = dict(temperature=0, max_tokens=8, ignore_eos=True)
    a = eos_llm.generate([_tp(p) for p in prompts], SamplingParams(**base), use_tqdm=False)
    b = eos_llm.generate(
        [_tp(p) for p in prompts], SamplingParams(min_tokens=8, **base), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in a] == ids
    assert [o.outputs[0].token_ids for o in b] == ids
    # Without ignore_eos, min_tokens does hold the EOS back.
    c = eos_llm.generate(
        [_tp(p) for p in prompts],
        SamplingParams(temperature=0, max_tokens=8, min_tokens=8),
        use_tqdm=False,
    )
    assert all(len(o.outputs[0].token_ids) == 8 for o in c)
    _assert_idle(eos_llm)


def _reference_penalized(hf, prompt, n_tokens, rep, freq, pres) -> list[int]:
    ids = list(prompt)
    out: list[int] = []
    for _ in range(n_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
        seen = set(ids)
        for t in seen:
            logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
        for t in set(out):
            logits[t] -= freq * out.count(t) + pres
        tok = int(logits.argmax())
        ids.append(tok)
        out.append(tok)
    return out


def test_penalties_match_naive_reference(llm, hf_llama):
    # Prompts of different lengths: the worker slices every row's history out of one array.
    prompts = _prompts(3, seed=15, lo=5, hi=30)
    for rep, freq, pres in [(1.3, 0.0, 0.0), (1.0, 1.5, 0.0), (0.8, -0.5, 2.0)]:
        params = SamplingParams(
            temperature=0,
            max_tokens=10,
            ignore_eos=True,
            repetition_penalty=rep,
            frequency_penalty=freq,
            presence_penalty=pres,
        )
        outs = llm.generate([_tp(p) for p in prompts], params, use_tqdm=False)
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == _reference_penalized(hf_llama, p, 10, rep, freq, pres)
    _assert_idle(llm)


# ---- invalid input -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_tokens": "16"}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": [1.0]}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": math.nan}, "top_p"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"repetition_penalty": math.nan}, "repetition_penalty"),
        ({"frequency_penalty": math.nan}, "frequency_penalty"),
        ({"length_penalty": math.nan}, "length_penalty"),
        ({"length_penalty": -math.inf}, "length_penalty"),
        ({"min_p": math.inf}, "min_p"),
        ({"seed": 2**64}, "seed"),
        ({"seed": "1"}, "seed"),
        ({"n": True}, "n"),
        ({"n": 2, "best_of": 1}, "best_of"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": 3}, "stop"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": "12"}, "stop_token_ids"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logprobs": -2}, "logprobs"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
        ({"early_stopping": 1}, "early_stopping"),
        ({"top_k": -2}, "top_k"),
        ({"ignore_eos": "no"}, "ignore_eos"),
        ({"use_beam_search": 1}, "use_beam_search"),
        ({"skip_special_tokens": None}, "skip_special_tokens"),
        ({"use_beam_search": True, "top_k": 5}, "top_k"),
        ({"use_beam_search": True, "n": 2, "stop": ["x"]}, "stop"),
        ({"use_beam_search": True, "n": 2, "prompt_logprobs": 0}, "prompt_logprobs"),
        ({"use_beam_search": True, "n": 2, "min_tokens": 3}, "min_tokens"),
        ({"use_beam_search": True, "n": 2, "repetition_penalty": 1.2}, "repetition_penalty"),
    ],
)
def test_bad_sampling_params(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"beam_width": 0, "max_tokens": 4}, "beam_width"),
        ({"beam_width": "2", "max_tokens": 4}, "beam_width"),
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
        ({"beam_width": 2, "max_tokens": 4, "length_penalty": math.nan}, "length_penalty"),
        ({"beam_width": 2, "max_tokens": 4, "temperature": math.inf}, "temperature"),
        ({"beam_width": 2, "max_tokens": 4, "early_stopping": 0}, "early_stopping"),
    ],
)
def test_bad_beam_params(kwargs, name):
    with pytest.raises(ValueError, match=name):
        BeamSearchParams(**kwargs)


def test_bad_requests_keep_engine_serving(llm):
    good = _tp([5, 6, 7])
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    expected = llm.generate(good, params, use_tqdm=False)[0].outputs[0].token_ids
    cases = [
        ({}, "prompt"),
        ({"prompt_token_ids": 5}, "prompt_token_ids"),
        ({"prompt_token_ids": None}, "prompt_token_ids"),
        ({"prompt_token_ids": "abc"}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": None}, "prompt"),
        ([5, -1], "token"),
        ([5, 512], "token"),
        ([5, True], "token"),
        ([5, 2.0], "token"),
        (None, "prompt"),
        (5, "prompt"),
        (3.5, "prompt"),
        ([[5, 6], []], "prompt"),
        ([_tp([5, 6]), None], "prompt"),
    ]
    for prompt, word in cases:
        with pytest.raises(ValueError, match=word):
            llm.generate(prompt, params, use_tqdm=False)
        _assert_idle(llm)
    for bad_params, word in [
        (SamplingParams(n=10**6), "n"),
        (SamplingParams(n=1, best_of=10**4), "best_of"),
        (BeamSearchParams(beam_width=10**4, max_tokens=2), "beam_width"),
        (SamplingParams(logprobs=10**3), "logprobs"),
        (SamplingParams(prompt_logprobs=10**3), "prompt_logprobs"),
        ({"max_tokens": 3}, "params"),
        ([params], "sampling_params"),
    ]:
        with pytest.raises(ValueError, match=word):
            llm.generate([good, good], bad_params, use_tqdm=False)
        _assert_idle(llm)
    assert llm.generate(good, params, use_tqdm=False)[0].outputs[0].token_ids == expected
    _assert_idle(llm)


def test_bad_request_ids(llama_dir):
    engine = _engine(llama_dir)
    for rid in ("", None, 5):
        with pytest.raises(ValueError, match="request_id"):
            engine.add_request(rid, [5, 6])
    assert engine.add_request("a", [5, 6], SamplingParams(max_tokens=2)) == "a"
    # an id in use: served under an internal id of its own, as vLLM's LLMEngine does
    assert engine.add_request("a", [5, 6], SamplingParams(max_tokens=2)).startswith("a-")
    _drain(engine)
    _assert_idle(engine)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": 3}, "block_size"),
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": math.nan}, "gpu_memory_utilization"),
        ({"tensor_parallel_size": 3}, "tensor_parallel_size"),  # 4 heads
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size"),
        ({"speculative_config": {"method": "eagle"}}, "speculative_config"),
        ({"speculative_config": {"num_speculative_tokens": 0}}, "num_speculative_tokens"),
        ({"max_model_len": 5000}, "max_model_len"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"not_an_option": 1}, "not_an_option"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"num_gpu_blocks_override": 2}, "max_model_len"),
        ({"cpu_kv_cache_gib": math.inf}, "cpu_kv_cache_gib"),
        ({"enable_prefix_caching": "no"}, "enable_prefix_caching"),
        ({"enable_chunked_prefill": None}, "enable_chunked_prefill"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 16}, "max_num_batched_tokens"),
    ],
)
def test_bad_engine_options(llama_dir, kwargs, name):
    with pytest.raises(ValueError, match=name):
        LLM(model=str(llama_dir), **{"dtype": "float32", "max_model_len": 64, **kwargs})


def test_cpu_kv_cache_space_comes_from_the_environment(llama_dir, monkeypatch):
    """cpu_kv_cache_gib's default is PAGED_CPU_KVCACHE_SPACE, else vLLM's VLLM_CPU_KVCACHE_SPACE,
    else 1 GiB; an explicit option wins, and a bad value is an error naming the variable."""
    monkeypatch.delenv("PAGED_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert EngineConfig().cpu_kv_cache_gib == 1.0
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.5")
    assert EngineConfig().cpu_kv_cache_gib == 0.5
    monkeypatch.setenv("PAGED_CPU_KVCACHE_SPACE", "0.125")
    assert EngineConfig().cpu_kv_cache_gib == 0.125
    assert EngineConfig(cpu_kv_cache_gib=2.0).cpu_kv_cache_gib == 2.0
    small = _engine(llama_dir).get_stats().num_total_blocks
    monkeypatch.setenv("PAGED_CPU_KVCACHE_SPACE", "0.25")
    assert _engine(llama_dir).get_stats().num_total_blocks == 2 * small + 1  # block 0 is null
    for bad in ("0", "-1", "inf", "nan", "lots"):
        monkeypatch.setenv("PAGED_CPU_KVCACHE_SPACE", bad)
        with pytest.raises(ValueError, match="PAGED_CPU_KVCACHE_SPACE"):
            EngineConfig()


# ---- detokenization ------------------------------------------------------------------------------
def test_streamed_text_only_grows_and_matches_decode(llama_dir, llm):
    tok = llm.get_tokenizer()
    engine = _engine(llama_dir)
    prompts = _prompts(6, seed=16)
    free = _greedy_ids(llm, prompts, max_tokens=12)
    stops = []
    for i, p in enumerate(prompts):
        text = tok.decode(free[i], skip_special_tokens=True)
        stop = [text[len(text) // 2 : len(text) // 2 + 2]] if i % 2 and len(text) > 4 else []
        stops.append(stop)
        engine.add_request(
            str(i),
            p,
            SamplingParams(
                temperature=0,
                max_tokens=12,
                ignore_eos=True,
                stop=stop,
                skip_special_tokens=bool(i % 3),
            ),
        )
    seen = {str(i): "" for i in range(len(prompts))}
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            assert text.startswith(seen[out.request_id]), "streamed text was taken back"
            seen[out.request_id] = text
            if out.finished:
                final[out.request_id] = out.outputs[0]
    for i in range(len(prompts)):
        c = final[str(i)]
        full = _new_text(tok, prompts[i], c.token_ids, bool(i % 3))
        if c.finish_reason == "length":
            assert c.text == full
        else:
            assert c.stop_reason in stops[i] and full.startswith(c.text)
            assert stops[i][0] not in c.text
    _assert_idle(engine)


def test_special_tokens_visible_when_not_skipped(llm):
    """Hot seeded sampling draws special tokens (ids 0-4) now and then: their text shows only
    with skip_special_tokens=False."""
    tok = llm.get_tokenizer()
    prompts = _prompts(24, seed=17)
    base = dict(temperature=3.0, max_tokens=16, ignore_eos=True)
    shown = llm.generate(
        [_tp(p) for p in prompts],
        [SamplingParams(seed=i, skip_special_tokens=False, **base) for i in range(len(prompts))],
        use_tqdm=False,
    )
    hidden = llm.generate(
        [_tp(p) for p in prompts],
        [SamplingParams(seed=i, **base) for i in range(len(prompts))],
        use_tqdm=False,
    )
    num_special = 0
    for p, s, h in zip(prompts, shown, hidden):
        ids = s.outputs[0].token_ids
        assert ids == h.outputs[0].token_ids
        num_special += sum(t < 5 for t in ids)
        for out, skip in ((s, False), (h, True)):
            assert out.outputs[0].text == _new_text(tok, p, ids, skip)
        if any(t < 5 for t in ids):
            assert "<|" in s.outputs[0].text
    assert num_special > 0, "no special token generated: pick other prompts"
    _assert_idle(llm)


def _new_text(tok, prompt: list[int], ids: list[int], skip: bool) -> str:
    """The text ids add after the prompt. A random prompt may end inside a character: that
    character (U+FFFD in the prompt's text) belongs to the prompt, as in vLLM."""
    before = tok.decode(prompt, skip_special_tokens=skip)
    after = tok.decode(prompt + ids, skip_special_tokens=skip)
    assert after.startswith(before.rstrip("\ufffd"))
    return after[len(before) :]


# ---- API shapes ----------------------------------------------------------------------------------
def test_chat_and_prompt_shapes(llm):
    convs = [
        [{"role": "user", "content": "hello world"}],
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "the capital of France is"},
        ],
    ]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.chat(convs, params, use_tqdm=False)
    assert len(outs) == 2
    single = llm.chat(convs[1], params, use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert outs[1].prompt.startswith("<|im_start|>system")
    assert llm.chat([], params, use_tqdm=False) == []
    ids = [5, 6, 7, 8]
    one = llm.generate(ids, params, use_tqdm=False)
    assert len(one) == 1 and one[0].prompt_token_ids == ids
    assert llm.generate(_tp(ids), params, use_tqdm=False)[0].outputs[0].token_ids == (
        one[0].outputs[0].token_ids
    )
    assert llm.generate((5, 6, 7, 8), params, use_tqdm=False)[0].prompt_token_ids == ids
    text = llm.generate("hello world", params, use_tqdm=False)[0]
    assert text.prompt == "hello world" and text.prompt_token_ids
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([ids, ids, ids], [params, params], use_tqdm=False)
    _assert_idle(llm)


TOOLS_TEMPLATE = (
    "{% if tools %}tools: {{ tools | map(attribute='function') | map(attribute='name') "
    "| join(',') }}\n{% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def test_chat_takes_vllms_arguments(llm):
    """tools reach the template, continue_final_message leaves the last message open, text
    parts join into one string (as the server joins them), and the arguments are checked."""
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    hi = [{"role": "user", "content": "hi"}]
    (out,) = llm.chat(hi, params, use_tqdm=False, chat_template=TOOLS_TEMPLATE, tools=tools)
    assert out.prompt == "tools: weather\nuser: hi\nassistant:"
    (out,) = llm.chat(hi, params, use_tqdm=False, chat_template=TOOLS_TEMPLATE)
    assert out.prompt == "user: hi\nassistant:"
    started = [*hi, {"role": "assistant", "content": "The answer is"}]
    (out,) = llm.chat(
        started, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True
    )
    assert out.prompt.endswith("<|im_start|>assistant\nThe answer is"), out.prompt
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    for fmt in ("auto", "string"):
        (out,) = llm.chat(parts, params, use_tqdm=False, chat_template=TOOLS_TEMPLATE,
                          chat_template_content_format=fmt)  # fmt: skip
        assert out.prompt == "user: a\nb\nassistant:"
    (out,) = llm.chat(parts, params, use_tqdm=False, chat_template=TOOLS_TEMPLATE,
                      chat_template_content_format="openai")  # fmt: skip
    assert out.prompt.startswith("user: [{")  # the parts as the template got them
    for kwargs, says in [
        ({"continue_final_message": True}, "cannot both be True"),
        ({"continue_final_message": True, "add_generation_prompt": False}, "assistant's"),
        ({"chat_template_content_format": "xml"}, "chat_template_content_format"),
        ({"tools": {"name": "x"}}, "tools must be a list"),
    ]:
        with pytest.raises(ValueError, match=says):
            llm.chat(hi, params, use_tqdm=False, **kwargs)
    _assert_idle(llm)


def test_streamed_outputs_are_snapshots(llama_dir):
    """A RequestOutput from step() does not change after later steps (logprobs included)."""
    engine = _engine(llama_dir)
    engine.add_request("a", [5, 6, 7], SamplingParams(n=2, max_tokens=6, logprobs=2, seed=3))
    engine.add_request("b", [8, 9], SamplingParams(max_tokens=5, logprobs=0, prompt_logprobs=1))
    seen = []
    while engine.has_unfinished_requests():
        seen.extend(engine.step())
    assert len(seen) > 4
    for out in seen:
        for c in out.outputs:
            assert len(c.logprobs) == len(c.token_ids)
        if out.request_id == "b":
            assert len(out.prompt_logprobs) == 2
    _assert_idle(engine)


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("beam", [False, True])
def test_preempted_parallel_request_resumes(llama_dir, caching, beam):
    """A forked request that fits the pool alone (its prompt blocks shared) still fits when it
    is recomputed after a preemption: the recompute shares the prompt blocks again."""
    llm = _llm(
        llama_dir,
        max_model_len=48,
        block_size=8,
        num_gpu_blocks_override=7,
        enable_prefix_caching=caching,
    )
    first = (
        _tp(list(range(10, 18))),
        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
    )
    fork_params = (
        BeamSearchParams(beam_width=2, max_tokens=16, ignore_eos=True)
        if beam
        else SamplingParams(n=2, seed=0, max_tokens=16, ignore_eos=True)
    )
    fork = (_tp(list(range(100, 116))), fork_params)
    alone = llm.generate(*fork, use_tqdm=False)[0]  # 2 shared + 2 x 2 own blocks: fits
    assert llm.get_stats().num_preemptions == 0
    both = llm.generate([first[0], fork[0]], [first[1], fork[1]], use_tqdm=False)
    assert llm.get_stats().num_preemptions > 0
    assert [c.token_ids for c in both[1].outputs] == [c.token_ids for c in alone.outputs]
    _assert_idle(llm)


def test_prompt_dict_with_text_and_ids_uses_the_ids(tmp_path):
    """As in vLLM: with both keys the token ids are run and the text is reported."""
    from paged_engine import LLM, SamplingParams
    from paged_engine.testing import write_tiny_model

    llm = LLM(model=str(write_tiny_model(tmp_path, "llama")), dtype="float32", max_model_len=64)
    out = llm.generate(
        {"prompt": "hi", "prompt_token_ids": [5, 6, 7]},
        SamplingParams(temperature=0, max_tokens=2),
        use_tqdm=False,
    )[0]
    assert out.prompt == "hi" and out.prompt_token_ids == [5, 6, 7]


def test_prompt_logprobs_of_a_request_that_finishes_in_its_prefill_step(llama_dir):
    llm = LLM(model=str(llama_dir), dtype="float32", max_model_len=64)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert [next(iter(d)) if d else None for d in out.prompt_logprobs][1:] == [6, 7, 8]


def test_stop_strings_skip_the_text_of_the_first_min_tokens(llm):
    """vLLM's detokenizer checks stop strings once more than min_tokens tokens are out: a stop
    inside the min_tokens-th token's text does not end the output (paged once checked it)."""
    prompt = _tp([40 + k for k in range(12)])
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (whole,) = llm.generate(prompt, plain, use_tqdm=False)
    ids, text = whole.outputs[0].token_ids, whole.outputs[0].text
    tok = llm.get_tokenizer()
    # a token k whose text holds a character no earlier token's text holds
    for k in range(2, len(ids)):
        before, upto = tok.decode(ids[: k - 1]), tok.decode(ids[:k])
        if not upto.startswith(before):
            continue
        fresh = [c for c in upto[len(before) :] if c.strip() and c not in before]
        if fresh:
            break
    else:
        pytest.skip("no token of this output brings a new character")
    stop = fresh[0]
    at = text.find(stop, len(upto))  # checked only from token k + 1's text on
    want = text if at < 0 else text[:at]
    params = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, stop=[stop], min_tokens=k
    )
    (out,) = llm.generate(prompt, params, use_tqdm=False)
    assert out.outputs[0].text == want
    assert out.outputs[0].text != text[: text.find(stop)]  # the k-th token's stop was skipped
