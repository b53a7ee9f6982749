"""vLLM's classification API for a `*ForSequenceClassification` model
(paged_engine/classification.py).

    POST /classify, /v1/classify
        {"model", "input": "text" | ["text", ...] | [ids] | [[ids], ...],
         "truncate_prompt_tokens", "use_activation", "add_special_tokens", "priority", "user",
         "request_id"}
        or vLLM's chat form, `messages` in place of `input`: {"messages",
         "add_generation_prompt", "continue_final_message", "chat_template",
         "chat_template_kwargs", "mm_processor_kwargs", and the other fields above}
    -> {"id", "object": "list", "created", "model",
        "data": [{"index": i, "label": name, "probs": [...], "num_classes": n}],
        "usage": {"prompt_tokens", "total_tokens", "completion_tokens": 0}}

`label` is config.id2label's name of the most probable class; `use_activation: false` returns the
head's raw logits in `probs` (the label is still their argmax). Every input is one pooling
request, batched with whatever else the engine runs. The chat form is one input: the
conversation as /v1/embeddings' chat form renders it (embeddings.chat_input), so
`add_special_tokens` defaults to false there (the template holds BOS).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from paged_engine.pooling import PoolingParams
from paged_server.embeddings import (
    CHAT_FIELDS,
    chat_fields,
    chat_input,
    inputs,
    list_answer,
    parse_priority,
    parse_request_id,
    parse_truncate,
    pooling_off,
    prompt_tokens,
    run_pooling,
)
from paged_server.errors import bad_request
from paged_server.scores import check_fields

if TYPE_CHECKING:
    from paged_server.app import OpenAIApp
    from paged_server.http import Handler

_FIELDS = CHAT_FIELDS | {
    "model",
    "input",
    "user",
    "truncate_prompt_tokens",
    "use_activation",
    "add_special_tokens",
    "priority",
    "request_id",
}
# vLLM's classification request fields accepted at their defaults only (POOLING_OFF)
_OFF = pooling_off("padding", "truncation_side", "cache_salt", "media_io_kwargs")


def parse_classify(body: Any) -> dict[str, Any]:
    """The checked fields of a classify body (400 naming the first bad one)."""
    body = check_fields(body, _FIELDS, "/classify", _OFF)
    chat = chat_fields(body)
    special = body.get("add_special_tokens")
    if special is None:  # the chat template holds BOS
        special = chat is None
    if not isinstance(special, bool):
        raise bad_request("'add_special_tokens' must be a boolean", "add_special_tokens")
    return {
        "model": body.get("model"),
        "inputs": [] if chat else inputs(body.get("input")),
        "chat": chat,
        "truncate": parse_truncate(body),
        "use_activation": body.get("use_activation"),
        "add_special_tokens": special,
        "priority": parse_priority(body),
        "request_id": parse_request_id(body),
    }


def serve_classify(app: OpenAIApp, h: Handler) -> None:
    req = parse_classify(h.read_json())
    info = app.classifier
    if info is None:
        raise bad_request(
            "this model does not classify: /classify needs a *ForSequenceClassification model",
            "model",
        )
    model, lora = app._resolve(req["model"])
    ids: list[list[int] | dict]
    if req["chat"] is not None:
        ids = [chat_input(app, req["chat"], req["add_special_tokens"], req["truncate"])]
    else:
        ids = [
            prompt_tokens(app, item, f"input[{i}]", req["truncate"], req["add_special_tokens"])
            for i, item in enumerate(req["inputs"])
        ]
    rid = f"classify-{app.base_request_id(h, req['request_id'])}"
    params = PoolingParams(use_activation=req["use_activation"], task="classify")
    outs = run_pooling(app, h, rid, ids, params, lora, req["priority"])
    data = []
    for i, out in enumerate(outs):
        probs = out.outputs.data.tolist()
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append(
            {"index": i, "label": info.labels[best], "probs": probs, "num_classes": len(probs)}
        )
    num_tokens = sum(len(t["prompt_token_ids"] if isinstance(t, dict) else t) for t in ids)
    h.log_extra += f" prompt_tokens={num_tokens}"
    h.send_json(200, list_answer(rid, model, data, num_tokens, completion_tokens=0))
