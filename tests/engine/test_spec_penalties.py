"""Speculative decoding of rows with repetition / frequency / presence penalties.

Draft j of a penalized row is judged (and, by a draft model, drawn) with drafts 0..j-1 counted
as outputs, so each position sees the history plain decoding gives it:

- greedy: token-identical to plain decoding, logprobs within 1e-4, with n-gram drafts and with
  a draft model (through preemption and chunked prefill: test_spec_draft_model.py); on a target
  that repeats its last token until the penalty outweighs its lead, the switch lands inside the
  drafts (a verification that missed earlier drafts would accept one too many);
- the target as its own draft: every penalized draft accepted, greedy and sampled (a draft
  drawn without its predecessors in the history would be rejected at the switches);
- sampled: each position's marginal matches plain sampling (chi-square), with n-gram drafts
  accepted and rejected.
"""

from __future__ import annotations

import random

import pytest
import torch

from paged_engine import SamplingParams
from paged_engine.testing import write_tiny_model

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file
from spec_checks import run_engine
from test_spec_draft_model import assert_same_marginals, noisy_copy

pytestmark = pytest.mark.usefixtures("no_isolated_step_failures")  # conftest.py

PENALTIES = [
    {"repetition_penalty": 1.3},
    {"frequency_penalty": 0.6},
    {"presence_penalty": 0.9},
    {"repetition_penalty": 1.1, "frequency_penalty": 0.3, "presence_penalty": 0.3},
]
REPETITIVE = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 6}, {"prompt_token_ids": [40, 41] * 9}]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_penalties")
    target = write_tiny_model(root / "target", "llama", seed=1)
    return target, noisy_copy(target, root / "close", scale=0.05)


@pytest.fixture(scope="module")
def repeating(tmp_path_factory):
    """A Llama whose layers add nothing (o_proj, down_proj zero) and whose head is a tenth of
    its embedding: it repeats its last token with a lead of 1-3 logits, so a frequency penalty
    moves it to another token after a few repeats (and that one repeats in turn)."""
    target = write_tiny_model(tmp_path_factory.mktemp("repeating") / "target", "llama", seed=1)
    w = load_file(target / "model.safetensors")
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = torch.zeros_like(w[name])
    w["model.norm.weight"] = torch.ones_like(w["model.norm.weight"])
    w["lm_head.weight"] = 0.1 * w["model.embed_tokens.weight"]
    save_file(w, target / "model.safetensors", metadata={"format": "pt"})
    return target


def _prompts(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    others = [
        {"prompt_token_ids": [rng.randrange(3, 400) for _ in range(rng.randint(1, 40))]}
        for _ in range(4)
    ]
    return REPETITIVE + others


def _greedy_params(n: int, max_tokens: int = 24) -> list[SamplingParams]:
    return [
        SamplingParams(
            temperature=0, max_tokens=max_tokens, logprobs=1, ignore_eos=True, **PENALTIES[i % 4]
        )
        for i in range(n)
    ]


def _assert_same(got, want):
    assert [[c.token_ids for c in o.outputs] for o in got] == [
        [c.token_ids for c in o.outputs] for o in want
    ]
    for o, w in zip(got, want):
        for c, d in zip(o.outputs, w.outputs):
            g = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]
            e = [lp[t].logprob for t, lp in zip(d.token_ids, d.logprobs)]
            assert g == pytest.approx(e, abs=1e-4)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_penalties_are_token_identical(models, repeating, method):
    """Every row penalized (four kinds of penalty), min_tokens on one: the plain engine's
    tokens and logprobs, with drafts proposed and accepted. n-gram lookup runs on the repeating
    target, whose penalized rows switch tokens inside the drafts."""
    target, close = models
    prompts = _prompts()
    params = _greedy_params(len(prompts))
    params[3] = SamplingParams(
        temperature=0, max_tokens=24, min_tokens=20, logprobs=1, presence_penalty=0.5
    )
    if method == "ngram":
        target = repeating
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    else:
        spec = {"model": str(close), "num_speculative_tokens": 4}
    plain, _ = run_engine(target, prompts, params)
    got, stats = run_engine(target, prompts, params, speculative_config=spec)
    _assert_same(got, plain)
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    if method == "ngram":  # the frequency-penalized rows moved on from their first token
        assert all(len(set(plain[i].outputs[0].token_ids)) > 2 for i in (1, 5))


def test_the_target_as_its_own_draft_has_every_penalized_draft_accepted(repeating):
    """q equals p at every position only if the draft's penalties count its earlier drafts as
    the verification does: greedy and seeded temperature-0.8 rows accept every draft, also
    where the penalty moves the repeating target to another token."""
    prompts = _prompts()
    greedy = _greedy_params(len(prompts))
    sampled = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True, **PENALTIES[i % 4])
        for i in range(len(prompts))
    ]
    plain, _ = run_engine(repeating, prompts, greedy)
    assert all(len(set(plain[i].outputs[0].token_ids)) > 2 for i in (1, 5))
    spec = {"model": str(repeating), "num_speculative_tokens": 4}
    got, stats = run_engine(repeating, prompts, greedy, speculative_config=spec)
    _assert_same(got, plain)
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    _, stats = run_engine(repeating, prompts, sampled, speculative_config=spec)
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0


def test_sampled_penalties_keep_the_distribution(repeating):
    """Seeded temperature-0.3 rows with a frequency and a presence penalty on the repeating
    target, which repeats a token until the penalties outweigh its lead; unigram lookup drafts
    it again (accepted and rejected): the first six tokens' marginals match plain sampling (a
    verification blind to the draft before it keeps the token ~20% too often at position 2)."""
    num = 1500
    prompt = {"prompt_token_ids": [9] * 12}
    params = [
        SamplingParams(
            temperature=0.3,
            seed=s,
            max_tokens=6,
            ignore_eos=True,
            frequency_penalty=0.4,
            presence_penalty=0.2,
        )
        for s in range(num)
    ]
    plain, _ = run_engine(repeating, [prompt] * num, params)
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    spec, stats = run_engine(repeating, [prompt] * num, params, speculative_config=config)
    assert stats.spec_decode_num_drafts > num // 10
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert_same_marginals(plain, spec, 6)


def test_tensor_parallel_penalized_drafts_match(models):
    """TP = 2 (two processes): penalized rows draft and verify alike on both ranks."""
    target, close = models
    prompts = _prompts()[:4]
    params = _greedy_params(4, max_tokens=16)
    params[1] = SamplingParams(
        temperature=0.8, seed=3, max_tokens=16, ignore_eos=True, repetition_penalty=1.2
    )
    spec = {"model": str(close), "num_speculative_tokens": 3}
    one, one_stats = run_engine(target, prompts, params, speculative_config=spec)
    two, two_stats = run_engine(
        target, prompts, params, speculative_config=spec, tensor_parallel_size=2
    )
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
    assert two_stats.spec_decode_num_accepted_tokens == one_stats.spec_decode_num_accepted_tokens
    assert one_stats.spec_decode_num_accepted_tokens > 0
