"""Pool a step's final hidden states for the embedding requests in it (paged_engine/pooling.py).

    batch row i computes prompt positions [start, end) at hidden rows [cu[i], cu[i] + end - start)

LAST sends the hidden state of position num_prompt - 1 when the step computes it (CLS: of
position 0); MEAN sends the sum over [start, end) and its length, so chunked prefills add up
on the host; ALL (the token tasks) sends the rows of [start, end) themselves. Vectors are
float32 whatever the model dtype. A classification request (params.classify) pools the logits of
the model's head (`classify`: [n, D] -> [n, num_labels], in the model dtype) at those positions.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

# (seq_id, first prompt position, number of positions, vector [hidden_size] float32; ALL:
# the rows [positions, hidden_size])
PooledChunk = tuple[int, int, int, torch.Tensor]


def pool_hidden(
    batch,
    sched,
    cached,
    inputs,
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[PooledChunk]:
    """`head`: the model's classifier head, for the requests that classify."""
    out: list[PooledChunk] = []
    for i in np.flatnonzero(batch.pooling[inputs.rows]).tolist():
        c = cached[i]
        start = sched.start_positions[i]
        end = min(start + sched.num_new_tokens[i], c.num_prompt_tokens)
        if end <= start:  # a decode step (the throwaway token): nothing to pool
            continue
        lo = int(inputs.cu[i])
        kind = c.params.pooling_type
        if (kind == "LAST" and end < c.num_prompt_tokens) or (kind == "CLS" and start > 0):
            continue  # the pooled position comes in another chunk
        if kind in ("MEAN", "ALL"):
            first, count = start, end - start
        else:
            first, count = (end - 1 if kind == "LAST" else 0), 1
        rows = hidden[lo + first - start : lo + first - start + count]  # [first, first + count)
        if c.params.classify:
            assert head is not None, "a classification request on a model without a classifier"
            if c.params.head_after_pooling:  # a whole encoder sequence: its mean, then the head
                rows = rows.mean(0, keepdim=True)
            rows = head(rows)
        out.append((c.seq_id, first, count, rows.float() if kind == "ALL" else rows.float().sum(0)))
    return out
