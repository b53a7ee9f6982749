"""SamplingParams fields of newer vLLM: repetition_detection (a loop ends the sequence),
logprobs / prompt_logprobs -1 (every token), stream_interval (fewer, larger streamed outputs),
skip_reading_prefix_cache, flat_logprobs, extra_args, skip_clone, seed -1. Each against the
plain engine or an independent reference on the same inputs."""

from __future__ import annotations

import pytest
import torch

from paged_engine import LLM, EngineConfig, LLMEngine, RequestOutputKind, SamplingParams
from paged_engine.logprobs import FlatLogprobs, Logprob
from paged_engine.sampling_params import RepetitionDetectionParams

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 6, 7], [40, 41, 42, 43], [100, 3], [9] * 6, [250, 17, 33, 2, 8]]


def _llm(path, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", max_model_len=128, block_size=4, **kw)


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama")


def _loop_end(tokens: list[int], lo: int, hi: int, count: int) -> int | None:
    """The length of the shortest prefix of `tokens` that ends with a pattern of lo..hi
    tokens repeated `count` times back to back (brute force), or None."""
    for end in range(1, len(tokens) + 1):
        for size in range(lo, hi + 1):
            if size * count <= end:
                tail = tokens[end - size * count : end]
                if tail == tail[:size] * count:
                    return end
    return None


@pytest.mark.parametrize(
    "engine",
    [
        {},
        {"async_scheduling": True},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    ],
    ids=["sync", "async", "ngram-drafts"],
)
def test_repetition_detection_ends_a_loop_where_it_starts_repeating(llama, engine):
    llm = _llm(llama, **engine)
    plain = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    rule = RepetitionDetectionParams(max_pattern_size=4, min_pattern_size=1, min_count=3)
    cut = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, repetition_detection=rule)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    full = llm.generate(prompts, plain, use_tqdm=False)
    short = llm.generate(prompts, cut, use_tqdm=False)
    looped = 0
    for f, s in zip(full, short):
        tokens = list(f.outputs[0].token_ids)
        end = _loop_end(tokens, 1, 4, 3)
        got = s.outputs[0]
        if end is None:
            assert list(got.token_ids) == tokens and got.finish_reason == "length"
        else:
            looped += 1
            assert list(got.token_ids) == tokens[:end]
            assert (got.finish_reason, got.stop_reason) == ("repetition", "repetition_detected")
    assert looped >= 2  # the tiny model loops on most prompts: the rule is exercised
    assert llm.get_stats().num_used_blocks == 0
    llm.llm_engine.shutdown()


def test_repetition_detection_values_are_checked():
    assert SamplingParams(repetition_detection={"max_pattern_size": 2, "min_count": 2})
    for bad, says in [
        ({"max_pattern_size": 2, "min_count": 1}, "min_count"),
        ({"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}, "min_pattern_size"),
        ({"max_pattern_size": -1}, "max_pattern_size"),
        ({"max_pattern": 2}, "unknown"),
        ([2, 2], "dict"),
    ]:
        with pytest.raises(ValueError, match=says):
            SamplingParams(repetition_detection=bad)
    with pytest.raises(ValueError, match="repetition_detection is not supported with use_beam"):
        SamplingParams(
            use_beam_search=True,
            n=2,
            temperature=0,
            repetition_detection={"max_pattern_size": 2, "min_count": 2},
        )
    off = RepetitionDetectionParams()  # max_pattern_size 0: off
    assert not off.found([1, 1, 1, 1], 4)


def test_logprobs_minus_one_is_every_token(llama):
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    with pytest.raises(ValueError, match="max_logprobs=20"):
        _llm(llama).generate({"prompt_token_ids": PROMPTS[1]}, SamplingParams(logprobs=-1))
    llm = _llm(llama, max_logprobs=-1)
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=-1, prompt_logprobs=-1)
    (out,) = llm.generate({"prompt_token_ids": PROMPTS[1]}, params, use_tqdm=False)
    assert params.logprobs == -1 and params.prompt_logprobs == -1  # the caller's object
    ids = PROMPTS[1] + list(out.outputs[0].token_ids)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    n = len(PROMPTS[1])
    for step, entry in enumerate(out.outputs[0].logprobs):
        assert len(entry) == vocab
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks == list(range(1, vocab + 1))
        for tid in (0, ids[n + step], vocab - 1):
            assert entry[tid].logprob == pytest.approx(ref[n - 1 + step, tid].item(), abs=1e-4)
    for pos in range(1, n):
        assert len(out.prompt_logprobs[pos]) == vocab
    llm.llm_engine.shutdown()


@pytest.mark.parametrize(
    "engine",
    [
        {},
        {"async_scheduling": True},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    ],
    ids=["sync", "async", "ngram-drafts"],
)
def test_logprob_token_ids_report_those_tokens(llama, engine):
    """Each generated position reports the sampled token and every asked id, with the logprob
    and rank the whole distribution gives them; the batch's other rows are untouched."""
    llm = _llm(llama, max_logprobs=-1, **engine)
    wanted = [7, 250, 3]
    kw = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    explicit = SamplingParams(**kw, logprob_token_ids=wanted)
    assert explicit.logprobs == len(wanted)  # turned on, at the ids' count (vLLM's rule)
    top2 = SamplingParams(**kw, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    mixed = llm.generate(prompts, [explicit, top2, SamplingParams(**kw)], use_tqdm=False)
    every = llm.generate(prompts[0], SamplingParams(**kw, logprobs=-1), use_tqdm=False)[0]
    alone = llm.generate(prompts[1], top2, use_tqdm=False)[0].outputs[0]
    got = mixed[0].outputs[0]
    assert got.token_ids == every.outputs[0].token_ids
    for step, entry in enumerate(got.logprobs):
        assert set(entry) == {got.token_ids[step], *wanted}
        ref = every.outputs[0].logprobs[step]
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(ref[tid].logprob, abs=1e-5), (step, tid)
            assert lp.rank == ref[tid].rank and lp.decoded_token == ref[tid].decoded_token
    top = mixed[1].outputs[0]
    assert top.token_ids == alone.token_ids
    for entry, ref in zip(top.logprobs, alone.logprobs, strict=True):
        assert {t: lp.rank for t, lp in entry.items()} == {t: lp.rank for t, lp in ref.items()}
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(ref[t].logprob, abs=1e-5)
    assert mixed[2].outputs[0].logprobs is None
    llm.llm_engine.shutdown()


def test_logprob_token_ids_are_checked(llama):
    assert SamplingParams(logprob_token_ids=[]).logprob_token_ids is None
    assert SamplingParams(logprob_token_ids=["5", 5, 9]).logprob_token_ids == [5, 9]
    for bad in ([-1], "5", [1.5]):
        with pytest.raises(ValueError, match="logprob_token_ids"):
            SamplingParams(logprob_token_ids=bad)
    with pytest.raises(ValueError, match="logprob_token_ids"):
        SamplingParams(logprob_token_ids=[5], use_beam_search=True, n=2, temperature=0)
    llm = _llm(llama, max_logprobs=2)
    prompt = {"prompt_token_ids": PROMPTS[0]}
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(prompt, SamplingParams(logprob_token_ids=[10**6]), use_tqdm=False)
    # max_logprobs bounds top-k counts, not the ids (vLLM: at most 128 of them)
    out = llm.generate(prompt, SamplingParams(logprob_token_ids=[1, 2, 3]), use_tqdm=False)
    assert {1, 2, 3} <= set(out[0].outputs[0].logprobs[0])
    llm.llm_engine.shutdown()


def _streamed(engine: LLMEngine, params: SamplingParams) -> list[list[int]]:
    engine.add_request("r", {"prompt_token_ids": PROMPTS[0]}, params)
    chunks = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            chunks.append(list(out.outputs[0].token_ids))
    return chunks


@pytest.mark.parametrize(
    ("engine_interval", "request_interval", "want"), [(1, None, 1), (1, 4, 4), (3, 2, 3)]
)
def test_stream_interval_batches_streamed_tokens(llama, engine_interval, request_interval, want):
    engine = LLMEngine(
        EngineConfig(
            model=str(llama), dtype="float32", max_model_len=64, stream_interval=engine_interval
        )
    )
    params = SamplingParams(
        temperature=0,
        max_tokens=14,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
        stream_interval=request_interval,
    )
    chunks = _streamed(engine, params)
    sizes = [len(c) for c in chunks]
    # the first at once, then every `want` tokens, the rest with the last
    assert sizes[0] == 1 and all(s >= want for s in sizes[1:-1]) and sum(sizes) == 14
    assert len(sizes) == 1 + -(-13 // want)
    whole = _streamed(engine, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    assert [t for c in chunks for t in c] == whole[-1]
    engine.shutdown()


def test_skip_reading_prefix_cache(llama):
    llm = _llm(llama, enable_prefix_caching=True)
    prompt = {"prompt_token_ids": list(range(10, 30))}
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = llm.generate(prompt, sp, use_tqdm=False)[0]
    hit = llm.generate(prompt, sp, use_tqdm=False)[0]
    skip = SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, skip_reading_prefix_cache=True
    )
    miss = llm.generate(prompt, skip, use_tqdm=False)[0]
    assert hit.num_cached_tokens > 0 and miss.num_cached_tokens == 0
    assert first.outputs[0].token_ids == hit.outputs[0].token_ids == miss.outputs[0].token_ids
    llm.llm_engine.shutdown()


def test_small_fields():
    p = SamplingParams(seed=-1, stop_token_ids=[5, 7, 5], bad_words=["a", "b", "a"])
    assert p.seed is None and p.stop_token_ids == [5, 7] and p.bad_words == ["a", "b"]
    extra = {"my_plugin": {"k": 1}}
    p = SamplingParams(extra_args=extra, skip_clone=True, stop=["x"])
    assert p.clone().extra_args is extra and p.clone().stop is p.stop  # shallow
    q = SamplingParams(extra_args=extra, stop=["x"])
    assert q.clone().stop is not q.stop and q.clone().extra_args == extra  # deep
    for kw, says in [
        ({"extra_args": [1]}, "extra_args"),
        ({"stream_interval": 0}, "stream_interval"),
        ({"logprobs": -2}, "logprobs"),
        ({"skip_clone": 1}, "skip_clone"),
        ({"flat_logprobs": "yes"}, "flat_logprobs"),
    ]:
        with pytest.raises(ValueError, match=says):
            SamplingParams(**kw)


@pytest.mark.parametrize(
    "extra",
    [
        {"logprobs": 3, "prompt_logprobs": 2, "n": 2, "seed": 7},
        {"logprob_token_ids": [1, 9, 40], "prompt_logprobs": 0, "temperature": 0},
    ],
    ids=["top-k", "token-ids"],
)
def test_flat_logprobs_read_as_the_lists(llama, extra):
    """flat_logprobs=True: FlatLogprobs containers whose positions equal the default lists'
    (the prompt's first position reads back empty, as in vLLM), whole and streamed."""
    base = {"max_tokens": 9, "ignore_eos": True} | extra
    llm = _llm(llama)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    lists = llm.generate(prompts, SamplingParams(**base), use_tqdm=False)
    flats = llm.generate(prompts, SamplingParams(**base, flat_logprobs=True), use_tqdm=False)
    for a, b in zip(lists, flats):
        assert isinstance(b.prompt_logprobs, FlatLogprobs) and len(b.prompt_logprobs) > 1
        assert a.prompt_logprobs[0] is None and b.prompt_logprobs[0] == {}
        assert list(b.prompt_logprobs)[1:] == a.prompt_logprobs[1:]
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.token_ids == y.token_ids and isinstance(y.logprobs, FlatLogprobs)
            assert len(y.logprobs) == len(x.logprobs) == 9
            assert list(y.logprobs) == x.logprobs and y.logprobs[-1] == x.logprobs[-1]
            assert y.cumulative_logprob == x.cumulative_logprob
    (alone,) = llm.generate(prompts[0], SamplingParams(**base), use_tqdm=False)  # same batch
    engine = llm.llm_engine
    delta = SamplingParams(**base, flat_logprobs=True, output_kind=RequestOutputKind.DELTA)
    engine.add_request("s", prompts[0], delta)
    got: dict[int, FlatLogprobs] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for o in out.outputs:
                assert isinstance(o.logprobs, FlatLogprobs)
                got.setdefault(o.index, FlatLogprobs()).extend(o.logprobs)
    assert [list(got[o.index]) for o in alone.outputs] == [o.logprobs for o in alone.outputs]
    engine.shutdown()


def test_flat_logprobs_container():
    rows = [{3: Logprob(-0.5, 1, "a"), 7: Logprob(-1.5, 2, "b")}, None, {9: Logprob(-2.0, 4)}]
    flat = FlatLogprobs()
    flat.extend(rows)
    want = [rows[0], {}, rows[2]]
    assert len(flat) == 3 and list(flat) == want and flat[-1] == rows[2]
    assert flat.token_ids == [3, 7, 9] and flat.end_indices == [2, 2, 3]
    for cut in (slice(1, None), slice(None, None, 2), slice(None, None, -1), slice(5, 9)):
        part = flat[cut]
        assert isinstance(part, FlatLogprobs) and list(part) == want[cut]
    tail = flat[1:]
    assert tail.start_indices == [0, 0] and tail.token_ids == [9]  # offsets from 0
    joined = flat[:1]
    joined.extend(tail)
    joined += [rows[0]]
    assert list(joined) == want + [rows[0]] and list(flat) == want  # the source kept
    copy = flat.copy()
    copy.append(rows[0])
    assert len(copy) == 4 and len(flat) == 3
    assert rows[2] in flat and flat.index({}) == 1
    with pytest.raises(IndexError):
        flat[3]
    for change in (lambda: flat.__setitem__(0, {}), lambda: flat.insert(0, {}), flat.pop):
        with pytest.raises(TypeError):
            change()
    assert list(flat) == want


def test_truncate_prompt_tokens_and_guided_decoding(tiny_llama_dir):
    """vLLM's SamplingParams(truncate_prompt_tokens=k): the prompt's last k tokens (-1: as many
    as fit); guided_decoding is structured_outputs' older name."""
    import re

    from paged_engine import LLM, GuidedDecodingParams

    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=64)
    prompt = list(range(10, 90))  # 80 tokens: more than max_model_len
    cut = SamplingParams(temperature=0, max_tokens=5, truncate_prompt_tokens=8)
    (got,) = llm.generate({"prompt_token_ids": prompt}, cut, use_tqdm=False)
    plain = SamplingParams(temperature=0, max_tokens=5)
    (want,) = llm.generate({"prompt_token_ids": prompt[-8:]}, plain, use_tqdm=False)
    assert got.prompt_token_ids == prompt[-8:]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    most = SamplingParams(temperature=0, max_tokens=1, truncate_prompt_tokens=-1)
    (fit,) = llm.generate({"prompt_token_ids": prompt}, most, use_tqdm=False)
    assert fit.prompt_token_ids == prompt[-63:]
    pytest.importorskip("llguidance")
    guided = SamplingParams(
        temperature=0, max_tokens=12, guided_decoding=GuidedDecodingParams(regex=r"[a-z]{3}")
    )
    (out,) = llm.generate(["hi"], guided, use_tqdm=False)
    assert re.fullmatch(r"[a-z]{3}", out.outputs[0].text)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="truncate_prompt_tokens is not supported with use_beam"):
        SamplingParams(use_beam_search=True, n=2, truncate_prompt_tokens=4)
