"""Raw-distribution logprobs on the device, packed for one transfer, and unpacked on the host.

A packed row is float64 (exact for token ids):

    | token id | logprob | rank | top ids (k) | top logprobs (k) | top ranks (k) |

`rank` is 1 for the most likely token. The top columns are the k most likely tokens, best
first (ranks 1..k), or a row's logprob_token_ids in their order (their own ranks).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from paged_engine.core.core_output import LogprobsLists

# [N, V] -> [N, 1] float32 log-sum-exp of each row: torch's, or under batch_invariant=True one
# with a fixed reduction order (layers/batch_invariant.py: invariant_logsumexp).
LogSumExp = Callable[[Tensor], Tensor]


def torch_logsumexp(raw: Tensor) -> Tensor:
    return raw.logsumexp(dim=-1, keepdim=True)


def _rank(raw: Tensor, logit: Tensor) -> Tensor:
    """[N, 1] rank of each row's `logit` [N, 1] among the row's logits (1: the largest)."""
    return (raw > logit).sum(dim=-1, keepdim=True) + 1


def _pack(
    raw: Tensor,
    tokens: Tensor,
    k: int,
    logsumexp: LogSumExp,
    explicit: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """raw: [N, V] float32 logits; tokens: [N] int64 -> [N, 3 + 3k] float64. `explicit`:
    (rows, ids [E, M]) whose top columns are those ids (M <= k)."""
    lse = logsumexp(raw)
    tok_logit = raw.gather(1, tokens.unsqueeze(1))
    cols = [
        tokens.unsqueeze(1).double(),
        (tok_logit - lse).double(),
        _rank(raw, tok_logit).double(),
    ]
    if k > 0:
        top_v, top_i = raw.topk(k, dim=-1)
        ranks = torch.arange(1, k + 1, device=raw.device).expand(raw.shape[0], k)
        if explicit is not None:
            rows, ids = explicit
            sub = raw.index_select(0, rows)
            v = sub.gather(1, ids)
            m = ids.shape[1]
            ranks = ranks.clone()
            top_i[rows, :m], top_v[rows, :m] = ids, v
            ranks[rows, :m] = torch.cat([_rank(sub, v[:, j : j + 1]) for j in range(m)], dim=1)
        cols += [top_i.double(), (top_v - lse).double(), ranks.double()]
    return torch.cat(cols, dim=1)


def gather_logprobs(
    raw: Tensor,
    tokens: Tensor,
    max_k: int,
    logsumexp: LogSumExp = torch_logsumexp,
    explicit: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Logprob, rank and top-`max_k` (or a row's explicit ids) of each row's sampled token,
    packed."""
    return _pack(raw, tokens, min(max_k, raw.shape[1]), logsumexp, explicit)


def prompt_logprobs(
    logits: Tensor, targets: Tensor, k: int, logsumexp: LogSumExp = torch_logsumexp
) -> Tensor:
    """Packed rows for prompt positions: logits [P, V] at positions p, targets [P] the prompt
    token at p + 1."""
    raw = logits.float()
    targets = targets.to(device=raw.device, dtype=torch.long)
    return _pack(raw, targets, min(k, raw.shape[1]), logsumexp)


def unpack(packed: Tensor, ks: list[int | None] | None = None) -> LogprobsLists:
    """Host lists from packed rows (the worker's host copy: read once); `ks[i]` trims row i's
    top (None or 0: none). Each block becomes Python lists in one conversion, each row's top in
    one zip."""
    rows = (packed if packed.device.type == "cpu" else packed.cpu()).numpy()
    k_max = (rows.shape[1] - 3) // 3 if rows.ndim == 2 else 0
    out = LogprobsLists(
        rows[:, 0].astype(np.int64).tolist(),
        rows[:, 1].tolist(),
        rows[:, 2].astype(np.int64).tolist(),
        [],
    )
    if k_max == 0:
        out.top = [[] for _ in range(rows.shape[0])]
        return out
    ids = rows[:, 3 : 3 + k_max].astype(np.int64).tolist()
    lps = rows[:, 3 + k_max : 3 + 2 * k_max].tolist()
    ranks = rows[:, 3 + 2 * k_max :].astype(np.int64).tolist()
    for i in range(rows.shape[0]):
        k = k_max if ks is None else min(ks[i] or 0, k_max)
        out.top.append(list(zip(ids[i][:k], lps[i][:k], ranks[i][:k])))
    return out


def log_softmax_topk(
    logits: Tensor, k: int, logsumexp: LogSumExp = torch_logsumexp
) -> tuple[Tensor, Tensor]:
    """The k most likely tokens per row under the raw distribution, best first.
    logits: [N, V] -> (logprobs [N, k] float32, token ids [N, k] int64). For beam search."""
    raw = logits.float()
    values, ids = raw.topk(min(k, raw.shape[1]), dim=-1)
    return values - logsumexp(raw), ids
