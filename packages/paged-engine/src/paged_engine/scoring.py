"""Scores of text pairs from embeddings (vLLM's `LLM.score` and score / rerank APIs for an
embedding model): the cosine similarity of the two texts' pooled embeddings.

    pairs: 1:1 (one pair), 1:N (one query against N documents), N:N (pair i with pair i)

Each distinct side is embedded once (a 1:N query runs once, not N times), as ordinary pooling
requests (pooling.py), so scoring batches, chunks and prefix-caches like embedding. A pair's
`prompt_token_ids` are the first text's, the tokenizer's pad token when it has one, then the
second's: what vLLM reports for an embedding model's pair (its token usage counts them so).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paged_engine.pooling import PoolingRequestOutput


@dataclass(slots=True)
class ScoringOutput:
    score: float


@dataclass(slots=True)
class ScoringRequestOutput:
    """vLLM's `ScoringRequestOutput` (`LLM.score`): `outputs.score` is a float."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


def pair_indices(num_1: int, num_2: int, names: tuple[str, str]) -> list[tuple[int, int]]:
    """(index into the first side, index into the second) per pair; ValueError naming the side
    unless the counts are 1:1, 1:N or N:N."""
    if num_1 == 0:
        raise ValueError(f"{names[0]} must hold at least one text")
    if num_2 == 0:
        raise ValueError(f"{names[1]} must hold at least one text")
    if num_1 == 1:
        return [(0, j) for j in range(num_2)]
    if num_1 != num_2:
        raise ValueError(
            f"{names[0]} has {num_1} texts and {names[1]} {num_2}: pair them 1:1, 1:N or N:N"
        )
    return [(i, i) for i in range(num_1)]


def cosine_scores(
    first: Sequence[PoolingRequestOutput],
    second: Sequence[PoolingRequestOutput],
    pairs: Sequence[tuple[int, int]],
    pad_token_id: int | None,
) -> list[ScoringRequestOutput]:
    """One `ScoringRequestOutput` per pair: the cosine similarity of the pooled vectors (float32,
    as torch's `cosine_similarity` with eps 1e-8: vLLM's scorer)."""
    import torch  # here: paged-server imports this module and must not load torch at start

    sep = [] if pad_token_id is None else [pad_token_id]
    out = []
    for i, j in pairs:
        a, b = first[i], second[j]
        score = torch.nn.functional.cosine_similarity(
            a.outputs.data.float(), b.outputs.data.float(), dim=0, eps=1e-8
        )
        out.append(
            ScoringRequestOutput(
                f"{a.request_id}_{b.request_id}",
                ScoringOutput(float(score)),
                list(a.prompt_token_ids) + sep + list(b.prompt_token_ids),
            )
        )
    return out
