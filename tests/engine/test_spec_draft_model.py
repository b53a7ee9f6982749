"""Speculative decoding with a draft model: exact in distribution.

Greedy: token-identical to plain decoding (logprobs within 1e-4) for every tiny architecture and
k in {1, 3, 5}, with a draft that agrees often (the target's weights plus noise: drafts accepted
and rejected) and with an unrelated smaller draft. Sampling: the rejection rule with q != p keeps
the target's distribution (directly on the verifier, and through the engine by chi-square).
Nothing leaks: every block free, preemption mid-speculation and chunked prefill lose nothing.
"""

from __future__ import annotations

import math
import random
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_reference import assert_same_tokens_and_scores
from spec_checks import run_engine, spec_prompts, tokens_and_logprobs

from paged_engine import LLM, BeamSearchParams, SamplingParams
from paged_engine.spec_decode.rejection_sampler import verify
from paged_engine.testing import SUPPORTED_TINY_ARCHS, write_tiny_model

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.usefixtures("no_isolated_step_failures")  # conftest.py


def _chi_square_same(a: Counter, b: Counter) -> tuple[float, float]:
    """Two-sample chi-square statistic (equal sample sizes) and the 0.1% critical value
    (Wilson-Hilferty), over bins with at least 10 pooled samples (the rest pooled)."""
    keys = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]
    rest_a = sum(a.values()) - sum(a[t] for t in keys)
    rest_b = sum(b.values()) - sum(b[t] for t in keys)
    pairs = [(a[t], b[t]) for t in keys] + ([(rest_a, rest_b)] if rest_a + rest_b else [])
    stat = sum((x - y) ** 2 / (x + y) for x, y in pairs)
    df = len(pairs) - 1
    critical = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3  # one-sided 0.1%
    return stat, critical


def assert_same_marginals(plain, spec, positions: int) -> None:
    """Each of the first `positions` output tokens has the same marginal in both runs (the
    two-sample chi-square at 0.1%)."""
    for pos in range(positions):
        a = Counter(o.outputs[0].token_ids[pos] for o in plain)
        b = Counter(o.outputs[0].token_ids[pos] for o in spec)
        stat, critical = _chi_square_same(a, b)
        assert stat < critical, (pos, stat, critical, a.most_common(5), b.most_common(5))


def _spec(draft: Path, k: int) -> dict:
    return {"model": str(draft), "num_speculative_tokens": k}


def noisy_copy(target: Path, dest: Path, scale: float, seed: int = 0) -> Path:
    """The target's directory with every weight plus Gaussian noise of `scale` times that
    tensor's standard deviation: a draft that agrees with the target most of the time."""
    shutil.copytree(target, dest)
    gen = torch.Generator().manual_seed(seed)
    weights = load_file(target / "model.safetensors")
    for name, t in weights.items():
        if t.is_floating_point() and t.numel() > 1:
            noise = torch.randn(t.shape, generator=gen, dtype=t.dtype)
            weights[name] = (t + scale * t.std() * noise).contiguous()
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def small_draft(target: Path, dest: Path, arch: str) -> Path:
    """An unrelated draft of the same architecture and vocabulary: one layer, half the width,
    other weights; the target's tokenizer."""
    small = {"num_hidden_layers": 1, "hidden_size": 32}
    if arch == "gpt2":
        small = {"n_layer": 1, "n_embd": 32}
    elif arch == "opt":
        small["word_embed_proj_dim"] = 32
    elif arch == "qwen3":
        small["head_dim"] = 16
    write_tiny_model(dest, arch, seed=7, **small)
    for f in target.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, dest / f.name)
    return dest


def _assert_same(got, want):
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, g), (_, w) in zip(got, want):
        assert g == pytest.approx(w, abs=1e-4)


@pytest.fixture(scope="module", params=SUPPORTED_TINY_ARCHS)
def arch_models(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    target = write_tiny_model(root / "target", arch, seed=1)
    noisy = noisy_copy(target, root / "noisy", scale=0.05)
    small = small_draft(target, root / "small", arch)
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2, ignore_eos=True)
    plain, _ = run_engine(target, spec_prompts(), params)
    return target, noisy, small, params, tokens_and_logprobs(plain)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_is_token_identical_with_a_close_draft(arch_models, k):
    target, noisy, _, params, want = arch_models
    outs, stats = run_engine(target, spec_prompts(), params, speculative_config=_spec(noisy, k))
    _assert_same(tokens_and_logprobs(outs), want)
    accepted, drafted = stats.spec_decode_num_accepted_tokens, stats.spec_decode_num_draft_tokens
    assert drafted // 4 < accepted <= drafted
    if k == 5:
        assert accepted < drafted  # rejections rolled back too


def test_greedy_with_the_target_as_its_own_draft(arch_models):
    """Every draft accepted: each step leaves the last draft for the draft model to run first
    next step (its lag token); a wrong draft cache would show as a rejection."""
    target, _, _, params, want = arch_models
    outs, stats = run_engine(target, spec_prompts(), params, speculative_config=_spec(target, 5))
    _assert_same(tokens_and_logprobs(outs), want)
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0


def test_metrics_when_the_target_is_its_own_draft(llama):
    """Every draft accepted, and 25 = 1 + 6 x (3 + 1) tokens: each row proposes the full k = 3
    (none cut short by max_tokens), so the rate is 1, the mean acceptance length k + 1, and
    every position accepted once per proposal."""
    target, _ = llama
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    _, stats = run_engine(target, spec_prompts(), params, speculative_config=_spec(target, 3))
    drafts = stats.spec_decode_num_drafts
    assert drafts == 6 * len(spec_prompts())
    assert stats.spec_decode_num_draft_tokens == stats.spec_decode_num_accepted_tokens == 3 * drafts
    assert stats.spec_decode_num_accepted_tokens_per_pos == [drafts] * 3
    assert stats.spec_decode_acceptance_rate == 1.0
    assert stats.spec_decode_mean_acceptance_length == 4.0


def test_greedy_is_token_identical_with_an_unrelated_draft(arch_models):
    target, _, small, params, want = arch_models
    outs, stats = run_engine(target, spec_prompts(), params, speculative_config=_spec(small, 3))
    _assert_same(tokens_and_logprobs(outs), want)
    assert stats.spec_decode_num_draft_tokens > 0


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama_draft")
    target = write_tiny_model(root / "target", "llama", seed=1)
    return target, noisy_copy(target, root / "noisy", scale=0.3)


def test_rejection_rule_keeps_the_target_distribution():
    """verify() with a draft drawn from q != p: the emitted token's distribution is p (greedy
    rows: the argmax, whatever the draft)."""
    torch.manual_seed(0)
    num, vocab = 40000, 6
    p = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15, 0.0])
    q = torch.tensor([0.3, 0.1, 0.3, 0.1, 0.1, 0.1])
    drafts = torch.multinomial(q, num, replacement=True)
    # Entry i owns rows 2i (judges its draft) and 2i + 1 (bonus).
    processed = p.log().expand(2 * num, vocab).clone()
    draft_rows = torch.full((2 * num,), -1, dtype=torch.int64)
    draft_rows[0::2] = drafts
    q_rows = torch.zeros(2 * num, vocab)
    q_rows[0::2] = q
    noise = torch.empty(2 * num, vocab).exponential_()
    greedy = torch.zeros(2 * num, dtype=torch.bool)
    result = verify(processed, draft_rows, greedy, noise, np.ones(num, np.int64), q_rows)
    first = result.tokens[0::2]
    freq = torch.bincount(first, minlength=vocab).float() / num
    assert freq.tolist() == pytest.approx(p.tolist(), abs=0.012)
    accept_rate = float((torch.from_numpy(result.num_accepted) == 1).float().mean())
    assert accept_rate == pytest.approx(float(torch.minimum(p, q).sum()), abs=0.012)
    result = verify(processed, draft_rows, ~greedy, noise, np.ones(num, np.int64), q_rows)
    assert set(result.tokens[0::2].tolist()) == {1}


def test_sampling_distribution_matches_plain_decoding(llama):
    """Seeded temperature-0.8 requests with a noisy draft (q != p, accepted and rejected): the
    first four tokens' marginals match plain sampling (two-sample chi-square)."""
    target, noisy = llama
    num = 1000
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9, 10]}
    params = [
        SamplingParams(temperature=0.8, seed=s, max_tokens=4, ignore_eos=True) for s in range(num)
    ]
    plain, _ = run_engine(target, [prompt] * num, params)
    spec, stats = run_engine(target, [prompt] * num, params, speculative_config=_spec(noisy, 3))
    accepted, drafted = stats.spec_decode_num_accepted_tokens, stats.spec_decode_num_draft_tokens
    assert 0 < accepted < drafted
    assert_same_marginals(plain, spec, 4)
    # Seeded rows are reproducible under speculation too.
    again, _ = run_engine(target, [prompt] * 8, params[:8], speculative_config=_spec(noisy, 3))
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in spec[:8]]


def test_preemption_chunked_prefill_mixed_batch_and_limits(llama):
    """A pool too small for the batch (preemption mid-speculation: both caches recomputed),
    chunked prefill of long prompts next to speculating rows (n > 1 too), penalized rows (their
    histories dropped and rebuilt with their drafts), stop tokens inside accepted drafts,
    max_tokens: plain's outputs."""
    target, noisy = llama
    rng = random.Random(5)
    prompts = spec_prompts(3) * 2 + [
        {"prompt_token_ids": [rng.randrange(3, 400) for _ in range(90)]}
    ]
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=rng.randint(5, 30),
            stop_token_ids=[rng.randrange(3, 400)] if i % 3 == 0 else None,
            logprobs=1,
        )
        for i in range(len(prompts))
    ]
    params[1] = SamplingParams(temperature=0, n=2, max_tokens=12, logprobs=1)
    params[2] = SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=12, logprobs=1)
    params[4] = SamplingParams(
        temperature=0, n=2, frequency_penalty=0.4, presence_penalty=0.2, max_tokens=16, logprobs=1
    )
    kwargs = {
        "num_gpu_blocks_override": 20,
        "max_num_seqs": 8,
        "max_model_len": 128,
        "max_num_batched_tokens": 32,
        "enable_chunked_prefill": True,
    }
    plain, _ = run_engine(target, prompts, params, **kwargs)
    spec, stats = run_engine(target, prompts, params, speculative_config=_spec(noisy, 4), **kwargs)
    assert stats.num_preemptions > 0
    assert stats.spec_decode_num_accepted_tokens > 0
    _assert_same(tokens_and_logprobs(spec), tokens_and_logprobs(plain))
    for o, p, ref in zip(spec, params, plain):
        assert all(len(c.token_ids) <= p.max_tokens for c in o.outputs)
        assert [c.finish_reason for c in o.outputs] == [c.finish_reason for c in ref.outputs]


def test_n_greater_than_one_every_sequence_drafts(llama):
    """n > 1 with a draft model, on a pool too small for the batch: forked sequences share the
    prompt's blocks in both caches (copy-on-write copies both), each drafts with its own draft
    state and rolls back on its own, and preemption recomputes both caches. Greedy n = 2 gives
    plain greedy decoding's outputs; seeded temperature-0.8 n = 3 sequences diverge, and each of
    their tokens' logprobs is the target's on the sequence recomputed from scratch."""
    target, noisy = llama
    prompts = spec_prompts(4)
    rng = random.Random(3)
    params = [
        SamplingParams(
            temperature=0.8 if i % 2 else 0,
            n=3 if i % 2 else 2,
            seed=i,
            max_tokens=rng.randint(10, 20),
            logprobs=0,
            ignore_eos=True,
        )
        for i in range(len(prompts))
    ]
    kwargs = {"num_gpu_blocks_override": 24, "max_num_seqs": 12, "max_model_len": 96}
    spec, stats = run_engine(target, prompts, params, speculative_config=_spec(noisy, 3), **kwargs)
    assert stats.num_preemptions > 0
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    one = [
        SamplingParams(temperature=0, max_tokens=p.max_tokens, logprobs=0, ignore_eos=True)
        for p in params[::2]
    ]
    plain, _ = run_engine(target, prompts[::2], one)
    for o, ref in zip(spec[::2], plain):
        for got in tokens_and_logprobs([o]):
            _assert_same([got], tokens_and_logprobs([ref]))
    sampled = spec[1::2]
    assert sum(len({tuple(c.token_ids) for c in o.outputs}) > 1 for o in sampled) >= 2
    recompute = [
        {"prompt_token_ids": list(o.prompt_token_ids) + list(c.token_ids)}
        for o in sampled
        for c in o.outputs
    ]
    again, _ = run_engine(target, recompute, SamplingParams(max_tokens=1, prompt_logprobs=0))
    recorded = [lps for _, lps in tokens_and_logprobs(sampled)]
    for r, got in zip(again, recorded):
        ids, plp = r.prompt_token_ids, r.prompt_logprobs
        want = [plp[i][ids[i]].logprob for i in range(len(ids) - len(got), len(ids))]
        assert got == pytest.approx(want, abs=1e-4)


def test_draft_model_refusals(llama, tmp_path):
    target, _ = llama
    other_vocab = write_tiny_model(tmp_path / "v", "llama", seed=1, vocab_size=640)
    with pytest.raises(ValueError, match=r"speculative_config\.model=.*vocab_size 640"):
        LLM(model=str(target), speculative_config=_spec(other_vocab, 2))
    short = write_tiny_model(tmp_path / "s", "llama", seed=1, max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"speculative_config\.model=.*maximum context length"):
        LLM(model=str(target), max_model_len=128, speculative_config=_spec(short, 2))
    other_tok = write_tiny_model(tmp_path / "t", "llama", seed=3)
    with pytest.raises(ValueError, match=r"speculative_config\.model=.*tokenizer"):
        LLM(model=str(target), speculative_config=_spec(other_tok, 2))
    with pytest.raises(ValueError, match=r"speculative_config\.model=.*cannot load"):
        LLM(model=str(target), speculative_config=_spec(tmp_path / "missing", 2))


def test_tensor_parallel_draft_model_matches(llama):
    """TP = 2 (two processes, gloo): the draft runs sharded like the target on every rank, each
    rank samples the same drafts and verifies them alike; greedy tokens and sampled seeded
    tokens equal the single-process speculative engine's, with the same acceptance."""
    target, noisy = llama
    prompts = spec_prompts()[:4]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True)
    params = [greedy, sampled] * 2
    one, one_stats = run_engine(target, prompts, params, speculative_config=_spec(noisy, 3))
    two, two_stats = run_engine(
        target, prompts, params, speculative_config=_spec(noisy, 3), tensor_parallel_size=2
    )
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
    assert two_stats.spec_decode_num_accepted_tokens == one_stats.spec_decode_num_accepted_tokens
    assert one_stats.spec_decode_num_accepted_tokens > 0


def test_beam_search_runs_without_drafts_beside_drafted_requests(llama):
    """Beams (either spelling) in the same steps as rows the draft model drafts for: the plain
    engine's beams and scores; every block back in the pool."""
    target, noisy = llama
    repetitive = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 6}, {"prompt_token_ids": [40, 41] * 9}]
    beam = SamplingParams(n=3, use_beam_search=True, max_tokens=12, temperature=0)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [*repetitive, *repetitive, {"prompt_token_ids": [11, 12, 13]}]
    params = [beam, BeamSearchParams(beam_width=2, max_tokens=10), greedy, greedy, beam]
    plain, _ = run_engine(target, prompts, params)
    spec, stats = run_engine(target, prompts, params, speculative_config=_spec(noisy, 2))
    assert stats.spec_decode_num_drafts > 0
    assert_same_tokens_and_scores(plain, spec)


def test_vllm_speculative_config_keys(llama, tmp_path, monkeypatch):
    """vLLM's other keys: the draft resolved at `revision` through the engine's download_dir
    and hf_token (as the target is), draft_tensor_parallel_size 1 (vLLM's EAGLE example),
    the knobs that change no token, and what is refused by name."""
    import paged_engine.spec_decode.head_loader as head_loader
    from paged_engine.spec_decode.config import SpeculativeConfig

    target, noisy = llama
    calls = []
    resolve = head_loader.resolve_model

    def recording(name, revision=None, download_dir=None, weights=True, token=None):
        calls.append((str(name), revision, download_dir, token))
        return resolve(name, revision, download_dir, weights, token)

    monkeypatch.setattr(head_loader, "resolve_model", recording)
    spec = {
        **_spec(noisy, 3),
        "revision": "v1",
        "code_revision": "v1",
        "draft_tensor_parallel_size": 1,
        "max_model_len": 256,
        "enforce_eager": True,
        "disable_padded_drafter_batch": False,
        "rejection_sample_method": "standard",
    }
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain, _ = run_engine(target, spec_prompts()[:3], params)
    got, stats = run_engine(
        target,
        spec_prompts()[:3],
        params,
        speculative_config=spec,
        download_dir=str(tmp_path / "hub"),
        hf_token="hf_x",
    )
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert stats.spec_decode_num_accepted_tokens > 0
    drafts = [c for c in calls if c[0] == str(noisy)]
    assert drafts and all(c[1:] == ("v1", str(tmp_path / "hub"), "hf_x") for c in drafts)
    refused = [
        ({"tensor_parallel_size": 1}, "draft_tensor_parallel_size"),
        ({"revision": "a", "code_revision": "b"}, "code_revision differs"),
        ({"rejection_sample_method": "block"}, "'standard'"),
        ({"draft_sample_method": "top"}, "draft_sample_method"),
        ({"enforce_eager": "yes"}, "enforce_eager must be a bool"),
    ]
    for extra, needle in refused:
        with pytest.raises(ValueError, match=needle):
            SpeculativeConfig.from_dict({**_spec(noisy, 3), **extra})
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=2 must be 1 or"):
        LLM(
            model=str(target),
            speculative_config={**_spec(noisy, 2), "draft_tensor_parallel_size": 2},
        )
    with pytest.raises(ValueError, match=r"speculative_config.max_model_len=64 is below"):
        run_engine(target, [], params, speculative_config={**_spec(noisy, 2), "max_model_len": 64})


def test_greedy_draft_sampling_keeps_the_distribution(llama, monkeypatch):
    """draft_sample_method="greedy" (vLLM's default): the draft's argmax, verified as a point
    mass (no q); seeded temperature-0.8 marginals match plain sampling, greedy rows plain's
    tokens."""
    from paged_engine.spec_decode.draft_model import DraftModelRunner

    target, noisy = llama
    with_q = []
    propose = DraftModelRunner.propose

    def recording(self, *args):
        proposal = propose(self, *args)
        with_q.append(proposal.probs is not None)
        return proposal

    monkeypatch.setattr(DraftModelRunner, "propose", recording)
    num = 1000
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9, 10]}
    params = [
        SamplingParams(temperature=0.8, seed=s, max_tokens=4, ignore_eos=True) for s in range(num)
    ]
    spec = {**_spec(noisy, 3), "draft_sample_method": "greedy"}
    plain, _ = run_engine(target, [prompt] * num, params)
    got, stats = run_engine(target, [prompt] * num, params, speculative_config=spec)
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert with_q and not any(with_q)
    assert_same_marginals(plain, got, 4)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want, _ = run_engine(target, spec_prompts(), greedy)
    again, _ = run_engine(target, spec_prompts(), greedy, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in want]
