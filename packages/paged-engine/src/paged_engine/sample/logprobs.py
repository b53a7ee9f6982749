"""Raw-distribution logprobs on the device, packed for one transfer, and unpacked on the host.

A packed row is float64 (exact for token ids):

    | token id | logprob | rank | top-k ids (k) | top-k logprobs (k) |

`rank` is 1 for the most likely token. The top-k columns are best first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from paged_engine.core.core_output import LogprobsLists

# [N, V] -> [N, 1] float32 log-sum-exp of each row: torch's, or under batch_invariant=True one
# with a fixed reduction order (layers/batch_invariant.py: invariant_logsumexp).
LogSumExp = Callable[[Tensor], Tensor]


def torch_logsumexp(raw: Tensor) -> Tensor:
    return raw.logsumexp(dim=-1, keepdim=True)


def _pack(raw: Tensor, tokens: Tensor, k: int, logsumexp: LogSumExp) -> Tensor:
    """raw: [N, V] float32 logits; tokens: [N] int64 -> [N, 3 + 2k] float64."""
    lse = logsumexp(raw)
    tok_logit = raw.gather(1, tokens.unsqueeze(1))
    cols = [tokens.unsqueeze(1).double(), (tok_logit - lse).double()]
    cols.append(((raw > tok_logit).sum(dim=-1, keepdim=True) + 1).double())
    if k > 0:
        top_v, top_i = raw.topk(k, dim=-1)
        cols += [top_i.double(), (top_v - lse).double()]
    return torch.cat(cols, dim=1)


def gather_logprobs(
    raw: Tensor, tokens: Tensor, max_k: int, logsumexp: LogSumExp = torch_logsumexp
) -> Tensor:
    """Logprob, rank and top-`max_k` of each row's sampled token, packed."""
    return _pack(raw, tokens, min(max_k, raw.shape[1]), logsumexp)


def prompt_logprobs(
    logits: Tensor, targets: Tensor, k: int, logsumexp: LogSumExp = torch_logsumexp
) -> Tensor:
    """Packed rows for prompt positions: logits [P, V] at positions p, targets [P] the prompt
    token at p + 1."""
    raw = logits.float()
    targets = targets.to(device=raw.device, dtype=torch.long)
    return _pack(raw, targets, min(k, raw.shape[1]), logsumexp)


def unpack(rows: list[list[float]], ks: list[int | None] | None = None) -> LogprobsLists:
    """Host lists from packed rows; `ks[i]` trims row i's top-k (None or 0: none)."""
    width = len(rows[0]) if rows else 3
    k_max = (width - 3) // 2
    out = LogprobsLists([], [], [], [])
    for i, row in enumerate(rows):
        out.token_ids.append(int(row[0]))
        out.logprobs.append(row[1])
        out.ranks.append(int(row[2]))
        k = k_max if ks is None else min(ks[i] or 0, k_max)
        out.top.append(
            [(int(t), lp) for t, lp in zip(row[3 : 3 + k], row[3 + k_max : 3 + k_max + k])]
        )
    return out


def log_softmax_topk(
    logits: Tensor, k: int, logsumexp: LogSumExp = torch_logsumexp
) -> tuple[Tensor, Tensor]:
    """The k most likely tokens per row under the raw distribution, best first.
    logits: [N, V] -> (logprobs [N, k] float32, token ids [N, k] int64). For beam search."""
    raw = logits.float()
    values, ids = raw.topk(min(k, raw.shape[1]), dim=-1)
    return values - logsumexp(raw), ids
