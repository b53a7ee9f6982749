"""Batched sampling over a logits tensor [N, V]: one row per sequence that samples this step.

Processing order (vLLM's): min_tokens -> repetition / frequency / presence penalties ->
temperature -> top-k -> top-p -> min-p -> sample. Greedy rows take the argmax of the processed
logits; random rows use the exponential race (argmax of probs / Exp(1) noise), so nothing syncs
with the host until the single transfer of results at the end. Every step is row-wise: a row's
result never depends on the other rows, so a seeded row (noise drawn from its own generator)
samples the same tokens whatever else is in the batch.

Logprobs are always those of the RAW model distribution (log_softmax of the unprocessed logits).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch import Tensor

from paged_engine.outputs import Logprob
from paged_engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one row of the logits."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Owned by the engine, one per seeded sequence, seeded with params.seed, on the logits'
    # device; None for unseeded rows (which draw from the global RNG).
    generator: torch.Generator | None = None
    # The model's eos id, or all of them (Llama 3 has several); masked while below min_tokens.
    eos_token_id: int | Collection[int] | None = None


@dataclass(slots=True)
class SamplerOutput:
    """Per row: the sampled token, its raw logprob and rank (1 = most likely).

    top_logprobs is None when no row asked for logprobs; otherwise row i holds its
    `params.logprobs` most likely (token_id, raw logprob) pairs, best first ([] for rows that
    asked for none or for logprobs=0)."""

    sampled_token_ids: list[int]
    sampled_logprobs: list[float]
    sampled_ranks: list[int]
    top_logprobs: list[list[tuple[int, float]]] | None

    def logprobs_dict(self, i: int) -> dict[int, Logprob]:
        """Row i as a CompletionOutput.logprobs entry: the sampled token first, then the top-k."""
        out = {self.sampled_token_ids[i]: Logprob(self.sampled_logprobs[i], self.sampled_ranks[i])}
        for rank, (tok, lp) in enumerate(self.top_logprobs[i] if self.top_logprobs else (), 1):
            out.setdefault(tok, Logprob(lp, rank))
        return out


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A host list as a tensor on `device`. For CUDA it goes through pinned memory with a
    non-blocking copy: a plain copy from pageable memory would wait for the model's forward."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _padded(seqs: list[list[int]], pad: int, device: torch.device) -> Tensor:
    """[len(seqs), max_len] int64, right-padded with `pad`; ids above `pad` are clamped to it
    (the callers use column `pad` = vocab size as a discarded slot)."""
    width = max((len(s) for s in seqs), default=0)
    rows = [s + [pad] * (width - len(s)) for s in seqs]
    return _to_device(rows, torch.long, device).view(len(seqs), width).clamp_(max=pad)


def _col(values: list, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
    return _to_device(values, dtype, device).unsqueeze(1)


def _rows(idx: list[int], device: torch.device) -> Tensor:
    return _to_device(idx, torch.long, device)


def apply_min_tokens(x: Tensor, rows: list[SamplingRow]) -> None:
    """Ban eos and stop token ids while a row has fewer than min_tokens outputs (in place)."""
    r_idx, t_idx = [], []
    vocab = x.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        if len(row.output_token_ids) < p.min_tokens:
            banned = set(p.all_stop_token_ids).union(p.stop_token_ids)
            eos = row.eos_token_id
            if isinstance(eos, int):
                banned.add(eos)
            elif eos is not None:
                banned.update(eos)
            banned = [t for t in banned if 0 <= t < vocab]
            r_idx += [i] * len(banned)
            t_idx += banned
    if r_idx:
        x[_rows(r_idx, x.device), _rows(t_idx, x.device)] = float("-inf")


def apply_penalties(x: Tensor, rows: list[SamplingRow]) -> None:
    """Repetition penalty over prompt + output tokens, then frequency and presence over output
    tokens (in place). Only rows that use a penalty are touched."""
    dev, vocab = x.device, x.shape[1]
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        idx = _rows(rep, dev)
        toks = _padded(
            [rows[i].prompt_token_ids + rows[i].output_token_ids for i in rep], vocab, dev
        )
        seen = torch.zeros(len(rep), vocab + 1, dtype=torch.bool, device=dev)
        seen = seen.scatter_(1, toks, True)[:, :vocab]  # column `vocab` absorbs the padding
        sub = x[idx]
        rp = _col([rows[i].params.repetition_penalty for i in rep], dev)
        x[idx] = torch.where(seen, torch.where(sub > 0, sub / rp, sub * rp), sub)
    fp = [
        i
        for i, r in enumerate(rows)
        if r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0
    ]
    if fp:
        idx = _rows(fp, dev)
        toks = _padded([rows[i].output_token_ids for i in fp], vocab, dev)
        counts = torch.zeros(len(fp), vocab + 1, dtype=x.dtype, device=dev)
        counts = counts.scatter_add_(1, toks, torch.ones_like(toks, dtype=x.dtype))[:, :vocab]
        freq = _col([rows[i].params.frequency_penalty for i in fp], dev)
        pres = _col([rows[i].params.presence_penalty for i in fp], dev)
        x[idx] = x[idx] - freq * counts - pres * (counts > 0).to(x.dtype)


def apply_top_k_top_p(x: Tensor, idx: Tensor, top_k: list[int], top_p: list[float]) -> None:
    """Mask (to -inf) the rows `idx` of x outside their top-k, then outside their top-p nucleus.
    top_k 0 means off; ties at the k-th value are all kept. Top-k alone needs only a topk of the
    largest k; with top-p one ascending sort serves both."""
    vocab = x.shape[1]
    k_list = [k if 0 < k < vocab else vocab for k in top_k]
    has_k = any(k < vocab for k in k_list)
    sub = x[idx]
    if all(p >= 1.0 for p in top_p):
        k = _rows(k_list, x.device).unsqueeze(1)
        kth = sub.topk(max(k_list), dim=-1).values.gather(1, k - 1)  # k-th largest per row
        x[idx] = sub.masked_fill(sub < kth, float("-inf"))
        return
    sorted_x, order = sub.sort(dim=-1)
    if has_k:
        k = _rows(k_list, x.device).unsqueeze(1)
        sorted_x.masked_fill_(sorted_x < sorted_x.gather(1, vocab - k), float("-inf"))
    cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= 1.0 - _col(top_p, x.device)
    drop[:, -1] = False  # always keep the most likely token
    sorted_x.masked_fill_(drop, float("-inf"))
    x[idx] = torch.empty_like(sorted_x).scatter_(1, order, sorted_x)


def apply_min_p(x: Tensor, idx: Tensor, min_p: list[float]) -> None:
    """Mask tokens whose probability is below min_p times the row's top probability."""
    sub = x[idx]
    probs = sub.softmax(dim=-1)
    keep_min = probs.amax(dim=-1, keepdim=True) * _col(min_p, x.device)
    x[idx] = sub.masked_fill(probs < keep_min, float("-inf"))


def _exponential_noise(shape: torch.Size, rows: list[SamplingRow], device: torch.device) -> Tensor:
    """Exp(1) noise [N, V] as -log(U): the global RNG for unseeded rows (one op), each seeded
    row's own generator for its row (so its draws don't depend on the batch). U = 0 gives +inf
    noise (that token loses), never 0 noise, so probs / noise is never NaN."""
    q = torch.empty(shape, device=device)
    seeded = [(i, r.generator) for i, r in enumerate(rows) if r.generator is not None]
    if len(seeded) < len(rows):
        q.uniform_()
    for i, gen in seeded:
        if gen.device == q.device:
            q[i].uniform_(generator=gen)
        else:
            q[i].copy_(torch.rand(shape[1], device=gen.device, generator=gen))
    return q.log_().neg_()


class Sampler:
    """Stateless; `Sampler()(logits, rows)` samples one token per row."""

    def __call__(self, logits: Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        # logits: [N, V], any float dtype, CPU or CUDA; rows[i] describes logits[i].
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
        raw = logits.float()
        tokens = self.sample(self.process_logits(raw, rows), rows)
        return _gather_logprobs(raw, tokens, rows)

    @staticmethod
    def process_logits(raw: Tensor, rows: list[SamplingRow]) -> Tensor:
        """The processed logits [N, V] (a new tensor; `raw` is left untouched when any processing
        applies, and returned as is when none does)."""
        dev, vocab = raw.device, raw.shape[1]
        ps = [r.params for r in rows]
        greedy = [p.is_greedy for p in ps]
        need_min = any(len(r.output_token_ids) < r.params.min_tokens for r in rows)
        need_pen = any(
            p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
            for p in ps
        )
        temps = [1.0 if g else p.temperature for p, g in zip(ps, greedy)]
        sort_rows = [i for i, p in enumerate(ps) if 0 < p.top_k < vocab or p.top_p < 1.0]
        min_p_rows = [i for i, p in enumerate(ps) if p.min_p > 0.0]
        if not (need_min or need_pen or sort_rows or min_p_rows or any(t != 1.0 for t in temps)):
            return raw
        x = raw.clone()
        if need_min:
            apply_min_tokens(x, rows)
        if need_pen:
            apply_penalties(x, rows)
        if any(t != 1.0 for t in temps):
            x.div_(_col(temps, dev))
        if sort_rows:  # greedy rows never land here: their top_k/top_p are normalized off
            top_k = [ps[i].top_k for i in sort_rows]
            apply_top_k_top_p(x, _rows(sort_rows, dev), top_k, [ps[i].top_p for i in sort_rows])
        if min_p_rows:
            apply_min_p(x, _rows(min_p_rows, dev), [ps[i].min_p for i in min_p_rows])
        return x

    @staticmethod
    def sample(x: Tensor, rows: list[SamplingRow]) -> Tensor:
        """[N] int64 token ids: argmax for greedy rows, the exponential race for the others."""
        greedy = [r.params.is_greedy for r in rows]
        if all(greedy):
            return x.argmax(dim=-1)
        probs = x.softmax(dim=-1)
        sampled = probs.div_(_exponential_noise(x.shape, rows, x.device)).argmax(dim=-1)
        if any(greedy):
            is_greedy = _to_device(greedy, torch.bool, x.device)
            sampled = torch.where(is_greedy, x.argmax(dim=-1), sampled)
        return sampled


def _wants_logprobs(row: SamplingRow) -> bool:
    """Logprobs are reported (logprobs=k) or rank best_of > n samples by cumulative logprob."""
    p = row.params
    return p.logprobs is not None or (p.best_of or 0) > p.n


def _gather_logprobs(raw: Tensor, tokens: Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    if not any(_wants_logprobs(r) for r in rows):
        # Nothing reads them: skip the [N, V] logsumexp and rank passes (NaN marks "not computed").
        ids = tokens.cpu().tolist()
        nan = float("nan")
        return SamplerOutput(ids, [nan] * len(ids), [0] * len(ids), None)
    vocab = raw.shape[1]
    lse = raw.logsumexp(dim=-1, keepdim=True)
    tok_logit = raw.gather(1, tokens.unsqueeze(1))
    cols = [tokens.unsqueeze(1).double(), (tok_logit - lse).double()]
    cols.append(((raw > tok_logit).sum(dim=-1, keepdim=True) + 1).double())  # rank
    ks = [r.params.logprobs for r in rows]
    max_k = min(max((k or 0 for k in ks), default=0), vocab)
    if max_k > 0:
        top_v, top_i = raw.topk(max_k, dim=-1)
        cols += [top_i.double(), (top_v - lse).double()]
    # One device -> host transfer for everything (float64 holds token ids exactly).
    packed = torch.cat(cols, dim=1).cpu().tolist()
    top = None
    if any(k is not None for k in ks):
        top = [
            [(int(t), lp) for t, lp in zip(row[3 : 3 + (k or 0)], row[3 + max_k :])]
            for row, k in zip(packed, ks)
        ]
    return SamplerOutput(
        sampled_token_ids=[int(row[0]) for row in packed],
        sampled_logprobs=[row[1] for row in packed],
        sampled_ranks=[int(row[2]) for row in packed],
        top_logprobs=top,
    )


def log_softmax_topk(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k most likely tokens per row under the raw distribution, best first.
    logits: [N, V] -> (logprobs [N, k] float32, token ids [N, k] int64). For beam search."""
    raw = logits.float()
    values, ids = raw.topk(min(k, raw.shape[1]), dim=-1)
    return values - raw.logsumexp(dim=-1, keepdim=True), ids


def compute_prompt_logprobs(
    logits: Tensor, target_token_ids: Tensor, k: int
) -> list[dict[int, Logprob]]:
    """Raw logprobs of each actual next prompt token plus the top-k at each position.

    logits: [P, V], the logits at prompt positions 0..P-1; target_token_ids: [P], the token
    that follows each position. Returns P dicts {token_id: Logprob}, the actual token first.
    (The caller prepends None for the first prompt token, which has no logprob.)"""
    raw = logits.float()
    targets = target_token_ids.to(device=raw.device, dtype=torch.long)
    lse = raw.logsumexp(dim=-1, keepdim=True)
    tgt_logit = raw.gather(1, targets.unsqueeze(1))
    cols = [targets.unsqueeze(1).double(), (tgt_logit - lse).double()]
    cols.append(((raw > tgt_logit).sum(dim=-1, keepdim=True) + 1).double())
    k = min(k, raw.shape[1])
    if k > 0:
        top_v, top_i = raw.topk(k, dim=-1)
        cols += [top_i.double(), (top_v - lse).double()]
    result = []
    for row in torch.cat(cols, dim=1).cpu().tolist():
        d = {int(row[0]): Logprob(row[1], int(row[2]))}
        for rank, (t, lp) in enumerate(zip(row[3 : 3 + k], row[3 + k :]), 1):
            d.setdefault(int(t), Logprob(lp, rank))
        result.append(d)
    return result
