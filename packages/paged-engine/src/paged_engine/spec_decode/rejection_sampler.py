"""Verify draft tokens against the target model in one pass over every position of a step.

Layout: a sequence with d drafts owns d + 1 consecutive rows (positions). Row j < d holds the
target's distribution p_j at the position whose next token is draft j; row d is the bonus
position after the last draft. A sequence without drafts owns one row (plain sampling).

The rule (speculative sampling with a deterministic proposal, q = a point mass on the draft):

    greedy rows:  accept draft j while argmax p_j == draft j
    random rows:  accept draft j with probability p_j(draft j)
    the first rejected row j emits a token from p_j with the draft removed (renormalized);
    when all d are accepted, row d emits a token from p_d

so every emitted token has exactly the target's distribution, and greedy rows emit exactly the
tokens non-speculative greedy decoding would. One Exp(1) noise row per position serves both
draws: u = exp(-E[draft]) is the acceptance uniform, and argmax(p / E) over the other tokens (the
draft excluded) is the residual sample: disjoint entries of one noise row are independent.
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
        accept_random = u < probs.gather(1, d).squeeze(1)
        # The residual: p without the draft (rows without a draft keep all of p).
        kept = torch.where(has_draft, 0.0, probs.gather(1, d).squeeze(1))
        probs.scatter_(1, d, kept.unsqueeze(1))
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
