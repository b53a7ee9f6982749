"""gumbel_race (a sampled token per row in one pass over the logits) against its torch
reference on the same uniforms (`uniform_noise`), and the properties the sampler relies on: the
temperature divided in the kernel or before it gives the same tokens, the split over programs
never changes a token, a row's noise depends on its seed alone, and the tokens follow
softmax(x / T)."""

from __future__ import annotations

import math

import pytest
import torch

from paged_kernels import gumbel_race, ref_gumbel_race, uniform_noise


def _seeds(n: int, device, base: int = 0) -> torch.Tensor:
    # the whole int64 range: the generator keys on all 64 bits
    values = [base + i * 0x9E3779B97F4A7C15 % 2**63 for i in range(n)]
    return torch.tensor([v - 2**63 if v >= 2**63 else v for v in values], device=device)


@pytest.mark.parametrize(
    ("dtype", "vocab"),
    [
        (torch.float32, 7),  # one partial quarter
        (torch.float32, 1024),  # one whole block
        (torch.float32, 3001),  # blocks and a partial one
        (torch.bfloat16, 3001),
        (torch.float16, 3001),
    ],
)
def test_race_matches_reference(seed, device, dtype, vocab):
    rows = 6
    x = (torch.randn(rows, vocab, device=device) * 3).to(dtype)
    x[1, vocab // 2 :] = float("-inf")  # masked columns (top-k, grammar) never win
    x[2, 1:] = float("-inf")  # one column left: it must win
    seeds = _seeds(rows, device, base=seed)
    temp = torch.rand(rows, device=device) * 1.5 + 0.1
    got = gumbel_race(x, seeds, temp)
    want = ref_gumbel_race(x, uniform_noise(seeds, vocab), temp)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert got[2] == 0 and got[1] < vocab // 2
    # the temperature divided before the race (the sampler's processing path) or in it: the
    # same quotients, the same tokens
    assert torch.equal(gumbel_race(x.float() / temp[:, None], seeds), got)


def test_splits_never_change_a_token(seed, device):
    rows, vocab = 5, 5000
    x = torch.randn(rows, vocab, device=device)
    seeds = _seeds(rows, device, base=seed)
    one = gumbel_race(x, seeds, num_splits=1)
    for splits in (2, 3, 5):
        assert torch.equal(gumbel_race(x, seeds, num_splits=splits), one)
    # a tie (two +inf logits: +inf scores whatever the noise) goes to the lower column, across
    # splits as within one
    tie = torch.randn(1, 4096, device=device)
    tie[0, 3000] = tie[0, 5] = float("inf")
    for splits in (1, 4):
        assert gumbel_race(tie, _seeds(1, device, base=seed), num_splits=splits).item() == 5


def test_noise_depends_on_the_seed_alone(device):
    seeds = torch.tensor([3, 3, 4, -(2**63), 2**63 - 1], device=device)
    u = uniform_noise(seeds, 2500)
    assert torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert not torch.equal(u[3], u[4])
    assert torch.equal(uniform_noise(seeds[2:3], 2500)[0], u[2])  # not on the batch
    assert torch.equal(uniform_noise(seeds[:1], 700)[0], u[0, :700])  # nor on the width
    assert u.min() >= 0 and u.max() < 1
    flat = uniform_noise(_seeds(8, device), 4096).flatten().double()
    assert abs(flat.mean().item() - 0.5) < 0.01 and abs(flat.var().item() - 1 / 12) < 0.005
    # neighbouring columns uncorrelated, and rows of consecutive seeds too
    a, b = flat[:-1] - 0.5, flat[1:] - 0.5
    assert abs((a * b).mean().item() * 12) < 0.02
    rows = uniform_noise(torch.arange(64, device=device), 1024).double() - 0.5
    corr = (rows @ rows.T) / 1024 * 12  # ~identity
    off = corr - torch.diag(torch.diag(corr))
    assert off.abs().max() < 0.2 and abs(off.mean().item()) < 0.01


@pytest.mark.gpu
def test_tokens_follow_softmax(device):
    """20,000 seeded rows over 6 tokens at temperature 0.7: a chi-square test against
    softmax(x / T) (critical value 20.5 is p = 0.001 at 5 degrees of freedom). On a GPU: the
    interpreter runs a program per row."""
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -3.0], device=device)
    rows = 20000
    x = logits.expand(rows, -1).contiguous()
    temp = torch.full((rows,), 0.7, device=device)
    got = gumbel_race(x, _seeds(rows, device, base=11), temp)
    counts = torch.bincount(got, minlength=6).double()
    expected = torch.softmax(logits.double() / 0.7, dim=0) * rows
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 20.5, (counts.tolist(), expected.tolist())


def test_argument_errors(device):
    x = torch.zeros(2, 8, device=device)
    seeds = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="seeds must be int64"):
        gumbel_race(x, seeds.int())
    with pytest.raises(ValueError, match=r"seeds must be \[2\]"):
        gumbel_race(x, seeds[:1])
    with pytest.raises(ValueError, match="temperature must hold 2"):
        gumbel_race(x, seeds, torch.ones(3, device=device))
    with pytest.raises(ValueError, match="float32"):
        gumbel_race(x, seeds, torch.ones(2, dtype=torch.float64, device=device))
    with pytest.raises(ValueError, match=r"\[rows, vocab\] float"):
        gumbel_race(x.long(), seeds)
    assert gumbel_race(x[:0], seeds[:0]).shape == (0,)


@pytest.mark.gpu
def test_race_at_qwen3_vocab_on_gpu(device):
    """256 rows of bf16 logits over 151,936 tokens, the heuristic's splits against one."""
    rows, vocab = 256, 151936
    x = (torch.randn(rows, vocab, device=device) * 4).to(torch.bfloat16)
    seeds = _seeds(rows, device, base=5)
    temp = torch.full((rows,), 0.6, device=device)
    got = gumbel_race(x, seeds, temp)
    assert torch.equal(got, ref_gumbel_race(x, uniform_noise(seeds, vocab), temp))
    assert torch.equal(got, gumbel_race(x, seeds, temp, num_splits=1))
    assert math.isfinite(float(x.float().max()))
