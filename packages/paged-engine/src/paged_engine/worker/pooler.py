"""Pool a step's final hidden states for the embedding requests in it (paged_engine/pooling.py).

    batch row i computes prompt positions [start, end) at hidden rows [cu[i], cu[i] + end - start)

LAST sends the hidden state of position num_prompt - 1 when the step computes it; MEAN sends
the sum over [start, end) and its length, so chunked prefills add up on the host. Vectors are
float32 whatever the model dtype.
"""

from __future__ import annotations

import numpy as np
import torch

# (seq_id, first prompt position, number of positions, vector [hidden_size] float32)
PooledChunk = tuple[int, int, int, torch.Tensor]


def pool_hidden(batch, sched, cached, inputs, hidden: torch.Tensor) -> list[PooledChunk]:
    out: list[PooledChunk] = []
    for i in np.flatnonzero(batch.pooling[inputs.rows]).tolist():
        c = cached[i]
        start = sched.start_positions[i]
        end = min(start + sched.num_new_tokens[i], c.num_prompt_tokens)
        if end <= start:  # a decode step (the throwaway token): nothing to pool
            continue
        lo = int(inputs.cu[i])
        if c.params.pooling_type == "LAST":
            if end == c.num_prompt_tokens:
                out.append((c.seq_id, end - 1, 1, hidden[lo + end - 1 - start].float()))
        else:
            rows = hidden[lo : lo + end - start]
            out.append((c.seq_id, start, end - start, rows.float().sum(0)))
    return out
