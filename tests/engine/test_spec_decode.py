"""Speculative decoding (n-gram prompt lookup): exact in distribution.

Greedy: token-identical to plain decoding (logprobs within 1e-4) for every tiny architecture and
k in {1, 3, 5}, with drafts proposed and accepted. Sampling: the first tokens' distribution
matches plain decoding (two-sample chi-square over many seeded requests). Rejected drafts leave
nothing behind: every block free, preemption mid-speculation loses nothing, limits hold. n > 1:
each sequence drafts and rolls back on its own next to siblings sharing its prompt blocks.
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter

import pytest
from hf_reference import assert_same_tokens_and_scores
from spec_checks import (
    assert_logprobs_recomputed,
    assert_plain_through_preemption,
    run_engine,
    spec_prompts,
    tokens_and_logprobs,
)

from paged_engine import LLM, BeamSearchParams, SamplingParams
from paged_engine.spec_decode.ngram_proposer import propose_ngram
from paged_engine.spec_decode.planner import DraftPlanner
from paged_engine.testing import SUPPORTED_TINY_ARCHS, write_tiny_model

pytestmark = pytest.mark.usefixtures("no_isolated_step_failures")  # conftest.py

pytest.importorskip("transformers")


def _spec(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4}


@pytest.fixture(scope="module", params=SUPPORTED_TINY_ARCHS)
def arch_model(request, tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=1)
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=2, ignore_eos=True)
    plain, _ = run_engine(path, spec_prompts(), params)
    return path, params, tokens_and_logprobs(plain)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_is_token_identical_with_drafts_accepted(arch_model, k):
    path, params, want = arch_model
    outs, stats = run_engine(path, spec_prompts(), params, speculative_config=_spec(k))
    got = tokens_and_logprobs(outs)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, g), (_, w) in zip(got, want):
        assert g == pytest.approx(w, abs=1e-4)
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens > 0  # the accepting path ran too
    assert stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    _assert_spec_stats_consistent(stats, k)


def _assert_spec_stats_consistent(stats, k: int) -> None:
    """The per-position counts and the derived figures agree with the three totals."""
    drafts, accepted = stats.spec_decode_num_drafts, stats.spec_decode_num_accepted_tokens
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert len(per_pos) == k and sum(per_pos) == accepted
    assert drafts >= per_pos[0] and per_pos == sorted(per_pos, reverse=True)
    rate = stats.spec_decode_acceptance_rate
    assert rate == pytest.approx(accepted / stats.spec_decode_num_draft_tokens)
    assert stats.spec_decode_mean_acceptance_length == pytest.approx(1 + accepted / drafts)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=1)


def _chi_square_same(a: Counter, b: Counter) -> tuple[float, float]:
    """Two-sample chi-square statistic (equal sample sizes) and the 0.1% critical value
    (Wilson-Hilferty), over bins with at least 10 pooled samples (the rest pooled)."""
    keys = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]
    rest_a = sum(a.values()) - sum(a[t] for t in keys)
    rest_b = sum(b.values()) - sum(b[t] for t in keys)
    pairs = [(a[t], b[t]) for t in keys] + ([(rest_a, rest_b)] if rest_a + rest_b else [])
    stat = sum((x - y) ** 2 / (x + y) for x, y in pairs)
    df = len(pairs) - 1
    z = 3.09  # one-sided 0.1%
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, critical


def test_sampling_distribution_matches_plain_decoding(llama):
    """Seeded temperature-0.5 requests on a prompt that repeats the model's greedy text, with
    unigram lookup (so nearly every decode step drafts, and drafts get both accepted and
    rejected): the first three tokens' marginals match plain sampling."""
    num = 1500
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    (seed_out,), _ = run_engine(llama, [{"prompt_token_ids": [5, 6, 7, 8]}], greedy)
    text = [5, 6, 7, 8, *seed_out.outputs[0].token_ids]
    prompt = {"prompt_token_ids": text + text[:16]}
    params = [
        SamplingParams(temperature=0.5, seed=s, max_tokens=5, ignore_eos=True) for s in range(num)
    ]
    plain, _ = run_engine(llama, [prompt] * num, params)
    config = {**_spec(3), "prompt_lookup_min": 1}
    spec, stats = run_engine(llama, [prompt] * num, params, speculative_config=config)
    assert stats.spec_decode_num_drafts > num // 10
    accepted, drafted = stats.spec_decode_num_accepted_tokens, stats.spec_decode_num_draft_tokens
    assert 0 < accepted < drafted
    for pos in range(5):
        a = Counter(o.outputs[0].token_ids[pos] for o in plain)
        b = Counter(o.outputs[0].token_ids[pos] for o in spec)
        stat, critical = _chi_square_same(a, b)
        assert stat < critical, (pos, stat, critical, a.most_common(5), b.most_common(5))


def test_preemption_limits_and_stops_under_speculation(llama):
    """spec_checks' preemption / stop / max_tokens case under n-gram lookup."""
    assert_plain_through_preemption(llama, _spec(5))


def test_n_greater_than_one_greedy_every_sequence_speculates(llama):
    """Greedy n = 3: each sequence drafts over its own tokens and is verified on its own (three
    times the proposals of n = 1, whose tokens they repeat), and gives plain greedy decoding's
    tokens and logprobs."""
    one = SamplingParams(temperature=0, max_tokens=30, logprobs=1, ignore_eos=True)
    three = SamplingParams(temperature=0, n=3, max_tokens=30, logprobs=1, ignore_eos=True)
    plain, _ = run_engine(llama, spec_prompts(), one)
    _, single = run_engine(llama, spec_prompts(), one, speculative_config=_spec(3))
    spec, stats = run_engine(llama, spec_prompts(), three, speculative_config=_spec(3))
    assert stats.spec_decode_num_drafts == 3 * single.spec_decode_num_drafts > 0
    assert stats.spec_decode_num_accepted_tokens == 3 * single.spec_decode_num_accepted_tokens > 0
    want = tokens_and_logprobs(plain)
    for o, (tokens, lps) in zip(spec, want):
        assert len(o.outputs) == 3
        for got_tokens, got_lps in tokens_and_logprobs([o]):
            assert got_tokens == tokens
            assert got_lps == pytest.approx(lps, abs=1e-4)


def _own_text_prompts(path, starts: list[list[int]]) -> list[dict]:
    """Each start and the model's greedy text after it: where that text falls into a loop,
    n-gram lookup predicts the continuation (long accepted runs)."""
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs, _ = run_engine(path, [{"prompt_token_ids": s} for s in starts], greedy)
    return [{"prompt_token_ids": s + list(o.outputs[0].token_ids)} for s, o in zip(starts, outs)]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_n_greater_than_one_through_preemption(llama, mode):
    """Only n > 1 requests (greedy n = 2; seeded temperature-0.5 n = 3, whose sequences
    diverge) on a pool too small for them: preempted mid-speculation (recomputed and shared
    again, or swapped out and in) while every sequence drafts and rolls back on its own next to
    siblings that share its prompt blocks copy-on-write. Greedy sequences give plain greedy
    decoding's outputs; every sampled token's logprob is the target's on the sequence
    recomputed from scratch; max_tokens holds; every block free (checked by _run)."""
    starts = [[333, 4], [40, 41, 42], [12, 13], [9, 250, 31, 77], [5, 6, 7, 8], [100, 7, 300]]
    prompts = _own_text_prompts(llama, starts)
    rng = random.Random(7)
    greedy, sampled = [], []
    params = []
    for i in range(len(prompts)):
        common = {"max_tokens": rng.randint(12, 24), "logprobs": 0, "ignore_eos": True}
        if i % 2:
            params.append(SamplingParams(temperature=0.5, n=3, seed=i, **common))
            sampled.append(i)
        else:
            params.append(SamplingParams(temperature=0, n=2, **common))
            greedy.append(i)
    config = {**_spec(4), "prompt_lookup_min": 1}
    kwargs = {"num_gpu_blocks_override": 24, "max_num_seqs": 12, "max_model_len": 96}
    kwargs |= {"preemption_mode": mode, "swap_space": 0.05}
    spec, stats = run_engine(llama, prompts, params, speculative_config=config, **kwargs)
    assert stats.num_preemptions > 0
    assert (stats.num_swap_preemptions > 0) == (mode == "swap")
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
    assert sum(len({tuple(c.token_ids) for c in o.outputs}) > 1 for o in rows) >= 2
    assert_logprobs_recomputed(llama, rows)


def test_tensor_parallel_speculation_matches(llama):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain, _ = run_engine(llama, spec_prompts(), params)
    spec, stats = run_engine(
        llama, spec_prompts(), params, speculative_config=_spec(3), tensor_parallel_size=2
    )
    assert stats.spec_decode_num_accepted_tokens > 0
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]


def test_beam_search_runs_without_drafts_beside_speculating_requests(llama):
    """Beams (either spelling) in the same steps as drafted rows: the plain engine's beams."""
    repetitive = spec_prompts()[:2]
    beam = SamplingParams(n=3, use_beam_search=True, max_tokens=12, temperature=0)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [*repetitive, *repetitive, {"prompt_token_ids": [11, 12, 13]}]
    params = [beam, BeamSearchParams(beam_width=2, max_tokens=10), greedy, greedy, beam]
    plain, _ = run_engine(llama, prompts, params)
    spec, stats = run_engine(llama, prompts, params, speculative_config=_spec(3))
    assert stats.spec_decode_num_drafts > 0
    assert_same_tokens_and_scores(plain, spec)


def test_what_speculation_refuses(llama):
    llm = LLM(model=str(llama), max_model_len=64, speculative_config=_spec(2))
    # n = 2 with a penalty: the fan-out row drafts nothing, each sequence drafts after it
    params = SamplingParams(n=2, max_tokens=3, seed=1, presence_penalty=0.5)
    out = llm.generate(["hi"], params, use_tqdm=False)
    assert len(out[0].outputs) == 2
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(model=str(llama), speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="unknown key"):
        LLM(model=str(llama), speculative_config={"num_speculative_tokens": 2, "lookahead": 1})
    with pytest.raises(ValueError, match="method 'dflash' is not supported"):
        LLM(model=str(llama), speculative_config={"method": "dflash", "num_speculative_tokens": 2})


def test_ngram_proposals():
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], 3, 2, 4) == [4, 1, 2]
    assert propose_ngram([1, 2, 3, 4, 5], 3, 2, 4) == []
    assert propose_ngram([9, 1, 2, 7, 1, 2, 8, 1, 2], 2, 2, 2) == [8, 1]  # the latest match
    assert propose_ngram([1, 2, 3, 9, 2, 3, 4, 1, 2, 3], 1, 2, 3) == [9]  # the longest n
    assert propose_ngram([256, 1, 2, 1], 3, 1, 1) == [2, 1]
    assert propose_ngram([1, 1], 4, 1, 1) == [1]  # never past the end


def test_ngram_over_a_token_buffer_proposes_as_over_the_list():
    """The planner keeps each sequence's tokens in a TokenBuffer, appended step by step
    (converting the list every step cost ~50 us of a ~60 us proposal at 1.5k tokens): the
    buffer's drafts are the list's, through growth past its capacity and a rebuild when the
    last token it holds changes."""
    import random

    from paged_engine.spec_decode.ngram_proposer import TokenBuffer

    rng = random.Random(0)
    buffer, tokens = TokenBuffer(), []
    for step in range(400):
        if step == 200:  # the last token synced replaced (a rollback): rebuilt
            tokens[-1] = (tokens[-1] + 1) % 6
        tokens += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        buffer.sync(tokens)
        assert buffer.buf[: buffer.num].tolist() == tokens
        for n_min, n_max in ((1, 1), (2, 4)):
            want = propose_ngram(tokens, 5, n_min, n_max)
            assert propose_ngram(buffer.buf[: buffer.num], 5, n_min, n_max) == want


def test_planner_backs_off_when_drafts_keep_failing():
    from paged_engine.core.request import Request
    from paged_engine.spec_decode.config import SpeculativeConfig

    planner = DraftPlanner(SpeculativeConfig.from_dict(_spec(3)), max_model_len=100)
    req = Request("r", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=50))
    seq = req.seqs[0]
    proposals = 0
    for _ in range(64):
        planner.next_step()
        if planner.drafts(req, seq, budget=10):
            proposals += 1
            planner.feedback(seq, 3, 0)
    assert 3 <= proposals <= 8  # 1, 2, 4, 8, ... steps of pause
    planner.feedback(seq, 3, 2)  # an accepted token resets it
    planner.next_step()
    assert planner.drafts(req, seq, budget=10)
    assert planner.drafts(req, seq, budget=0) == []
    short = Request("s", [1, 2, 1, 2], SamplingParams(max_tokens=1))
    assert planner.drafts(short, short.seqs[0], budget=10) == []  # max_tokens leaves no room


def test_planner_drafts_each_sequence_of_n_on_its_own():
    """n = 2: the row whose sample fans out drafts nothing; after the fork each sequence
    drafts over its own tokens, and one sequence's failed proposals pause only itself."""
    from paged_engine.core.request import Request, next_seq_id
    from paged_engine.spec_decode.config import SpeculativeConfig

    planner = DraftPlanner(SpeculativeConfig.from_dict(_spec(3)), max_model_len=100)
    req = Request("r", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(n=2, max_tokens=50))
    first = req.seqs[0]
    planner.next_step()
    assert planner.drafts(req, first, budget=10) == []  # its sample becomes both first tokens
    first.token_ids.append(3)
    second = first.fork(next_seq_id(), index=1)
    req.seqs.append(second)
    second.token_ids[-1] = 9
    assert planner.drafts(req, first, budget=10) == [1, 2, 3]
    assert planner.drafts(req, second, budget=10) == []  # "2 9" never occurred
    second.token_ids += [1, 2]
    assert planner.drafts(req, second, budget=10) == [9, 1, 2]  # its own latest "1 2"
    planner.feedback(first, 3, 0)  # pauses it for this step
    assert planner.drafts(req, first, budget=10) == []
    assert planner.drafts(req, second, budget=10) == [9, 1, 2]
    planner.forget(req)
    assert planner.drafts(req, first, budget=10) == [1, 2, 3]


def test_stop_strings_inside_accepted_drafts(llama):
    """A stop string that ends inside a step's emitted tokens: the same text and finish as
    plain decoding (the output stage cuts the text; the core frees the sequence)."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain, _ = run_engine(llama, spec_prompts(), params)
    stops = []
    for i, o in enumerate(plain):  # every other request stops 3/4 of the way in
        text, at = o.outputs[0].text, 3 * len(o.outputs[0].text) // 4
        stops.append([text[at : at + 3]] if i % 2 and len(text) > 8 else None)
    with_stops = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=s) for s in stops
    ]
    want, _ = run_engine(llama, spec_prompts(), with_stops)
    got, stats = run_engine(llama, spec_prompts(), with_stops, speculative_config=_spec(5))
    assert stats.spec_decode_num_accepted_tokens > 0
    assert [(o.outputs[0].text, o.outputs[0].finish_reason) for o in got] == [
        (o.outputs[0].text, o.outputs[0].finish_reason) for o in want
    ]


def test_constrained_rows_run_beside_speculating_ones(llama):
    """Structured-output requests beside unconstrained ones in the speculative engine's steps
    (they draft only what their grammar allows: test_spec_structured.py): their text matches
    the plain engine's and its constraint, while the unconstrained rows keep speculating."""
    pytest.importorskip("llguidance")
    from paged_engine import StructuredOutputsParams

    free = SamplingParams(temperature=0, max_tokens=24, logprobs=1, ignore_eos=True)
    regex = SamplingParams(
        temperature=0,
        max_tokens=24,
        logprobs=1,
        structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3}-[0-9]{2}"),
    )
    prompts = spec_prompts()
    params = [regex if i % 2 else free for i in range(len(prompts))]
    plain, _ = run_engine(llama, prompts, params)
    spec, stats = run_engine(llama, prompts, params, speculative_config=_spec(3))
    got, want = tokens_and_logprobs(spec), tokens_and_logprobs(plain)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, g), (_, w) in zip(got, want):
        assert g == pytest.approx(w, abs=1e-4)
    for out, p in zip(spec, params):
        if p is regex:
            assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", out.outputs[0].text)
    assert stats.spec_decode_num_draft_tokens > 0


def test_draft_count_by_batch_size(llama):
    """num_speculative_tokens_per_batch_size (vLLM's): rows draft up to 3 while 1-2 requests
    run and not at all from 3 on; "ngram_gpu" is vLLM's GPU n-gram proposer's name."""
    prompts = spec_prompts()[:4]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    config = {
        **_spec(3),
        "method": "ngram_gpu",
        "prompt_lookup_min": 1,
        "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 64, 0]],
    }
    plain, _ = run_engine(llama, prompts, params)
    few, few_stats = run_engine(llama, prompts[:2], params, speculative_config=config)
    many, many_stats = run_engine(llama, prompts, params, speculative_config=config)
    assert few_stats.spec_decode_num_drafts > 0
    assert many_stats.spec_decode_num_drafts == 0  # four requests run throughout
    assert [o.outputs[0].token_ids for o in many] == [o.outputs[0].token_ids for o in plain]
    assert [o.outputs[0].token_ids for o in few] == [o.outputs[0].token_ids for o in plain[:2]]
    for bad in ([[0, 2, 3]], [[3, 2, 1]], [[1, 2, 4]], [[1, 2]], "1-2:3"):
        with pytest.raises(ValueError, match="num_speculative_tokens_per_batch_size"):
            LLM(
                model=str(llama),
                speculative_config={**_spec(3), "num_speculative_tokens_per_batch_size": bad},
            )
