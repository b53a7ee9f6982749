"""vLLM's score and rerank APIs (paged_engine/scoring.py): for an embedding model the cosine
similarity of two texts' embeddings, pooled as `/v1/embeddings` pools them; for a single-label
sequence classifier (a cross-encoder / reranker) its activated logit for the pair read as one
prompt (the tokenizer's text-pair encoding).

    POST /score, /v1/score
        {"model", "queries": str | [str], "documents": str | [str]}   (or "queries" + "items",
        "data_1" + "data_2", "text_1" + "text_2": vLLM's older names), paired 1:1, 1:N or N:N
    -> {"id", "object": "list", "created", "model",
        "data": [{"index": i, "object": "score", "score": s}], "usage": {...}}

    POST /rerank, /v1/rerank, /v2/rerank      (Jina's and Cohere's shape)
        {"model", "query": str, "documents": str | [str], "top_n": k, "return_documents": bool}
    -> {"id", "model", "usage": {"prompt_tokens", "total_tokens"},
        "results": [{"index": i, "document": {"text"}, "relevance_score": s}]}   best first

A side may also be vLLM's ScoreMultiModalParam, `{"content": [text / image_url parts]}` (one
query or document; a list mixes them with strings) where the model takes images: an embedding
model (CLIP, SigLIP) embeds it alone, jina-reranker-m0 reads it into its pair prompt
(pooling_media.py); a rerank result then shows it as `{"document": {"multi_modal": parts}}`.
A model without images refuses the form by name.

An embedding model pools every distinct text once (a query scored against N documents runs
once); a cross-encoder runs one request per pair. Common extras: `truncate_prompt_tokens` (k
tokens of each text, or of each pair for a cross-encoder, on the tokenizer's truncation side:
the first k on a pooling-only engine, as vLLM; -1: as many as fit),
`priority`, `user` (ignored), `use_activation` (false: a cross-encoder's raw logit; no effect on
a cosine). Token usage counts each pair as vLLM does: an embedding model's both texts and the pad
token between them, a cross-encoder's pair prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paged_engine import jina_vl_scoring
from paged_engine.pooling import PoolingParams, truncation_limit
from paged_engine.scoring import cosine_scores, cross_encoder_scores, pair_indices, pair_prompt
from paged_server.embeddings import (
    list_answer,
    parse_priority,
    parse_request_id,
    parse_truncate,
    pooling_off,
    prompt_tokens,
    run_pooling,
    truncated_tokens,
)
from paged_server.errors import bad_request
from paged_server.openai_protocol import check_defaults
from paged_server.pooling_media import (
    MediaSide,
    load_images,
    parse_side,
    processed_prompt,
    side_prompt,
)

if TYPE_CHECKING:
    from paged_server.app import OpenAIApp
    from paged_server.http import Handler

# The names a score request may give its two sides, newest first (vLLM accepts each pair).
SCORE_SIDES = (
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
    ("text_1", "text_2"),
)
_COMMON = frozenset(
    {"model", "user", "truncate_prompt_tokens", "priority", "use_activation", "request_id"}
)
# vLLM's ScoringRequestMixin fields accepted at their defaults only (POOLING_OFF)
_SCORE_OFF = pooling_off(
    "padding",
    "truncation_side",
    "cache_salt",
    "mm_processor_kwargs",
    "max_tokens_per_query",
    "max_tokens_per_doc",
)
_SCORE_FIELDS = _COMMON | {name for pair in SCORE_SIDES for name in pair}
_RERANK_FIELDS = _COMMON | {"query", "documents", "top_n", "return_documents"}


@dataclass(slots=True)
class ScoreRequest:
    model: str | None
    first: list[str | MediaSide]
    second: list[str | MediaSide]
    names: tuple[str, str]  # what the client called the two sides (for errors)
    truncate_prompt_tokens: int | None
    priority: int
    top_n: int = 0  # rerank: the best k results; 0 = all
    return_documents: bool = True
    use_activation: bool | None = None
    request_id: str | None = None


def check_fields(
    body: Any, allowed: frozenset[str], route: str, off: dict[str, tuple] = _SCORE_OFF
) -> dict:
    """A pooling route's body: an object of `allowed` fields (and of `off` ones at their
    defaults, POOLING_OFF), `model` a string and `use_activation` a boolean when given (400
    naming the first bad one)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed - off.keys())
    if unknown:
        raise bad_request(f"parameter '{unknown[0]}' is not supported by {route}", unknown[0])
    check_defaults(body, off)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    activation = body.get("use_activation")
    if activation is not None and not isinstance(activation, bool):
        raise bad_request("'use_activation' must be a boolean", "use_activation")
    return body


def _texts(value: Any, name: str, images: bool, *, single: bool = False) -> list[str | MediaSide]:
    """A side of the pairs: one string or `{"content": [parts]}` (`images`: whether the model
    takes that form), or (unless `single`) a non-empty list of them."""
    if isinstance(value, (str, dict)):
        value = [value]
    elif single or not isinstance(value, list) or not value:
        what = "a string" if single else "a string or a non-empty list of strings"
        raise bad_request(f"'{name}' must be {what} (or {{'content': [parts]}})", name)
    out: list[str | MediaSide] = []
    for i, item in enumerate(value):
        where = name if single else f"{name}[{i}]"
        if isinstance(item, dict):
            out.append(parse_side(item, where, images))
        elif isinstance(item, str):
            out.append(item)
        else:
            raise bad_request(f"{where} must be a string (or {{'content': [parts]}})", name)
    return out


def parse_score(body: Any, images: bool = False) -> ScoreRequest:
    body = check_fields(body, _SCORE_FIELDS, "/score")
    given = [pair for pair in SCORE_SIDES if pair[0] in body and pair[1] in body]
    if not given:
        raise bad_request(
            "give the two sides to score as 'queries' and 'documents' (or 'queries' and "
            "'items', 'data_1' and 'data_2', 'text_1' and 'text_2')",
            "queries" if "queries" not in body else "documents",
        )
    names = given[0]
    stray = sorted(n for pair in SCORE_SIDES for n in pair if n in body and n not in names)
    if stray:
        raise bad_request(
            f"'{stray[0]}' cannot be given with '{names[0]}' and '{names[1]}': name the two "
            "sides one way",
            stray[0],
        )
    first = _texts(body[names[0]], names[0], images)
    second = _texts(body[names[1]], names[1], images)
    _pairs(len(first), len(second), names)
    return ScoreRequest(
        body.get("model"),
        first,
        second,
        names,
        parse_truncate(body),
        parse_priority(body),
        use_activation=body.get("use_activation"),
        request_id=parse_request_id(body),
    )


def parse_rerank(body: Any, images: bool = False) -> ScoreRequest:
    body = check_fields(body, _RERANK_FIELDS, "/rerank")
    if "query" not in body:
        raise bad_request("'query' is required", "query")
    if "documents" not in body:
        raise bad_request("'documents' is required", "documents")
    query = _texts(body["query"], "query", images, single=True)
    documents = _texts(body["documents"], "documents", images)
    top_n = body.get("top_n", 0)
    if top_n is None:
        top_n = 0
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 0:
        raise bad_request("'top_n' must be an int >= 0 (0: every document)", "top_n")
    keep = body.get("return_documents", True)
    if keep is None:
        keep = True
    if not isinstance(keep, bool):
        raise bad_request("'return_documents' must be a boolean", "return_documents")
    return ScoreRequest(
        body.get("model"),
        query,
        documents,
        ("query", "documents"),
        parse_truncate(body),
        parse_priority(body),
        top_n,
        keep,
        body.get("use_activation"),
        parse_request_id(body),
    )


def _pairs(num_1: int, num_2: int, names: tuple[str, str]) -> list[tuple[int, int]]:
    try:
        return pair_indices(num_1, num_2, names)
    except ValueError as e:
        raise bad_request(str(e), names[1]) from None  # (empty sides were refused before)


def _scores(app: OpenAIApp, h: Handler, req: ScoreRequest, rid: str) -> tuple[str, list, int]:
    """(the served name, one ScoringRequestOutput per pair, prompt tokens by vLLM's count)."""
    model, lora = app._resolve(req.model)
    pairs = _pairs(len(req.first), len(req.second), req.names)
    if app.classifier is not None:
        return model, *_cross_encoder(app, h, req, rid, pairs, lora)
    ids = [
        side_prompt(app, text)
        if isinstance(text, MediaSide)
        else prompt_tokens(app, text, f"{name}[{i}]", req.truncate_prompt_tokens)
        for texts, name in ((req.first, req.names[0]), (req.second, req.names[1]))
        for i, text in enumerate(texts)
    ]
    outs = run_pooling(app, h, rid, ids, PoolingParams(), lora, req.priority)
    split = len(req.first)
    pad = getattr(app.tokenizer, "pad_token_id", None)
    scored = cosine_scores(outs[:split], outs[split:], pairs, pad)
    num_tokens = sum(len(s.prompt_token_ids) for s in scored)
    h.log_extra += f" prompt_tokens={num_tokens}"
    return model, scored, num_tokens


def _cross_encoder(
    app: OpenAIApp, h: Handler, req: ScoreRequest, rid: str, pairs: list, lora: Any
) -> tuple[list, int]:
    """A single-label classifier's scores: one pooling request per pair prompt."""
    info = app.classifier
    assert info is not None
    if info.per_token:  # (its own route: /pooling; /classify refuses it too)
        raise bad_request(
            f"this model ({info.architecture}) is a token classifier, it labels each token: it "
            "scores no pairs; use /pooling",
            "model",
        )
    if not info.scores:
        raise bad_request(
            f"this model classifies into {info.num_labels} labels: scoring pairs needs a "
            "single-label classifier (a cross-encoder); use /classify",
            "model",
        )
    jina = jina_vl_scoring.serves(info)
    sides = _loaded(app, req) if jina else {}
    ids: list[list[int] | dict] = []
    try:  # a text pair is cut by the tokenizer (vLLM)
        limit = truncation_limit(req.truncate_prompt_tokens, app.max_model_len)
    except ValueError as e:
        raise bad_request(str(e), "truncate_prompt_tokens") from None
    for k, (i, j) in enumerate(pairs):
        query, doc = req.first[i], req.second[j]
        media = [s for s in (doc, query) if isinstance(s, MediaSide)]
        if media and not jina:
            raise bad_request(
                f"{media[0].param}: {info.architecture} scores text pairs only (no images)",
                media[0].param,
            )
        with app.tok_lock:
            if jina:  # its template and score token; a side's images in prompt order
                try:
                    tokens, images = jina_vl_scoring.pair_prompt(
                        app.tokenizer, sides.get((0, i), query), sides.get((1, j), doc), req.names
                    )
                except ValueError as e:  # a side of nothing (no text, no image)
                    raise bad_request(str(e), req.names[1]) from None
            else:
                tokens = pair_prompt(app.tokenizer, query, doc, req.names, limit)
                images = []
        if media:  # its images' runs kept whole: no truncation
            ids.append(processed_prompt(app, tokens, images, media[0].param))
            continue
        tokens = truncated_tokens(app, tokens, req.truncate_prompt_tokens)
        if len(tokens) > app.max_model_len:  # a pooling prompt may fill the context
            raise bad_request(
                f"pair {k} ({req.names[0]}[{i}], {req.names[1]}[{j}]) has {len(tokens)} tokens; "
                f"this model's maximum context length is {app.max_model_len} (set "
                "truncate_prompt_tokens to keep the last tokens)",
                req.names[1],
            )
        ids.append(tokens)
    params = PoolingParams(use_activation=req.use_activation, task="score")
    outs = run_pooling(app, h, rid, ids, params, lora, req.priority)
    lists = [t["prompt_token_ids"] if isinstance(t, dict) else t for t in ids]
    scored = cross_encoder_scores(outs, lists)
    num_tokens = sum(len(t) for t in lists)
    h.log_extra += f" prompt_tokens={num_tokens}"
    return scored, num_tokens


def _loaded(app: OpenAIApp, req: ScoreRequest) -> dict[tuple[int, int], dict]:
    """Each `{"content"}` side of the request as jina_vl_scoring takes it (its images loaded
    once, however many pairs it is in), keyed by (side, index)."""
    out = {}
    for k, items in enumerate((req.first, req.second)):
        for i, side in enumerate(items):
            if isinstance(side, MediaSide):
                images = load_images(app, side)
                mm = {"multi_modal_data": {"image": images}} if images else {}
                out[k, i] = {"prompt": side.text, **mm}
    return out


def serve_score(app: OpenAIApp, h: Handler) -> None:
    req = parse_score(h.read_json(), app.images is not None)
    rid = f"score-{app.base_request_id(h, req.request_id)}"
    model, scored, num_tokens = _scores(app, h, req, rid)
    data = [{"index": i, "object": "score", "score": s.outputs.score} for i, s in enumerate(scored)]
    h.send_json(200, list_answer(rid, model, data, num_tokens, completion_tokens=0))


def serve_rerank(app: OpenAIApp, h: Handler) -> None:
    req = parse_rerank(h.read_json(), app.images is not None)
    rid = f"rerank-{app.base_request_id(h, req.request_id)}"
    model, scored, num_tokens = _scores(app, h, req, rid)
    results = []
    for i, s in enumerate(scored):
        result: dict[str, Any] = {"index": i, "relevance_score": s.outputs.score}
        if req.return_documents:
            doc = req.second[i]
            result["document"] = (
                {"multi_modal": doc.content} if isinstance(doc, MediaSide) else {"text": doc}
            )
        results.append(result)
    results.sort(key=lambda r: r["relevance_score"], reverse=True)  # stable: ties keep order
    if req.top_n:
        results = results[: req.top_n]
    h.send_json(
        200,
        {
            "id": rid,
            "model": model,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
            "results": results,
        },
    )
