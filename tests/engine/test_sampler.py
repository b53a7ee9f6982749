"""Batched sampler against per-row references and sampling statistics."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from paged_engine.sample.logprobs import log_softmax_topk, prompt_logprobs, unpack
from paged_engine.sample.metadata import Penalties, metadata_from_params
from paged_engine.sample.sampler import (
    NUCLEUS_CANDIDATES,
    Sampler,
    _nucleus,
    _nucleus_of,
    _sorted_top_k_top_p,
    apply_penalties,
    sampling_race,
)
from paged_engine.sampling_params import SamplingParams
from paged_kernels import gumbel_race, ref_gumbel_race, uniform_noise

V = 64


def row(prompt=(), output=(), eos=(), **kw) -> SimpleNamespace:
    return SimpleNamespace(
        params=SamplingParams(**kw), prompt=list(prompt), output=list(output), eos=eos
    )


def metadata(rows, device, vocab: int = V):
    return metadata_from_params(
        [r.params for r in rows],
        device,
        vocab,
        prompts=[r.prompt for r in rows],
        outputs=[r.output for r in rows],
        eos_token_ids=[{r.eos} if isinstance(r.eos, int) else r.eos for r in rows],
    )


def sample(x: torch.Tensor, rows, race=None) -> SimpleNamespace:
    """Token ids and (when any row asked) unpacked logprobs, as host lists."""
    out = Sampler(race=race)(x, metadata(rows, x.device, x.shape[1]))
    lp = None
    if out.logprobs is not None:
        ks = [len(r.params.logprob_token_ids or ()) or r.params.logprobs for r in rows]
        lp = unpack(out.logprobs, ks)
    return SimpleNamespace(tokens=out.token_ids.cpu().tolist(), lp=lp)


def process(x: torch.Tensor, rows) -> torch.Tensor:
    return Sampler().process_logits(x, metadata(rows, x.device, x.shape[1]))


def logits_for(n: int, device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, V, generator=g) * 3).to(device)


def test_greedy_is_argmax_and_input_untouched(device):
    x = logits_for(8, device)
    before = x.clone()
    out = sample(x, [row(temperature=0.0) for _ in range(8)])
    assert out.tokens == x.argmax(-1).tolist()
    assert torch.equal(x, before)
    assert process(x, [row(temperature=0.0)] * 8) is x  # nothing to do, no copy
    empty = sample(x[:0], [])
    assert empty.tokens == [] and empty.lp is None


@pytest.mark.parametrize("kw", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_degenerate_filters_are_greedy(device, kw):
    x = logits_for(16, device, seed=1)
    for _ in range(3):
        out = sample(x, [row(temperature=1.3, **kw) for _ in range(16)])
        assert out.tokens == x.argmax(-1).tolist()


def empirical(x_row: torch.Tensor, params: dict, n: int = 20000) -> torch.Tensor:
    torch.manual_seed(0)
    x = x_row.expand(n, -1).contiguous()
    toks = torch.tensor(sample(x, [row(**params)] * n).tokens)
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


def test_cpu_nucleus_from_candidates_is_the_whole_row_sorts():
    """On a CPU top-p is decided on a row's 128, then 1,024 most likely tokens where they hold
    top_p of the mass, else on the whole row sorted: the same bits as the whole row sorted, a
    row's result the same alone as in a batch, and the kept set the nucleus a float64
    reference finds (the most likely tokens while the mass before them is below top_p, ties at
    the last one kept; top-k first, its ties kept)."""
    vocab, n = 5000, 48
    g = torch.Generator().manual_seed(7)
    scale = torch.tensor([0.3, 2.0, 6.0, 12.0]).repeat(n // 4)[:, None]  # flat .. peaked rows
    x = (torch.randn(n, vocab, generator=g) * scale).bfloat16().float()  # bf16: many ties
    ks = torch.tensor([vocab, 20, 300, 3000] * (n // 4))[torch.randperm(n, generator=g)]
    top_k = ks[:, None]
    top_p = torch.tensor([0.3, 0.9, 0.999])[torch.arange(n) % 3][:, None]
    got = _nucleus(x, top_k, top_p, vocab)
    whole = _nucleus_of(x, top_k, top_p, vocab)[0]
    assert torch.equal(got, whole)
    first = _nucleus_of(x, top_k, top_p, NUCLEUS_CANDIDATES[0])[1]
    assert 0 < int(first.sum()) < n  # some rows decided on 128 tokens, some not
    for i in (0, 5, n - 1):
        alone = _nucleus(x[i : i + 1], top_k[i : i + 1], top_p[i : i + 1], int(ks[i]))
        assert torch.equal(alone[0], got[i])
    gpu = _sorted_top_k_top_p(x, top_k, top_p)  # a GPU's way: ties at the boundary by order
    checked = 0
    for i in range(n):
        row = x[i].double()
        k = int(ks[i])
        if k < vocab:
            row = row.masked_fill(row < row.topk(k).values[-1], float("-inf"))
        probs = row.softmax(-1)
        desc = probs.sort(descending=True).values
        before = desc.cumsum(0) - desc
        if ((before - top_p[i]).abs() < 1e-5).any():
            continue  # a boundary within float32's rounding of top_p
        last = desc[int((before < top_p[i]).sum()) - 1]
        assert torch.equal(got[i] > float("-inf"), probs >= last), i
        kept = gpu[i] > float("-inf")  # the same nucleus, but for some ties with `last`
        assert not (kept & (probs < last)).any() and (probs[(probs > last) & ~kept]).numel() == 0
        checked += 1
    assert checked > n // 2


def naive_penalties(x: torch.Tensor, r: SimpleNamespace) -> torch.Tensor:
    x = x.clone()
    p = r.params
    for t in set(r.prompt + r.output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(r.output):
        x[t] -= p.frequency_penalty * r.output.count(t) + p.presence_penalty
    return x


def test_logprobs_skipped_when_nobody_reads_them(device):
    x = logits_for(3, device)
    out = sample(x, [row(temperature=0.0) for _ in range(3)])
    assert out.tokens == x.argmax(-1).tolist()
    assert out.lp is None  # no [N, V] logsumexp or rank pass at all


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
    got = process(x, rows).cpu()
    want = torch.stack([naive_penalties(x[i].cpu(), r) for i, r in enumerate(rows)])
    torch.testing.assert_close(got, want)
    out = sample(x, rows)
    assert out.tokens == want.argmax(-1).tolist()
    # Logprobs stay those of the raw logits, whatever the penalties did.
    raw = torch.log_softmax(x.cpu(), -1)
    torch.testing.assert_close(torch.tensor(out.lp.logprobs), raw[range(12), out.tokens])


def dense_penalties(x: torch.Tensor, pen: Penalties) -> None:
    """The penalties as passes over [P, V]: a seen mask, then counts (the arithmetic order the
    engine's gather / scatter version keeps)."""
    vocab = x.shape[1]
    sub = x[pen.rows]
    seen = torch.zeros(sub.shape[0], vocab + 1, dtype=torch.bool, device=x.device)
    seen.scatter_(1, pen.prompt_ids.masked_fill(pen.prompt_ids < 0, vocab), True)
    output = pen.output_ids.masked_fill(pen.output_ids < 0, vocab)
    seen.scatter_(1, output, True)
    rp = pen.repetition
    sub = torch.where(seen[:, :vocab], torch.where(sub > 0, sub / rp, sub * rp), sub)
    counts = torch.zeros(sub.shape[0], vocab + 1, dtype=x.dtype, device=x.device)
    counts.scatter_add_(1, output, torch.ones(output.shape, dtype=x.dtype, device=x.device))
    counts = counts[:, :vocab]
    x[pen.rows] = sub - pen.frequency * counts - pen.presence * (counts > 0).to(x.dtype)


def test_penalties_touch_only_history_tokens_bit_exactly(device):
    """apply_penalties reads and writes the logits at the rows' history tokens only: the same
    bits as the dense passes, with repeated tokens, padding, token 0, rows with no history,
    -inf logits (grammar masks) and rows that do not use penalties in between."""
    g = torch.Generator().manual_seed(11)
    for trial in range(60):
        vocab = int(torch.randint(2, 300, (1,), generator=g))
        p = int(torch.randint(1, 7, (1,), generator=g))
        n = p + int(torch.randint(0, 4, (1,), generator=g))
        lp, lo = (int(v) for v in torch.randint(1, 40, (2,), generator=g))
        x = torch.randn(n, vocab, generator=g) * 3
        x[torch.rand(n, vocab, generator=g) < 0.1] = float("-inf")
        prompt = torch.randint(-1, min(vocab, 8), (p, lp), generator=g)  # many repeats, PAD = -1
        output = torch.randint(-1, vocab, (p, lo), generator=g)
        if trial % 5 == 0:
            prompt[0], output[0] = -1, -1  # a row without any history token
        pen = Penalties(
            rows=torch.randperm(n, generator=g)[:p],
            repetition=torch.rand(p, 1, generator=g) + 0.5,
            frequency=torch.randn(p, 1, generator=g),
            presence=torch.randn(p, 1, generator=g),
            prompt_ids=prompt,
            output_ids=output,
        )
        x, pen = x.to(device), Penalties(*(t.to(device) for t in dataclasses.astuple(pen)))
        want = x.clone()
        dense_penalties(want, pen)
        got = x.clone()
        apply_penalties(got, pen)  # its own scratch
        assert torch.equal(got, want), trial
        # the sampler's kept scratch (more rows than needed) is zero again afterwards
        tally = torch.zeros(p + 3, vocab + 1, device=device)
        for _ in range(2):
            got = x.clone()
            apply_penalties(got, pen, tally)
            assert torch.equal(got, want), trial
            assert not tally.any(), trial


def run_seeded(device, position: int, others: list[dict], steps: int = 8, race=None) -> list[int]:
    """Sample `steps` tokens for a seeded row placed at `position` among other rows; the row's
    draw depends on (seed, sample index, output position) only."""
    tokens: list[int] = []
    for step in range(steps):
        rows = [row(**kw) for kw in others]
        rows.insert(position, row(output=tokens, temperature=0.9, top_p=0.95, seed=1234))
        x = logits_for(len(rows), device, seed=100 + step)  # seeded row's logits: position-free
        x[position] = logits_for(1, device, seed=step)[0]
        tokens.append(sample(x, rows, race).tokens[position])
    return tokens


@pytest.mark.parametrize("race", [None, gumbel_race], ids=["torch", "gumbel_race"])
def test_seeded_row_independent_of_batch(device, race):
    alone = run_seeded(device, 0, [], race=race)
    mixed = [{"temperature": 1.0}, {"temperature": 0.0}, {"top_k": 5, "seed": 7}, {"min_p": 0.3}]
    assert run_seeded(device, 2, mixed, race=race) == alone
    assert run_seeded(device, 4, mixed, race=race) == alone
    torch.manual_seed(99)  # the global RNG does not matter either
    other = [{"temperature": 2.0, "frequency_penalty": 1.0}]
    assert run_seeded(device, 1, other, race=race) == alone
    assert len(set(alone)) > 1  # it really sampled


def test_seeded_draws_differ_by_index_and_position(device):
    """Two samples of one request (index 0 and 1) and two positions draw different noise."""
    x = torch.zeros(64, V, device=device)  # uniform: the draw alone decides
    p = SamplingParams(temperature=1.0, seed=3)
    md = metadata_from_params([p] * 64, device, V, indices=[i % 2 for i in range(64)])
    toks = Sampler()(x, md).token_ids.cpu().tolist()
    assert toks[0::2] == [toks[0]] * 32 and toks[1::2] == [toks[1]] * 32
    assert toks[0] != toks[1]
    by_position = [
        Sampler()(x[:1], metadata_from_params([p], device, V, outputs=[[1] * k])).token_ids.item()
        for k in range(8)
    ]
    assert by_position[0] == toks[0] and len(set(by_position)) > 1


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
    out = sample(x, rows)
    assert out.tokens[0] not in (5, 6)
    assert out.tokens[1] == 5  # min_tokens reached: eos allowed again
    assert out.tokens[2] == 5  # with ignore_eos, eos is an ordinary token; 6 stays banned
    assert out.tokens[3] not in (5, 6, 7)
    assert out.tokens[4] == 6  # 6 is no stop token for this row


def test_logprobs_ranks_and_topk(device):
    x = logits_for(4, device, seed=5)
    rows = [
        row(temperature=0.0, logprobs=3),
        row(temperature=1.0, top_k=10, logprobs=0),
        row(temperature=0.5),
        row(temperature=1.0, logprobs=5, seed=1),
    ]
    out = sample(x, rows)
    raw = torch.log_softmax(x.cpu().double(), -1)
    lp = out.lp
    for i, tok in enumerate(out.tokens):
        assert lp.token_ids[i] == tok
        assert lp.logprobs[i] == pytest.approx(raw[i, tok].item(), abs=1e-5)
        assert lp.ranks[i] == int((raw[i] > raw[i, tok]).sum()) + 1
    assert lp.ranks[0] == 1
    assert [len(t) for t in lp.top] == [3, 0, 0, 5]
    for i in (0, 3):
        vals, ids = raw[i].topk(len(lp.top[i]))
        assert [t for t, _, _ in lp.top[i]] == ids.tolist()
        assert [v for _, v, _ in lp.top[i]] == pytest.approx(vals.tolist(), abs=1e-5)
        assert [r for _, _, r in lp.top[i]] == list(range(1, len(lp.top[i]) + 1))
    assert sample(x, [row() for _ in range(4)]).lp is None


def test_explicit_logprob_ids_come_with_their_ranks(device):
    """logprob_token_ids rows report those ids (their order, raw logprobs, vocabulary ranks)
    where top-k rows beside them report their top-k."""
    x = logits_for(4, device, seed=9)
    rows = [
        row(logprobs=2),
        row(logprob_token_ids=[4, 0, 9], temperature=0.0),
        row(logprob_token_ids=[7]),
        row(temperature=0.5),
    ]
    out = sample(x, rows)
    raw = torch.log_softmax(x.cpu().double(), -1)
    assert [len(t) for t in out.lp.top] == [2, 3, 1, 0]
    assert [t for t, _, _ in out.lp.top[0]] == raw[0].topk(2).indices.tolist()
    for i, ids in ((1, [4, 0, 9]), (2, [7])):
        assert [t for t, _, _ in out.lp.top[i]] == ids
        for t, v, r in out.lp.top[i]:
            assert v == pytest.approx(raw[i, t].item(), abs=1e-5)
            assert r == int((raw[i] > raw[i, t]).sum()) + 1


def test_mixed_batch(device):
    torch.manual_seed(0)
    x = logits_for(6, device, seed=6)
    rows = [
        row(temperature=0.0, repetition_penalty=1.5, prompt=[int(x[0].argmax())]),
        row(temperature=0.8, top_k=3),
        row(temperature=1.2, top_p=0.5, min_p=0.05),
        row(temperature=0.0),
        row(temperature=0.7, presence_penalty=2.0, output=[1, 1, 2]),
        row(seed=5, top_k=2, top_p=0.9),
    ]
    toks = sample(x, rows).tokens
    assert toks[0] == process(x[:1], rows[:1]).argmax().item()
    assert toks[3] == x[3].argmax().item()
    assert toks[1] in x[1].topk(3).indices.tolist()
    assert toks[5] in x[5].topk(2).indices.tolist()
    assert all(0 <= t < V for t in toks)


def test_prompt_logprobs_and_beam_topk(device):
    x = logits_for(5, device, seed=7)
    targets = torch.tensor([3, 1, 4, 1, 5])
    res = unpack(prompt_logprobs(x, targets, k=2))
    raw = torch.log_softmax(x.cpu().double(), -1)
    for i in range(5):
        t = targets[i].item()
        assert res.token_ids[i] == t
        assert res.logprobs[i] == pytest.approx(raw[i, t].item(), abs=1e-5)
        assert res.ranks[i] == int((raw[i] > raw[i, t]).sum()) + 1
        assert [tok for tok, _, _ in res.top[i]] == raw[i].topk(2).indices.tolist()
    vals, ids = log_softmax_topk(x, 4)
    ref_v, ref_i = raw.topk(4, -1)
    assert torch.equal(ids.cpu(), ref_i)
    torch.testing.assert_close(vals.cpu().double(), ref_v, atol=1e-5, rtol=0)


def _race_reference(logits: torch.Tensor, md, seed: int) -> list[int]:
    """The exponential race spelled out: float32 logits / temperature, softmax, divided by
    -log(U) from the engine-seeded generator (unseeded rows) and reseeded ones (seeded rows),
    first argmax; greedy rows take the argmax of the logits."""
    x = logits.float() / (md.temperature if md.temperature is not None else 1.0)
    u = torch.empty(x.shape, device=x.device)
    u.uniform_(generator=torch.Generator(device=x.device).manual_seed(seed))
    for r, s in md.seeds:
        u[r].uniform_(generator=torch.Generator(device=x.device).manual_seed(s))
    tokens = torch.argmax(x.softmax(-1) / -u.log(), dim=-1)
    if md.greedy is not None:
        tokens = torch.where(md.greedy, torch.argmax(logits.float(), dim=-1), tokens)
    return tokens.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_temperature_rows_race_as_spelled_out(device, dtype):
    """Temperature-only rows (the fast path: no float32 copy of the logits, the race as an
    argmin over log(U)) draw exactly the tokens of the race spelled out, greedy and seeded
    rows among them; and the same tokens when another row's logprobs or top-p send the batch
    the general way."""
    temps = [0.6, 0.0, 1.3, 0.6] * 8
    params = [SamplingParams(temperature=t, seed=11 * i if i % 3 == 0 else None)
              for i, t in enumerate(temps)]  # fmt: skip
    x = (torch.randn(len(temps), 4096, generator=torch.Generator().manual_seed(5)) * 4).to(device)
    x = x.to(dtype)
    md = metadata_from_params(params, device, x.shape[1])
    assert not md.need_logprobs and md.temperature is not None
    fast = Sampler(seed=7)(x, md).token_ids.tolist()
    assert fast == _race_reference(x, md, seed=7)
    assert len(set(fast)) > 8  # it really sampled
    # seeded and greedy rows: the same tokens whatever else is in the batch (unseeded rows'
    # noise may depend on the batch's shape on a GPU)
    kept = [i for i, p in enumerate(params) if p.seed is not None or p.temperature == 0.0]
    for extra in ({"logprobs": 2}, {"top_p": 0.5}):
        other = [*params, SamplingParams(temperature=0.6, **extra)]
        y = torch.cat((x, x[:1]))
        general = Sampler(seed=7)(y, metadata_from_params(other, device, y.shape[1]))
        assert [general.token_ids.tolist()[i] for i in kept] == [fast[i] for i in kept], extra


def test_gumbel_race_paths_agree(device):
    """With the one-pass race (CUDA engines): temperature-only rows race on the model's logits,
    the kernel dividing by T; the tokens are the race's on the uniforms of each row's seed (a
    seeded row's draw seed, else one from the engine-seeded host generator), greedy rows take
    the argmax; and seeded and greedy rows keep their tokens when another row's logprobs or
    top-p send the batch through processing (x / T divided by torch, then the race)."""
    temps = [0.6, 0.0, 1.3, 0.6] * 4
    params = [SamplingParams(temperature=t, seed=11 * i if i % 3 == 0 else None)
              for i, t in enumerate(temps)]  # fmt: skip
    x = torch.randn(len(temps), 1100, generator=torch.Generator().manual_seed(5)) * 4
    x = x.to(device, torch.bfloat16)  # the model's dtype: the fast path reads it as it is
    md = metadata_from_params(params, device, x.shape[1])
    fast = Sampler(seed=7, race=gumbel_race)(x, md).token_ids.tolist()
    seeds = np.random.Generator(np.random.PCG64(7)).integers(
        -(2**63), 2**63, size=len(temps), dtype=np.int64
    )
    for r, s in md.seeds:
        seeds[r] = s
    u = uniform_noise(torch.from_numpy(seeds).to(device), x.shape[1])
    want = ref_gumbel_race(x, u, md.temperature)
    want = torch.where(md.greedy, x.float().argmax(dim=-1), want)
    assert fast == want.tolist()
    assert len(set(fast)) > 6  # it really sampled
    kept = [i for i, p in enumerate(params) if p.seed is not None or p.temperature == 0.0]
    for extra in ({"logprobs": 2}, {"top_p": 0.5}):
        other = [*params, SamplingParams(temperature=0.6, **extra)]
        y = torch.cat((x, x[:1]))
        general = Sampler(seed=7, race=gumbel_race)(y, metadata_from_params(other, device, 1100))
        assert [general.token_ids.tolist()[i] for i in kept] == [fast[i] for i in kept], extra
    # unseeded rows draw fresh seeds each call
    sampler = Sampler(seed=7, race=gumbel_race)
    first, second = (sampler(x, md).token_ids.tolist() for _ in range(2))
    free = [i for i, p in enumerate(params) if p.seed is None and p.temperature > 0]
    assert [first[i] for i in free] != [second[i] for i in free]


def test_the_race_kernel_runs_where_triton_does():
    cuda = torch.device("cuda", 0)
    assert sampling_race("triton", cuda) is gumbel_race
    assert sampling_race("torch", cuda) is None  # the reference engine keeps torch's race
    assert sampling_race("triton", torch.device("cpu")) is None  # the interpreter: tests only


def test_warm_up_builds_every_race_the_sampler_runs(device):
    """The engine start's warm-up (profile_forward) launches the race in each form sampling
    will: later steps of other sizes and paths add no compile key (tests/compile_keys.py), the
    split count (which follows the row count) included; and it draws no seeds."""
    from compile_keys import record_compile_keys

    def race(x, seeds, temperature):  # a split count that changes with the rows, as on a GPU
        return gumbel_race(x, seeds, temperature, num_splits=x.shape[0] % 3 + 1)

    sampler = Sampler(seed=3, race=race)
    state = sampler._race_seeds.bit_generator.state
    x = torch.randn(6, 3000, device=device)
    with record_compile_keys() as keys:
        sampler.warm_up(3000, x.device)
        built = {k: set(v) for k, v in keys.items()}
        assert sampler._race_seeds.bit_generator.state == state
        for rows in ([row(temperature=0.7, seed=1)] * 4, [row(top_k=5), row(temperature=1.0)]):
            sampler(x[: len(rows)], metadata(rows, device, 3000))
    assert {k: set(v) for k, v in keys.items()} == built


def test_a_race_that_fails_at_warm_up_falls_back_to_torch(device, caplog):
    def broken(x, seeds, temperature):
        raise RuntimeError("no kernel for this GPU")

    sampler = Sampler(seed=3, race=broken)
    sampler.warm_up(64, device)
    assert sampler.race is None and "sampling with torch's" in caplog.text
    x = logits_for(4, device)
    md = metadata([row(temperature=0.8), row(temperature=0.8, seed=4)] * 2, device)
    assert torch.equal(sampler(x, md).token_ids, Sampler(seed=3)(x, md).token_ids)  # torch's race
