"""Suffix decoding (speculative_config={"method": "suffix", ...}): drafts from the sequence's own
text and from a cache of finished requests' outputs change no token.

Greedy: token-identical to plain decoding (and to n-gram lookup) with drafts accepted, through
preemption, prefix caching, n > 1 and async scheduling; seeded sampled n > 1 sequences carry the
target's logprobs. The cache makes a repeated request draft what the earlier one produced. The
proposer itself: the suffix-tree semantics on small texts, its options, FIFO eviction and bounded
memory. Config: vLLM's keys, defaults and bounds.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from spec_checks import (
    assert_logprobs_recomputed,
    assert_plain_through_preemption,
    run_engine,
    spec_prompts,
    tokens_and_logprobs,
)

from paged_engine import LLM, SamplingParams
from paged_engine.spec_decode.config import SpeculativeConfig
from paged_engine.spec_decode.suffix_proposer import MAX_OCCURRENCES, SuffixProposer
from paged_engine.testing import write_tiny_model

pytestmark = pytest.mark.usefixtures("no_isolated_step_failures")  # conftest.py

pytest.importorskip("transformers")

SUFFIX = {"method": "suffix"}


def _assert_same(got, want) -> None:
    got, want = tokens_and_logprobs(got), tokens_and_logprobs(want)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, g), (_, w) in zip(got, want):
        assert g == pytest.approx(w, abs=1e-4)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=1)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_is_token_identical_with_drafts_accepted(tmp_path, arch):
    """vLLM's defaults (k = the tree depth, 24) and a small k: plain decoding's tokens and
    logprobs, the n-gram engine's tokens, drafts of varying length accepted."""
    path = write_tiny_model(tmp_path, arch, seed=1)
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=2, ignore_eos=True)
    plain, _ = run_engine(path, spec_prompts(), params)
    ngram, _ = run_engine(
        path, spec_prompts(), params, speculative_config={"num_speculative_tokens": 3}
    )
    assert [o.outputs[0].token_ids for o in ngram] == [o.outputs[0].token_ids for o in plain]
    for config, k in ((SUFFIX, 24), ({**SUFFIX, "num_speculative_tokens": 3}, 3)):
        spec, stats = run_engine(path, spec_prompts(), params, speculative_config=config)
        _assert_same(spec, plain)
        accepted = stats.spec_decode_num_accepted_tokens
        assert 0 < accepted <= stats.spec_decode_num_draft_tokens
        per_pos = stats.spec_decode_num_accepted_tokens_per_pos
        assert len(per_pos) == k and sum(per_pos) == accepted
        assert per_pos == sorted(per_pos, reverse=True)


def test_cache_of_finished_outputs_drafts_a_repeated_request(llama):
    """A prompt whose text never repeats: its own tokens draft little, but once a request with
    it finished, the same request again drafts the earlier output (and keeps plain decoding's
    tokens); with suffix_decoding_max_cached_requests=0 nothing is cached."""
    rng = random.Random(3)
    prompt = {"prompt_token_ids": rng.sample(range(3, 500), 30)}
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    (plain,), _ = run_engine(llama, [prompt], params)

    def accepted_twice(config: dict) -> tuple[int, int]:
        llm = LLM(model=str(llama), dtype="float32", block_size=8, max_model_len=256,
                  speculative_config=config)  # fmt: skip
        counts = []
        for _ in range(2):
            (out,) = llm.generate([prompt], params, use_tqdm=False)
            assert out.outputs[0].token_ids == plain.outputs[0].token_ids
            counts.append(llm.llm_engine.get_stats().spec_decode_num_accepted_tokens)
        return counts[0], counts[1] - counts[0]

    first, second = accepted_twice(SUFFIX)
    assert second >= 40 > first  # nearly every token drafted and accepted the second time
    first_off, second_off = accepted_twice({**SUFFIX, "suffix_decoding_max_cached_requests": 0})
    assert first_off == first and second_off == first


def test_preemption_limits_and_stops(llama):
    """spec_checks' preemption / stop / max_tokens case under suffix decoding, drafts taken."""
    stats = assert_plain_through_preemption(llama, SUFFIX)
    assert stats.spec_decode_num_accepted_tokens > 0


def test_prefix_caching_and_async_scheduling(llama):
    """Prompts sharing a long prefix after a request that cached it (prefix-cache hits, drafts
    past the shared blocks), with and without async scheduling: plain decoding's outputs."""
    shared = [5, 6, 7, 8, 9] * 5
    prompts = [{"prompt_token_ids": shared + [i, i + 1]} for i in range(10, 16)]
    params = SamplingParams(temperature=0, max_tokens=30, logprobs=1, ignore_eos=True)

    def run(**kwargs):
        llm = LLM(model=str(llama), dtype="float32", block_size=8, max_model_len=256,
                  enable_prefix_caching=True, **kwargs)  # fmt: skip
        llm.generate([{"prompt_token_ids": shared}], params, use_tqdm=False)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return outs, llm.llm_engine.get_stats()

    plain, _ = run()
    for extra in ({}, {"async_scheduling": True}):
        spec, stats = run(speculative_config=SUFFIX, **extra)
        assert stats.prefix_cache_hits > 0 and stats.spec_decode_num_accepted_tokens > 0
        _assert_same(spec, plain)


def _own_text_prompts(path, starts: list[list[int]]) -> list[dict]:
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs, _ = run_engine(path, [{"prompt_token_ids": s} for s in starts], greedy)
    return [{"prompt_token_ids": s + list(o.outputs[0].token_ids)} for s, o in zip(starts, outs)]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_n_greater_than_one_through_preemption(llama, mode):
    """Greedy n = 2 and seeded temperature-0.5 n = 3 requests on a pool too small for them:
    every sequence drafts over its own text (and the outputs of finished ones) and rolls back on
    its own; greedy sequences give plain greedy decoding's tokens, sampled ones the target's
    logprobs; every block free (checked by _run)."""
    starts = [[333, 4], [40, 41, 42], [12, 13], [9, 250, 31, 77], [5, 6, 7, 8], [100, 7, 300]]
    prompts = _own_text_prompts(llama, starts)
    rng = random.Random(7)
    greedy, sampled, params = [], [], []
    for i in range(len(prompts)):
        common = {"max_tokens": rng.randint(12, 24), "logprobs": 0, "ignore_eos": True}
        if i % 2:
            params.append(SamplingParams(temperature=0.5, n=3, seed=i, **common))
            sampled.append(i)
        else:
            params.append(SamplingParams(temperature=0, n=2, **common))
            greedy.append(i)
    kwargs = {"num_gpu_blocks_override": 24, "max_num_seqs": 12, "max_model_len": 96}
    kwargs |= {"preemption_mode": mode, "swap_space": 0.05}
    spec, stats = run_engine(llama, prompts, params, speculative_config=SUFFIX, **kwargs)
    assert stats.num_preemptions > 0
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    one = [
        SamplingParams(temperature=0, max_tokens=params[i].max_tokens, ignore_eos=True)
        for i in greedy
    ]
    plain, _ = run_engine(llama, [prompts[i] for i in greedy], one)
    for i, ref in zip(greedy, plain):
        assert [list(c.token_ids) for c in spec[i].outputs] == [list(ref.outputs[0].token_ids)] * 2
    rows = [spec[i] for i in sampled]
    for o, i in zip(rows, sampled):
        assert all(len(c.token_ids) == params[i].max_tokens for c in o.outputs)
    assert_logprobs_recomputed(llama, rows)


# -- the proposer ------------------------------------------------------------------------------


def _proposer(**kw) -> SuffixProposer:
    args = {"max_tree_depth": 24, "max_cached_requests": 100, "max_spec_factor": 1.0}
    return SuffixProposer(**(args | {"min_token_prob": 0.1} | kw))


def test_drafts_follow_the_most_frequent_continuation():
    p = _proposer()
    # "1 2 3" twice before the tail's: then 4 (2 of 3 occurrences: the tail's own counts), then
    # 5 or 6 (1 of 3 each: the smaller id on a tie), then 1 (the one path left)
    twice = [9, 1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2, 3]
    assert p.propose(1, twice, 10) == [4, 5, 1]
    assert _proposer(min_token_prob=0.5).propose(1, twice, 10) == [4]  # not the 1/3 token
    # the best score (sum of the drafts' probabilities) wins: "1 2" (m = 2) went on with 5 in 3
    # of 5 occurrences (0.6), "7 1 2" (m = 3) with 8 in 1 of 2 (0.5); but m = 3 allows three
    # drafts (factor 1): 8 0 7 scores 1.5, 5 1 (m = 2: two at most) 0.6 + 0.4
    tokens = [1, 2, 5, 1, 2, 5, 1, 2, 5, 7, 1, 2, 8, 0, 7, 1, 2]
    assert p.propose(2, tokens, 1) == [5]
    assert p.propose(2, tokens, 3) == [8, 0, 7]
    assert p.propose(3, [1, 2, 3, 4, 5], 3) == []  # nothing recurs
    assert p.propose(4, [5, 6, 7, 8, 9] * 6, 10) == [5, 6, 7, 8, 9] * 2
    assert p.propose(4, [5, 6, 7, 8, 9] * 6, 0) == []


def test_spec_factor_and_tree_depth_bound_the_draft():
    tokens = list(range(10, 30)) + [10, 11]  # "10 11" matched (m = 2), 18 more tokens follow
    assert len(_proposer().propose(1, tokens, 16)) == 2  # factor 1: at most m
    assert len(_proposer(max_spec_factor=3.0).propose(1, tokens, 16)) == 6
    assert _proposer(max_spec_factor=0.0).propose(1, tokens, 16) == []
    # depth 5: match + draft <= 5 even with a large factor: m = 2 allows 3 drafts, m = 1 (the
    # last token alone, same occurrences) 4, which score higher
    shallow = _proposer(max_tree_depth=5, max_spec_factor=9.0)
    assert shallow.propose(1, tokens, 16) == [12, 13, 14, 15]
    assert len(_proposer(max_spec_factor=9.0).propose(1, tokens, 4)) == 4  # the row's room


def test_sequence_text_follows_its_tokens():
    p = _proposer()
    tokens = [1, 2, 3, 4, 1, 2]
    assert p.propose(7, tokens, 5) == [3, 4]
    tokens += [3, 4, 9, 1, 2]  # appended: synced incrementally
    assert p.propose(7, tokens, 5) == [3, 4]  # "1 2" 3 times (2 go on with 3 4): m = 2 drafts
    changed = [1, 2, 8, 4, 1, 2]  # rewritten (not an append): rebuilt
    assert p.propose(7, changed, 5) == [8, 4]
    p.finish([7], [])
    assert 7 not in p._texts


def test_cache_drafts_across_requests_and_evicts_oldest_first():
    p = _proposer(max_cached_requests=2)
    p.finish([1], [[10, 11, 12, 13, 14, 15, 16, 17]])
    assert p.propose(2, [50, 10, 11, 12, 13], 10) == [14, 15, 16, 17]  # m = 4 -> 4 drafts
    assert p.propose(3, [50, 13], 10) == []  # the cache matches two tokens or more
    p.finish([2, 3], [[20, 21, 22, 23], [30, 31, 32, 33]])  # one request, two sequences
    p.finish([4], [[40, 41, 42, 43]])  # a third request: the first is evicted
    assert len(p.cache) == 2
    assert p.propose(5, [60, 10, 11, 12, 13], 10) == []
    assert p.propose(6, [61, 30, 31], 10) == [32, 33]
    assert p.propose(7, [62, 40, 41], 10) == [42, 43]
    off = _proposer(max_cached_requests=0)
    off.finish([1], [[10, 11, 12, 13]])
    assert len(off.cache) == 0 and off.propose(2, [9, 10, 11], 4) == []


def test_ended_stretches_count_but_are_never_drafted():
    """Many occurrences (counted in bulk): those a stretch ends after are in the denominator
    only, even when they are the most frequent."""
    p = _proposer()
    for i in range(30):
        p.finish([i], [[5, 6, 7] if i % 3 == 0 else [5, 6]])
    assert p.propose(100, [1, 5, 6], 4) == [7]  # 10 of 30 went on with 7 (> 0.1); 20 ended
    assert _proposer(min_token_prob=0.5).propose(100, [5, 6] * 20, 4) == [5, 6, 5, 6]


def test_cache_memory_stays_bounded():
    """Many more finished requests than the cache keeps: the store, the index and each index
    entry stay within the bounds (max_cached_requests outputs, 2 x MAX_OCCURRENCES positions)."""
    rng = np.random.default_rng(0)
    p = _proposer(max_cached_requests=20)
    for i in range(400):
        p.finish([i], [rng.integers(0, 50, size=100).tolist()])
    cache = p.cache
    assert len(cache) == 20 and cache.num_tokens == 20 * 101
    assert len(cache._store) <= 4 * 21 * 101  # grown only while over half full after compacting
    assert sum(len(v) for v in cache._index.values()) <= 20 * 99
    assert max(len(v) for v in cache._index.values()) <= 2 * MAX_OCCURRENCES
    lowest = min(v[0] for v in cache._index.values())
    assert lowest >= cache._spans[0][0]  # no position of an evicted request left
    # many occurrences of the last token: at most MAX_OCCURRENCES read
    assert len(p.propose(1000, [3] * 5000, 8)) == 8


# -- config ------------------------------------------------------------------------------------


def test_config_keys_defaults_and_bounds(llama):
    cfg = SpeculativeConfig.from_dict(SUFFIX)
    assert cfg.is_suffix and cfg.num_speculative_tokens == 24  # vLLM: the tree depth
    assert (cfg.suffix_decoding_max_tree_depth, cfg.suffix_decoding_max_cached_requests) == (
        24, 10000)  # fmt: skip
    assert (cfg.suffix_decoding_max_spec_factor, cfg.suffix_decoding_min_token_prob) == (1.0, 0.1)
    deep = SpeculativeConfig.from_dict({**SUFFIX, "suffix_decoding_max_tree_depth": 40})
    assert deep.num_speculative_tokens == 40
    bad = {
        "suffix_decoding_max_tree_depth": 0,
        "suffix_decoding_max_cached_requests": -1,
        "suffix_decoding_max_spec_factor": -0.5,
        "suffix_decoding_min_token_prob": 1.5,
    }
    for key, value in bad.items():
        with pytest.raises(ValueError, match=rf"speculative_config\.{key} must be"):
            SpeculativeConfig.from_dict({**SUFFIX, key: value})
    for value in ("2", True, float("nan")):
        with pytest.raises(ValueError, match=r"speculative_config\.suffix_decoding_min_token_p"):
            SpeculativeConfig.from_dict({**SUFFIX, "suffix_decoding_min_token_prob": value})
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be <= 24"):
        SpeculativeConfig.from_dict({**SUFFIX, "num_speculative_tokens": 25})
    with pytest.raises(ValueError, match=r"speculative_config\.model is given with method 'suf"):
        SpeculativeConfig.from_dict({**SUFFIX, "model": "x"})
    with pytest.raises(ValueError, match=r"speculative_config\.suffix_decoding_max_tree_depth"):
        LLM(model=str(llama), speculative_config={**SUFFIX, "suffix_decoding_max_tree_depth": 0})


def _reference_drafts(
    tokens: list[int], cached: list[list[int]], room: int, depth: int, factor: float,
    min_prob: float,
) -> list[int]:  # fmt: skip
    """Suffix decoding's documented semantics, brute force: for every match length m (of the
    last <= depth tokens) the greedy path after the occurrences matching m tokens or more, for
    at most min(room, floor(factor x m), depth - m) tokens; the highest probability sum wins
    (the longer match on a tie), the sequence's own text (the latest MAX_OCCURRENCES occurrences
    of its last token, its own included) before the cached outputs (each followed by END; the
    latest MAX_OCCURRENCES occurrences of the last two tokens, so m >= 2 there)."""
    if room <= 0 or not tokens:
        return []
    end = -1
    n = min(len(tokens), depth)
    pattern = tokens[-n:]

    def match(text: list[int], e: int) -> int:  # how far text[..e] agrees with the pattern
        k = 0
        while k < n and e - k >= 0 and text[e - k] == pattern[-1 - k]:
            k += 1
        return k

    def follow(text: list[int], cur: list[int], cap: int) -> tuple[float, list[int]]:
        draft: list[int] = []
        score, prob = 0.0, 1.0
        while len(draft) < cap:
            if len(cur) == 1:  # one occurrence left: the rest of its stretch, each token at prob
                run = []
                for t in text[cur[0] + 1 :]:
                    if t == end or len(draft) + len(run) == cap:
                        break
                    run.append(t)
                return score + prob * len(run), draft + run
            nxt = [text[p + 1] if p + 1 < len(text) else end for p in cur]
            counts = {t: nxt.count(t) for t in nxt if t != end}
            if not counts:
                break
            token = min(counts, key=lambda t: (-counts[t], t))
            prob *= counts[token] / len(cur)
            if prob < min_prob:
                break
            draft.append(token)
            score += prob
            cur = [p + 1 for p, t in zip(cur, nxt) if t == token]
        return score, draft

    def best(text: list[int], occurrences: list[int], shortest: int) -> tuple[float, list[int]]:
        lengths = {e: match(text, e) for e in occurrences}
        result: tuple[float, list[int]] = (0.0, [])
        for m in range(n, shortest - 1, -1):
            group = [e for e in occurrences if lengths[e] >= m]
            if group:
                cap = min(room, int(m * factor + 1e-6), depth - m)
                score, draft = follow(text, group, cap)
                if score > result[0]:
                    result = (score, draft)
        return result

    own = [e for e, t in enumerate(tokens) if t == pattern[-1]][-MAX_OCCURRENCES:]
    score, draft = best(tokens, own, 1)
    store = [t for out in cached for t in [*out, end]]
    if n >= 2:
        pair = [e for e in range(1, len(store)) if store[e - 1 : e + 1] == pattern[-2:]]
        other, other_draft = best(store, pair[-MAX_OCCURRENCES:], 2)
        if other > score:
            return other_draft
    return draft


@pytest.mark.parametrize("seed", range(12))
def test_drafts_equal_a_brute_force_reference(seed):
    """Random token streams with repeats (appended, sometimes cut back), random rooms and
    options, finished requests cached (or no cache): every step's drafts equal the reference."""
    rng = random.Random(seed)
    depth = rng.choice([1, 2, 3, 5, 24])
    max_cached = rng.choice([0, 1, 3, 50])
    factor, min_prob = rng.choice([0.0, 0.5, 1.0, 3.0]), rng.choice([0.0, 0.1, 0.4, 1.0])
    p = _proposer(max_tree_depth=depth, max_cached_requests=max_cached, max_spec_factor=factor,
                  min_token_prob=min_prob)  # fmt: skip
    vocab = rng.choice([2, 3, 6, 40])
    cached: list[list[int]] = []  # the reference's cache: outputs of the kept requests
    kept: list[int] = []  # how many outputs each kept request has
    seqs: dict[int, list[int]] = {}
    for _ in range(250):
        if seqs and rng.random() < 0.06:  # a request finishes: its non-empty outputs cached
            seq_id = rng.choice(list(seqs))
            tokens = seqs.pop(seq_id)
            outputs = [tokens[rng.randrange(len(tokens) + 1) :], [rng.randrange(vocab)] * 2]
            p.finish([seq_id], outputs)
            outputs = [o for o in outputs if o]
            if max_cached and outputs:
                cached += outputs
                kept.append(len(outputs))
                if len(kept) > max_cached:
                    del cached[: kept.pop(0)]
            continue
        seq_id = rng.randrange(4)
        if seq_id not in seqs:  # some prompts long: more occurrences than MAX_OCCURRENCES
            seqs[seq_id] = [rng.randrange(vocab) for _ in range(rng.choice([0, 10, 700]))]
        tokens = seqs[seq_id]
        for _ in range(rng.randint(1, 3)):
            if tokens and rng.random() < 0.4:  # repeat an earlier stretch
                at = rng.randrange(len(tokens))
                tokens += tokens[at : at + rng.randint(1, 20)]
            else:
                tokens.append(rng.randrange(vocab))
        if len(tokens) > 1 and rng.random() < 0.05:  # cut back (then rebuilt), not appended
            del tokens[rng.randrange(1, len(tokens)) :]
        room = rng.choice([0, 1, 2, 4, 16])
        want = _reference_drafts(tokens, cached, room, depth, factor, min_prob)
        assert p.propose(seq_id, list(tokens), room) == want


@pytest.mark.parametrize(
    ("depth", "factor", "k", "most"),
    [(24, 1.0, None, 12), (24, 2.0, None, 16), (24, 1.0, 5, 5), (8, 0.5, None, 2)],
)
def test_max_draft_tokens_is_the_longest_draft_the_settings_allow(depth, factor, k, most):
    """Verification graphs and the memory profile are sized by max_draft_tokens: for suffix
    decoding the longest draft its caps allow (vLLM's defaults: 12, not k = 24), reached on a
    text that repeats, never passed."""
    spec = {
        **SUFFIX,
        "suffix_decoding_max_tree_depth": depth,
        "suffix_decoding_max_spec_factor": factor,
    }
    if k is not None:
        spec["num_speculative_tokens"] = k
    config = SpeculativeConfig.from_dict(spec)
    assert config.max_draft_tokens == most
    proposer = SuffixProposer(depth, 0, factor, 0.1)
    tokens = list(range(3, 3 + 2 * depth)) * 4
    longest = max(
        len(proposer.propose(1, tokens[:n], config.num_speculative_tokens))
        for n in range(2, len(tokens))
    )
    assert longest == most
    assert SpeculativeConfig.from_dict({"num_speculative_tokens": 4}).max_draft_tokens == 4
