"""Verify draft tokens against the target model in one pass over every position of a step.

Layout: a sequence with d drafts owns d + 1 consecutive rows (positions). Row j < d holds the
target's distribution p_j at the position whose next token is draft j; row d is the bonus
position after the last draft. A sequence without drafts owns one row (plain sampling).

The rule (speculative sampling): q_j is the distribution draft j was drawn from (a draft
model's processed distribution; for n-gram lookup a point mass on the draft)

    greedy rows:  accept draft j while argmax p_j == draft j
    random rows:  accept draft j with probability min(1, p_j(draft j) / q_j(draft j))
    the first rejected row j emits a token from norm(max(0, p_j - q_j)) (for a point mass:
    p_j with the draft removed); when all d are accepted, row d emits a token from p_d

so every emitted token has exactly the target's distribution, and greedy rows emit exactly the
tokens non-speculative greedy decoding would. One Exp(1) noise row per position serves both
draws: u = exp(-E[draft]) is the acceptance uniform, and argmax(r / E) over the residual r is the
residual sample. A rejected draft has r[draft] = 0 (rejection needs p < q there), so the residual
race uses only the other entries, which are independent of E[draft]. The draft itself must have
been drawn with noise independent of this row (the draft model's own draw).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(slots=True)
class Verified:
    """Per position the token it would emit (the draft where accepted, else the sample) and,
    per sequence, how many drafts were accepted (host array)."""

    tokens: Tensor  # [P] int64, on the device
    num_accepted: np.ndarray  # [S] int64


def verify(
    processed: Tensor,  # [P, V] logits after every logits processor (temperature included)
    drafts: Tensor,  # [P] int64: the draft whose probability row j judges, -1 on bonus rows
    greedy: Tensor | None,  # [P] bool (None: every row greedy)
    noise: Tensor | None,  # [P, V] Exp(1) noise (None when every row is greedy)
    num_drafts: np.ndarray,  # [S] drafts per sequence, rows laid out as above
    draft_probs: Tensor | None = None,  # [P, V] q of each draft row (None: point masses)
) -> Verified:
    best = processed.max(dim=-1).indices  # the first maximal index, as the plain sampler
    has_draft = drafts >= 0
    d = drafts.clamp(min=0).unsqueeze(1)
    if noise is None:
        accept = (best == drafts) & has_draft
        tokens = best
    else:
        probs = processed.softmax(dim=-1)
        u = noise.gather(1, d).squeeze(1).neg().exp()
        p_draft = probs.gather(1, d).squeeze(1)
        if draft_probs is None:
            accept_random = u < p_draft
            # The residual: p without the draft (rows without a draft keep all of p).
            kept = torch.where(has_draft, 0.0, p_draft)
            probs.scatter_(1, d, kept.unsqueeze(1))
        else:
            accept_random = u * draft_probs.gather(1, d).squeeze(1) < p_draft
            residual = (probs - draft_probs).clamp_(min=0.0)
            # p == q up to rounding leaves no residual mass (and no rejection to speak of).
            usable = has_draft & (residual.sum(dim=-1) > 0)
            probs = torch.where(usable.unsqueeze(1), residual, probs)
        sampled = probs.div_(noise).max(dim=-1).indices
        if greedy is None:
            greedy = torch.zeros_like(has_draft)
        accept = torch.where(greedy, best == drafts, accept_random) & has_draft
        tokens = torch.where(greedy, best, sampled)
    tokens = torch.where(accept, drafts, tokens)
    return Verified(tokens, leading_accepts(accept.cpu().numpy(), num_drafts))


def leading_accepts(accept: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """Per sequence, how many of its drafts were accepted before the first rejection."""
    out = np.zeros(num_drafts.size, dtype=np.int64)
    start = 0
    for i, d in enumerate(num_drafts.tolist()):
        if d:
            seg = accept[start : start + d]
            out[i] = d if seg.all() else int(np.argmin(seg))
        start += d + 1
    return out
