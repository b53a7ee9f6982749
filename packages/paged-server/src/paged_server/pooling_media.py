"""Images in the pooling APIs (embeddings.py: /v1/embeddings and /pooling; scores.py: /score
and /rerank), in the request shapes of vLLM's server, turned into engine prompts whose images
are fetched, decoded and processed on the request's thread (as chat completions do: app.py).

    chat form    {"messages": [{"role": "user", "content": [{"type": "image_url", ...},
                 {"type": "text", ...}]}]}: the chat template renders the conversation (CLIP
                 and SigLIP, which ship none, take vLLM's fallback: each message's content in
                 turn, an image writing nothing), the image parts become the prompt's images.
    score side   vLLM's ScoreMultiModalParam {"content": [parts]} beside plain strings: one
                 query or document of text and image_url parts; its text is each image's
                 placeholder (none for CLIP / SigLIP) then the text parts joined by newlines,
                 as vLLM's score parser writes it (no separator after the placeholders).

A cross-encoder with images (jina-reranker-m0) reads a pair through its own score template
(paged_engine/jina_vl_scoring.py, the same function LLM.score calls); an embedding model embeds
each side alone (LLM.embed's `{"prompt": text, "multi_modal_data": {"image": img}}`).
Every failure is a 400 naming where the input was (`documents[1].content[0].image_url`).
No torch here: images go through the engine's processors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paged_server.chat_messages import _content_parts
from paged_server.errors import bad_request
from paged_server.media import MediaRef

if TYPE_CHECKING:
    from paged_server.app import OpenAIApp
    from paged_server.openai_protocol import GenerationRequest


@dataclass(slots=True)
class MediaSide:
    """A score side given as `{"content": [parts]}`: its text parts joined by newlines, its
    image parts in order, and the parts as sent (a rerank result shows them)."""

    text: str
    refs: list[MediaRef]
    content: list
    param: str  # "documents[1]"


def parse_side(value: Any, param: str, takes_images: bool) -> MediaSide:
    """One `{"content": [text / image_url parts]}` side (400 naming `param` otherwise; a model
    without images refuses the form by name, as vLLM does)."""
    if not takes_images:
        raise bad_request(
            f"{param}: multimodal inputs ({{'content': [...]}}) are not supported: this model "
            "takes text only; send a string",
            param,
        )
    unknown = sorted(set(value) - {"content"})
    if unknown:
        raise bad_request(f"{param}.{unknown[0]} is not supported (only 'content')", param)
    content = value.get("content")
    if not isinstance(content, list) or not content:
        raise bad_request(f"{param}.content must be a non-empty list of parts", param)
    refs: list[MediaRef] = []
    parts = _content_parts(param, "user", content, refs)
    other = next((r for r in refs if r.kind != "image" or r.embeds is not None), None)
    if other is not None:
        raise bad_request(
            f"{other.param}: a score side takes 'text' and 'image_url' parts only", other.param
        )
    texts = [p["text"] for p in parts if p["type"] == "text"] if isinstance(parts, list) else []
    text = "\n".join(texts) if isinstance(parts, list) else parts
    return MediaSide(text, refs, content, param)


def load_images(app: OpenAIApp, side: MediaSide) -> list[Any]:
    """The side's images, fetched and decoded; a 400 over --limit-mm-per-prompt."""
    app._check_media_kinds(side.refs)
    return app.media.load_all(side.refs)


def processed_prompt(app: OpenAIApp, ids: list[int], images: list[Any], param: str) -> dict:
    """An engine prompt of `ids` (each image's placeholder once) and its images: the runs
    expanded and the images processed here; the engine's refusals (a text beside a CLIP image,
    more images than the model takes) a 400 naming `param`."""
    if not images:
        check_media_length(app, ids, param)
        return {"prompt_token_ids": ids}
    try:
        expanded, items = app.multimodal(ids, {"image": images}, None)
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param) from None
    check_media_length(app, expanded, param)
    return {"prompt_token_ids": list(expanded), "multi_modal_data": {"image": list(items)}}


def side_prompt(app: OpenAIApp, side: MediaSide) -> dict:
    """An embedding model's prompt for one side: the model's placeholder text per image (none
    for CLIP / SigLIP), then the side's text, tokenized as a prompt (special tokens added)."""
    from paged_engine.multimodal.chat_format import media_placeholders

    images = load_images(app, side)
    marks = media_placeholders(app.tokenizer, app.images)
    text = "".join(marks.text("image", n + 1) or "" for n in range(len(images))) + side.text
    return processed_prompt(app, app._encode(text, True), images, side.param)


def chat_prompt(
    app: OpenAIApp, req: GenerationRequest, special: bool, truncate: int | None
) -> dict | list[int]:
    """The chat form's one pooled input: its token ids when it holds no media (the caller
    checks and truncates them), else an engine prompt with its processed images."""
    ids = app._chat_ids(req, special)[1]
    if not req.media_refs:
        return ids
    if _unmarked(app) and all(r.kind == "image" and r.embeds is None for r in req.media_refs):
        # the prompt holds no image marker (CLIP, SigLIP): the processor places the image
        app._check_media_kinds(req.media_refs)
        ids, req.processed_media = app._process_media(req, ids)
    else:
        ids = app._expand_media(req, ids)
    if truncate is not None and 0 < truncate < len(ids):
        raise bad_request(
            "'truncate_prompt_tokens' would cut a prompt with images (an image's tokens are "
            "kept whole): send a shorter conversation or no truncation",
            "truncate_prompt_tokens",
        )
    mm = req.processed_media
    if mm is None:
        ids, mm = app._process_media(req, ids)
    check_media_length(app, ids, "messages")
    return {"prompt_token_ids": ids, "multi_modal_data": mm}


def _unmarked(app: OpenAIApp) -> bool:
    """Whether the model's image placeholder text is nothing (vLLM's get_placeholder_str None)."""
    from paged_engine.multimodal.chat_format import media_placeholders

    return (
        app.images is not None
        and media_placeholders(app.tokenizer, app.images).text("image", 1) is None
    )


def check_media_length(app: OpenAIApp, ids: list[int], param: str) -> None:
    if len(ids) > app.max_model_len:  # a pooling prompt may fill the context
        raise bad_request(
            f"{param} has {len(ids)} tokens with its images; this model's maximum context "
            f"length is {app.max_model_len}",
            param,
        )
