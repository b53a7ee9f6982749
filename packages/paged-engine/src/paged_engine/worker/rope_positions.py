"""The positions a step's tokens rotate by, where a prompt's images have M-RoPE positions.

    sequence position p of a sequence with an M-RoPE table (multimodal/qwen2_vl.py):
        p < table.first            p            (text before the first image: 1-D)
        table.first <= p < prompt  table[:, p]  (images and the text after them: 3 rows)
        p >= prompt                p + delta    (generated tokens: 1-D, shifted)

A step whose tokens all fall in the 1-D cases gets [T] positions (CUDA graphs and compiled
forwards serve it as any step); a step with a token of the middle case gets [3, T] (the other
sequences' rows repeated three times), which the runner runs eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from paged_engine.multimodal.mrope import MropePositions


def rope_positions(
    tables: dict[int, MropePositions],
    seq_ids: Sequence[int],
    starts: np.ndarray,
    cu: np.ndarray,
    positions: np.ndarray,
) -> np.ndarray | None:
    """[T] or [3, T] rope positions of the step, or None where they are `positions` itself
    (no sequence of the step has a table)."""
    mine = [(i, tables[s]) for i, s in enumerate(seq_ids) if s in tables]
    if not mine:
        return None
    ends = [int(starts[i]) + int(cu[i + 1] - cu[i]) for i, _ in mine]
    three = any(
        int(starts[i]) < m.num_prompt and end > m.first
        for (i, m), end in zip(mine, ends, strict=True)
    )
    out = np.array(positions, dtype=np.int64)  # a copy: `positions` may alias `starts`
    if three:
        out = np.repeat(out[None], 3, axis=0)
    for (i, m), end in zip(mine, ends, strict=True):
        start, a = int(starts[i]), int(cu[i])
        past = max(start, m.num_prompt)  # the first generated position this step
        if past < end:
            out[..., a + past - start : a + end - start] += m.delta
        lo, hi = max(start, m.first), min(end, m.num_prompt)
        if lo < hi:
            out[:, a + lo - start : a + hi - start] = m.table[:, lo:hi]
    return out
