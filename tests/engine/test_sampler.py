"""Batched sampler against per-row references and sampling statistics."""

from __future__ import annotations

import pytest
import torch

from paged_engine.sample.sampler import (
    Sampler,
    SamplingRow,
    compute_prompt_logprobs,
    log_softmax_topk,
)
from paged_engine.sampling_params import SamplingParams

V = 64


def row(prompt=(), output=(), gen=None, eos=None, **kw) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), list(prompt), list(output), gen, eos)


def logits_for(n: int, device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, V, generator=g) * 3).to(device)


def test_greedy_is_argmax_and_input_untouched(device):
    x = logits_for(8, device)
    before = x.clone()
    out = Sampler()(x, [row(temperature=0.0) for _ in range(8)])
    assert out.sampled_token_ids == x.argmax(-1).tolist()
    assert torch.equal(x, before)
    assert Sampler.process_logits(x, [row(temperature=0.0)] * 8) is x  # nothing to do, no copy
    empty = Sampler()(x[:0], [])
    assert empty.sampled_token_ids == [] and empty.top_logprobs is None


@pytest.mark.parametrize("kw", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_degenerate_filters_are_greedy(device, kw):
    x = logits_for(16, device, seed=1)
    for _ in range(3):
        out = Sampler()(x, [row(temperature=1.3, **kw) for _ in range(16)])
        assert out.sampled_token_ids == x.argmax(-1).tolist()


def empirical(x_row: torch.Tensor, params: dict, n: int = 20000) -> torch.Tensor:
    torch.manual_seed(0)
    x = x_row.expand(n, -1).contiguous()
    toks = torch.tensor(Sampler()(x, [row(**params)] * n).sampled_token_ids)
    return torch.bincount(toks, minlength=x.shape[1]).double() / n


def test_temperature_top_k_top_p_min_p_distributions(device):
    x = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], device=device)
    tol = 0.015  # ~4 sigma for 20k samples
    p = torch.softmax(x.double().cpu() / 0.7, -1)
    assert (empirical(x, {"temperature": 0.7}) - p).abs().max() < tol
    top3 = torch.where(torch.arange(8) < 3, p, 0)
    assert (empirical(x, {"temperature": 0.7, "top_k": 3}) - top3 / top3.sum()).abs().max() < tol
    # top-p 0.8: keep the smallest prefix (by probability) whose mass reaches 0.8.
    keep = (p.cumsum(0) - p) < 0.8
    nucleus = torch.where(keep, p, 0)
    got = empirical(x, {"temperature": 0.7, "top_p": 0.8})
    assert (got - nucleus / nucleus.sum()).abs().max() < tol
    minp = torch.where(p >= 0.1 * p.max(), p, 0)
    got = empirical(x, {"temperature": 0.7, "min_p": 0.1})
    assert (got - minp / minp.sum()).abs().max() < tol


def naive_penalties(x: torch.Tensor, r: SamplingRow) -> torch.Tensor:
    x = x.clone()
    p = r.params
    for t in set(r.prompt_token_ids + r.output_token_ids):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(r.output_token_ids):
        x[t] -= p.frequency_penalty * r.output_token_ids.count(t) + p.presence_penalty
    return x


def test_logprobs_skipped_when_nobody_reads_them(device):
    x = logits_for(3, device)
    out = Sampler()(x, [row(temperature=0.0) for _ in range(3)])
    assert out.sampled_token_ids == x.argmax(-1).tolist()
    assert out.top_logprobs is None and all(lp != lp for lp in out.sampled_logprobs)  # NaN


def test_penalties_match_naive_reference(device):
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(12):
        prompt = torch.randint(0, V, (int(torch.randint(0, 20, (1,), generator=g)),), generator=g)
        output = torch.randint(0, V, (int(torch.randint(0, 30, (1,), generator=g)),), generator=g)
        kw = {
            "repetition_penalty": [1.0, 1.3, 0.8][i % 3],
            "frequency_penalty": [0.0, 0.5, -0.4, 1.1][i % 4],
            "presence_penalty": [0.0, 1.0][i % 2],
        }
        rows.append(row(prompt.tolist(), output.tolist(), temperature=0.0, logprobs=0, **kw))
    x = logits_for(12, device, seed=4)
    got = Sampler.process_logits(x, rows).cpu()
    want = torch.stack([naive_penalties(x[i].cpu(), r) for i, r in enumerate(rows)])
    torch.testing.assert_close(got, want)
    out = Sampler()(x, rows)
    assert out.sampled_token_ids == want.argmax(-1).tolist()
    # Logprobs stay those of the raw logits, whatever the penalties did.
    raw = torch.log_softmax(x.cpu(), -1)
    torch.testing.assert_close(
        torch.tensor(out.sampled_logprobs), raw[range(12), out.sampled_token_ids]
    )


def run_seeded(device, position: int, others: list[dict], steps: int = 8) -> list[int]:
    """Sample `steps` tokens for a seeded row placed at `position` among other rows."""
    gen = torch.Generator(device=device).manual_seed(1234)
    tokens = []
    for step in range(steps):
        rows = [row(**kw) for kw in others]
        rows.insert(position, row(output=tokens, gen=gen, temperature=0.9, top_p=0.95, seed=1234))
        x = logits_for(len(rows), device, seed=100 + step)  # seeded row's logits: position-free
        x[position] = logits_for(1, device, seed=step)[0]
        tokens.append(Sampler()(x, rows).sampled_token_ids[position])
    return tokens


def test_seeded_row_independent_of_batch(device):
    alone = run_seeded(device, 0, [])
    mixed = [{"temperature": 1.0}, {"temperature": 0.0}, {"top_k": 5, "seed": 7}, {"min_p": 0.3}]
    assert run_seeded(device, 2, mixed) == alone
    assert run_seeded(device, 4, mixed) == alone
    torch.manual_seed(99)  # the global RNG does not matter either
    assert run_seeded(device, 1, [{"temperature": 2.0, "frequency_penalty": 1.0}]) == alone
    assert len(set(alone)) > 1  # it really sampled


def test_min_tokens_masks_eos_and_stop_ids(device):
    x = torch.zeros(5, V, device=device)
    x[:, 5] = 50.0  # eos, overwhelmingly likely
    x[:, 6] = 40.0  # a stop token id
    x[:, 7] = 30.0  # a second eos id
    rows = [
        row(output=[1, 2], eos=5, temperature=0.0, min_tokens=4, stop_token_ids=[6]),
        row(output=[1, 2, 3, 4], eos=5, temperature=0.0, min_tokens=4, stop_token_ids=[6]),
        row(output=[], eos=5, min_tokens=2, ignore_eos=True, stop_token_ids=[6]),
        row(output=[], eos={5, 7}, min_tokens=1, stop_token_ids=[6]),
        row(output=[], temperature=0.0, min_tokens=1),  # eos known only via all_stop_token_ids
    ]
    rows[4].params.all_stop_token_ids.add(5)
    out = Sampler()(x, rows)
    assert out.sampled_token_ids[0] not in (5, 6)
    assert out.sampled_token_ids[1] == 5  # min_tokens reached: eos allowed again
    assert out.sampled_token_ids[2] not in (5, 6)
    assert out.sampled_token_ids[3] not in (5, 6, 7)
    assert out.sampled_token_ids[4] == 6  # 6 is no stop token for this row


def test_logprobs_ranks_and_topk(device):
    x = logits_for(4, device, seed=5)
    rows = [
        row(temperature=0.0, logprobs=3),
        row(temperature=1.0, top_k=10, logprobs=0),
        row(temperature=0.5),
        row(temperature=1.0, logprobs=5, seed=1, gen=torch.Generator(device=device).manual_seed(1)),
    ]
    out = Sampler()(x, rows)
    raw = torch.log_softmax(x.cpu().double(), -1)
    for i, tok in enumerate(out.sampled_token_ids):
        assert out.sampled_logprobs[i] == pytest.approx(raw[i, tok].item(), abs=1e-5)
        assert out.sampled_ranks[i] == int((raw[i] > raw[i, tok]).sum()) + 1
    assert out.sampled_ranks[0] == 1
    assert [len(t) for t in out.top_logprobs] == [3, 0, 0, 5]
    for i in (0, 3):
        vals, ids = raw[i].topk(len(out.top_logprobs[i]))
        assert [t for t, _ in out.top_logprobs[i]] == ids.tolist()
        assert [lp for _, lp in out.top_logprobs[i]] == pytest.approx(vals.tolist(), abs=1e-5)
    d = out.logprobs_dict(0)
    assert next(iter(d)) == out.sampled_token_ids[0] and len(d) == 3
    assert all(d[t].logprob == lp for t, lp in out.top_logprobs[0])
    assert list(out.logprobs_dict(1)) == [out.sampled_token_ids[1]]
    assert Sampler()(x, [row() for _ in range(4)]).top_logprobs is None


def test_mixed_batch(device):
    torch.manual_seed(0)
    x = logits_for(6, device, seed=6)
    rows = [
        row(temperature=0.0, repetition_penalty=1.5, prompt=[int(x[0].argmax())]),
        row(temperature=0.8, top_k=3),
        row(temperature=1.2, top_p=0.5, min_p=0.05),
        row(temperature=0.0),
        row(temperature=0.7, presence_penalty=2.0, output=[1, 1, 2]),
        row(gen=torch.Generator(device=device).manual_seed(5), seed=5, top_k=2, top_p=0.9),
    ]
    toks = Sampler()(x, rows).sampled_token_ids
    assert toks[0] == Sampler.process_logits(x[:1], rows[:1]).argmax().item()
    assert toks[3] == x[3].argmax().item()
    assert toks[1] in x[1].topk(3).indices.tolist()
    assert toks[5] in x[5].topk(2).indices.tolist()
    assert all(0 <= t < V for t in toks)


def test_prompt_logprobs_and_beam_topk(device):
    x = logits_for(5, device, seed=7)
    targets = torch.tensor([3, 1, 4, 1, 5])
    res = compute_prompt_logprobs(x, targets, k=2)
    raw = torch.log_softmax(x.cpu().double(), -1)
    for i, d in enumerate(res):
        t = targets[i].item()
        assert next(iter(d)) == t
        assert d[t].logprob == pytest.approx(raw[i, t].item(), abs=1e-5)
        assert d[t].rank == int((raw[i] > raw[i, t]).sum()) + 1
        top = raw[i].topk(2).indices.tolist()
        assert all(tok in d for tok in top) and len(d) == len({t, *top})
    vals, ids = log_softmax_topk(x, 4)
    ref_v, ref_i = raw.topk(4, -1)
    assert torch.equal(ids.cpu(), ref_i)
    torch.testing.assert_close(vals.cpu().double(), ref_v, atol=1e-5, rtol=0)
