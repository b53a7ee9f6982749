"""How far each token of a step may look ahead: Gemma 3's images attend both ways at prefill.

    a sequence's image spans [offset, end) (ImageInputs with `bidirectional`, multimodal/)
    a step token at position p:   key end = end    if p lies in a span
                                            p + 1  otherwise (causal)

The attention backends read the ends as `AttentionMetadata.key_ends` (attention/backend.py).
The scheduler never ends a step inside such a span (core/token_plan.py `whole_images`), so
every key a token may see is in the cache or this step. A sequence's spans go once its prefill
is past them: decode steps build nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from paged_engine.multimodal.inputs import ImageInput


class ImageSpans:
    """Seq id -> its prompt's bidirectional image spans that have yet to run (every rank)."""

    def __init__(self) -> None:
        self.spans: dict[int, list[tuple[int, int]]] = {}

    def add(self, seq_id: int, images: Iterable[ImageInput]) -> None:
        spans = sorted({m.two_way for m in images if m.two_way is not None})
        if spans:
            self.spans[seq_id] = spans

    def remove(self, seq_id: int) -> None:
        self.spans.pop(seq_id, None)

    def key_ends(
        self,
        seq_ids: Sequence[int],
        starts: np.ndarray,
        num_new: np.ndarray,
        cu: np.ndarray,
        positions: np.ndarray,
    ) -> np.ndarray | None:
        """[T] int32 key ends of the step, or None when no token of a span runs in it."""
        if not self.spans:
            return None
        out: np.ndarray | None = None
        for i, seq_id in enumerate(seq_ids):
            spans = self.spans.get(seq_id)
            if spans is None:
                continue
            start, end = int(starts[i]), int(starts[i] + num_new[i])
            for offset, span_end in spans:
                lo, hi = max(offset, start), min(span_end, end)
                if lo < hi:
                    if out is None:
                        out = (positions + 1).astype(np.int32)
                    a = int(cu[i]) + lo - start
                    out[a : a + hi - lo] = span_end
            if end >= spans[-1][1]:  # past its last image: nothing more to do
                del self.spans[seq_id]
        return out
