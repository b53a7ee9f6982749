"""Scores of text pairs (vLLM's `LLM.score` and score / rerank APIs). An embedding model scores
a pair by the cosine similarity of the two texts' pooled embeddings; a single-label sequence
classifier (a cross-encoder, classification.py) reads the pair as one prompt and scores it by
its head's activated logit.

    pairs: 1:1 (one pair), 1:N (one query against N documents), N:N (pair i with pair i)

Each distinct side is embedded once (a 1:N query runs once, not N times), as ordinary pooling
requests (pooling.py), so scoring batches, chunks and prefix-caches like embedding. A pair's
`prompt_token_ids` are the first text's, the tokenizer's pad token when it has one, then the
second's: what vLLM reports for an embedding model's pair (its token usage counts them so). A
cross-encoder's pair prompt is the tokenizer's encoding of the text pair (`text_pair`: its own
special tokens between and around them), or two token-id lists joined.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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
    num_cached_tokens: int = 0  # both texts' (an embedding model's), or the pair prompt's


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
                num_cached_tokens=a.num_cached_tokens + b.num_cached_tokens,
            )
        )
    return out


def pair_prompt(
    tokenizer: Any,
    first: Any,
    second: Any,
    names: tuple[str, str],
    max_length: int | None = None,
) -> list[int]:
    """A cross-encoder's prompt for one pair: two texts encoded as a text pair, or two token-id
    lists (or {"prompt_token_ids": ...} dicts) joined; ValueError naming the second side when
    the two are given differently. `max_length` (a resolved truncate_prompt_tokens): the
    tokenizer truncates a text pair to it (HF's longest_first, its special tokens kept, as
    vLLM's get_score_prompt); token ids are left to the caller's slice."""
    a, b = _pair_side(first), _pair_side(second)
    if isinstance(a, str) and isinstance(b, str):
        cut = {} if max_length is None else {"truncation": True, "max_length": max_length}
        return list(tokenizer(a, text_pair=b, **cut)["input_ids"])
    if isinstance(a, list) and isinstance(b, list):
        return a + b
    raise ValueError(
        f"{names[1]}: a cross-encoder scores a pair of texts or a pair of token-id lists, not "
        "one of each"
    )


def _pair_side(prompt: Any) -> str | list[int] | None:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        prompt = prompt.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    return None


def cross_encoder_scores(
    outs: Sequence[PoolingRequestOutput], pair_ids: Sequence[list[int]]
) -> list[ScoringRequestOutput]:
    """One `ScoringRequestOutput` per pair prompt: its single (activated) logit."""
    return [
        ScoringRequestOutput(
            o.request_id,
            ScoringOutput(float(o.outputs.data[0])),
            list(ids),
            num_cached_tokens=o.num_cached_tokens,
        )
        for o, ids in zip(outs, pair_ids, strict=True)
    ]
