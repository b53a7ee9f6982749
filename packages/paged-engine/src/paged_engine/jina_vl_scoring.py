"""The pair prompt of jina-reranker-m0 (`JinaVLForRanking`, vLLM's
`JinaVLForSequenceClassification`), a Qwen2-VL cross-encoder (models/jina_vl_ranker.py).

vLLM's `LLM.score` (and /score, /rerank) formats a (query, document) pair with the model's
score template, document first, tokenizes it as one text (the tokenizer's own special tokens)
and appends the score token, id 100, whose last hidden state the head reads:

    "**Document**:\\n{document}\\n**Query**:\\n{query}"  ->  token ids + [100]

A side with images (`{"prompt": text, "multi_modal_data": {"image": image or [images]}}`,
the form of vLLM's jinavl_reranker example) reads as one Qwen2-VL placeholder per image, then
its text; the pair's images go in prompt order (the document's, then the query's), to be
expanded into their runs by the engine's image path (multimodal/qwen2_vl.py). Token-id sides
and vLLM's `ScoreMultiModalParam` ("content" parts) are refused by name. No torch here:
paged-server imports this module.
"""

from __future__ import annotations

from typing import Any

WRAPPER = "JinaVLForRanking"  # the release's config.json architecture
ARCH = "JinaVLForSequenceClassification"  # our text model's (vLLM's class name)
SCORE_TOKEN_ID = 100  # appended to every pair prompt: its row is scored
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def serves(classifier: Any) -> bool:
    """Whether the engine's classifier (classification.ClassifierInfo) is this model."""
    return classifier is not None and classifier.architecture == ARCH


def check_pooler_config(pooler_config: dict | None) -> None:
    """The head is an MLP on the score token's row: only LAST pooling reads it (ValueError
    naming the field otherwise)."""
    kind = str((pooler_config or {}).get("pooling_type", "LAST")).upper()
    if kind != "LAST":
        raise ValueError(
            f"pooler_config.pooling_type={kind!r} is not supported for {WRAPPER}: its head "
            "reads the last token (the score token) alone; use 'LAST'"
        )


def pair_prompt(
    tokenizer: Any, query: Any, document: Any, names: tuple[str, str]
) -> tuple[list[int], list[Any]]:
    """(token ids, images in prompt order) of one (query, document) pair; `names` are the
    two sides' parameter names for errors."""
    q_text, q_images = _side(query, names[0])
    d_text, d_images = _side(document, names[1])
    text = f"**Document**:\n{d_text}\n**Query**:\n{q_text}"
    ids = list(tokenizer(text)["input_ids"]) + [SCORE_TOKEN_ID]
    return ids, d_images + q_images


def pair_request(tokenizer: Any, query: Any, document: Any, names: tuple[str, str]) -> dict:
    """`pair_prompt` as an engine prompt: token ids, and the images when there are any."""
    ids, images = pair_prompt(tokenizer, query, document, names)
    return {"prompt_token_ids": ids, **({"multi_modal_data": {"image": images}} if images else {})}


def _side(prompt: Any, name: str) -> tuple[str, list[Any]]:
    if isinstance(prompt, str):
        return prompt, []
    if not isinstance(prompt, dict):
        raise ValueError(
            f"{name}: {WRAPPER} scores texts or {{'prompt': ..., 'multi_modal_data': "
            f"{{'image': ...}}}} dicts, not {type(prompt).__name__}"
        )
    unknown = sorted(set(prompt) - {"prompt", "multi_modal_data"})
    if unknown:
        raise ValueError(
            f"{name}: {unknown} not supported for {WRAPPER} (token ids and ScoreMultiModalParam "
            "content parts are not taken): give 'prompt' and / or 'multi_modal_data'"
        )
    text = prompt.get("prompt", "")
    if not isinstance(text, str):
        raise ValueError(f"{name}: 'prompt' must be a str, got {type(text).__name__}")
    mm = prompt.get("multi_modal_data") or {}
    if not isinstance(mm, dict) or set(mm) - {"image"}:
        got = sorted(mm) if isinstance(mm, dict) else type(mm).__name__
        raise ValueError(f"{name}: multi_modal_data takes 'image' only for {WRAPPER}, got {got}")
    images = mm.get("image", [])
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    if not text and not images:
        raise ValueError(f"{name}: an empty side (no text, no image)")
    return PLACEHOLDER * len(images) + text, images
