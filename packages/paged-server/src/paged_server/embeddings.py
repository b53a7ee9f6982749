"""`POST /v1/embeddings`: OpenAI's embeddings API over the engine's pooling requests; and
vLLM's `POST /pooling`, the same body answering the model's own pooled output (an embedding, a
classifier's probabilities) as `{"object": "pooling", "data": [...]}` items.

    {"model": M, "input": "text" | ["text", ...] | [ids] | [[ids], ...],
     "encoding_format": "float" | "base64", "dimensions": N, "user": ...}
    -> {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": [...]}],
        "model": M, "usage": {"prompt_tokens": n, "total_tokens": n}}

vLLM's extras: `truncate_prompt_tokens` (keep k, cut on truncation_side; -1: all that fit),
`add_special_tokens` (default true), `normalize` (or `use_activation`, its newer name),
`request_id` (the answer's id is "embd-" + it); the rest of vLLM's fields only at their defaults
(POOLING_OFF). Instead of `input`, vLLM's chat form:
`messages` through the chat template (`chat_template_kwargs`, `add_generation_prompt` default
false, `continue_final_message`, `chat_template`, `mm_processor_kwargs` as chat completions
take them), one pooled input; `add_special_tokens` then defaults to false (the template holds
BOS). Its messages may hold image_url parts where the model takes images (a VLM embedder, or
CLIP / SigLIP: an image-only message embeds the image, a text-only one the text, both a 400):
pooling_media.py.

The pooling itself (last token or mean, `--pooler-config`) is the engine's:
paged_engine/pooling.py. base64 is the little-endian float32 bytes, as OpenAI encodes them (the
official Python client asks for it by default).
"""

from __future__ import annotations

import base64
import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paged_engine.pooling import PoolingParams, encode_truncated, truncated, truncation_limit
from paged_server.errors import bad_request
from paged_server.openai_protocol import check_defaults, parse_chat
from paged_server.pooling_media import chat_prompt

if TYPE_CHECKING:
    from paged_server.app import OpenAIApp
    from paged_server.http import Handler

_FIELDS = frozenset(
    {
        "model",
        "input",
        "encoding_format",
        "dimensions",
        "user",
        "truncate_prompt_tokens",
        "add_special_tokens",
        "normalize",
        "use_activation",  # vLLM's newer name for normalize on this route
        "priority",
        "request_id",
    }
)
# vLLM's chat form of the body: `messages` (and what renders them) instead of `input`
CHAT_FIELDS = frozenset(
    {
        "messages",
        "chat_template",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "mm_processor_kwargs",
    }
)


@dataclass(slots=True)
class EmbeddingRequest:
    model: str | None
    inputs: list[str | list[int]]
    encoding_format: str
    params: PoolingParams
    truncate_prompt_tokens: int | None
    add_special_tokens: bool
    priority: int = 0  # --scheduling-policy priority: lower runs first
    chat: dict[str, Any] | None = None  # the chat form's fields (then `inputs` is empty)
    request_id: str | None = None


# /pooling's extra: what to pool (the model's own when absent).
_POOLING_FIELDS = _FIELDS | {"task"}
# vLLM's pooling request fields this server does not implement, accepted at their defaults
# (any other value: a 400 naming the field); each route lists the ones its vLLM model has.
POOLING_OFF: dict[str, tuple[Any, ...]] = {
    "padding": (None, "do_not_pad"),
    "truncation_side": (None,),  # the tokenizer's own side cuts (truncated_tokens)
    "cache_salt": (None,),
    "mm_processor_kwargs": (None, {}),
    "media_io_kwargs": (None, {}),
    "embed_dtype": (None, "float32"),  # base64 is float32 ...
    "endianness": (None, "native", "little"),  # ... little-endian (encode)
    "max_tokens_per_query": (None, 0),
    "max_tokens_per_doc": (None, 0),
}


def pooling_off(*names: str) -> dict[str, tuple[Any, ...]]:
    """A route's table of POOLING_OFF fields, for openai_protocol.check_defaults."""
    return {name: POOLING_OFF[name] for name in names}


_EMBED_OFF = pooling_off(
    "padding", "truncation_side", "cache_salt", "media_io_kwargs", "embed_dtype", "endianness"
)


def parse_request_id(body: dict) -> str | None:
    """vLLM's `request_id`: the response id is the route's prefix plus it (unless the
    X-Request-Id header names one)."""
    rid = body.get("request_id")
    ok = isinstance(rid, str) and 0 < len(rid) <= 128 and rid.isprintable()
    if rid is not None and not ok:
        raise bad_request("'request_id' must be 1-128 printable characters", "request_id")
    return rid


_POOLING_TASKS = ("embed", "classify", "token_embed", "token_classify")


def parse_embedding(body: Any, route: str = "/v1/embeddings") -> EmbeddingRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    known = (_POOLING_FIELDS if route == "/pooling" else _FIELDS) | CHAT_FIELDS
    unknown = sorted(set(body) - known - _EMBED_OFF.keys())
    if unknown:
        raise bad_request(f"parameter '{unknown[0]}' is not supported by {route}", unknown[0])
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    check_defaults(body, _EMBED_OFF)
    chat = chat_fields(body)
    items = [] if chat else inputs(body.get("input"))
    fmt = body.get("encoding_format", "float")
    if fmt is None:
        fmt = "float"
    if fmt not in ("float", "base64"):
        raise bad_request(
            f"'encoding_format' must be 'float' or 'base64', got {fmt!r}", "encoding_format"
        )
    truncate = parse_truncate(body)
    special = body.get("add_special_tokens", not chat)
    if not isinstance(special, bool):
        raise bad_request("'add_special_tokens' must be a boolean", "add_special_tokens")
    normalize, activation = body.get("normalize"), body.get("use_activation")
    if activation is not None and not isinstance(activation, bool):
        raise bad_request("'use_activation' must be a boolean", "use_activation")
    if route != "/pooling":  # an embedding's activation is its normalization (vLLM's mapping)
        if normalize is not None and activation is not None and normalize != activation:
            raise bad_request("'normalize' and 'use_activation' disagree", "use_activation")
        normalize, activation = (activation if normalize is None else normalize), None
    try:
        params = PoolingParams(
            normalize=normalize,
            dimensions=body.get("dimensions"),
            use_activation=activation,
            task=_pooling_task(body) if route == "/pooling" else "embed",
        )
    except ValueError as e:
        text = str(e)
        param = next((f for f in ("dimensions", "use_activation") if f in text), "normalize")
        raise bad_request(text, param) from None
    priority = parse_priority(body)
    return EmbeddingRequest(
        model, items, fmt, params, truncate, special, priority, chat, parse_request_id(body)
    )


def chat_fields(body: dict) -> dict[str, Any] | None:
    """vLLM's chat form of a pooling body: its `messages` and the fields that render them
    (CHAT_FIELDS), or None for the `input` form. A chat field without `messages`, or
    `messages` beside `input`, is a 400 naming it."""
    chat = {k: body[k] for k in CHAT_FIELDS if k in body}
    if chat.get("mm_processor_kwargs", 1) in POOLING_OFF["mm_processor_kwargs"]:
        del chat["mm_processor_kwargs"]  # (vLLM's input form has it too: asks for nothing)
    if chat and "messages" not in chat:
        raise bad_request(f"'{next(iter(chat))}' goes with 'messages'", next(iter(chat)))
    if chat and "input" in body:
        raise bad_request("send either 'input' or 'messages', not both", "messages")
    return chat or None


def chat_input(
    app: OpenAIApp, chat: dict[str, Any], add_special_tokens: bool, truncate: int | None
) -> list[int] | dict:
    """The chat form's one pooled input: the conversation as the chat template renders it
    (no generation prompt unless asked), its ids checked and truncated as `input`'s are, or
    an engine prompt with its processed images."""
    req = parse_chat({"add_generation_prompt": False, **chat}, images=app.takes_media)
    one = chat_prompt(app, req, add_special_tokens, truncate)
    if isinstance(one, list):  # no media: checked and truncated as token ids
        one = prompt_tokens(app, one, "messages", truncate)
    return one


def _pooling_task(body: dict) -> str | None:
    task = body.get("task")
    if task is not None and task not in _POOLING_TASKS:
        raise bad_request(
            f"'task' must be one of {_POOLING_TASKS} (or absent), got {task!r}", "task"
        )
    return task


def parse_truncate(body: dict) -> int | None:
    """`truncate_prompt_tokens`: keep k tokens; -1 keeps as many as fit."""
    truncate = body.get("truncate_prompt_tokens")
    if truncate is not None and (
        isinstance(truncate, bool)
        or not isinstance(truncate, int)
        or truncate < -1
        or truncate == 0
        or truncate >= 1 << 31
    ):
        raise bad_request(
            "'truncate_prompt_tokens' must be an int >= 1 (or -1: as many as fit)",
            "truncate_prompt_tokens",
        )
    return truncate


def parse_priority(body: dict) -> int:
    priority = body.get("priority", 0)
    if priority is None:
        priority = 0
    if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) >= 1 << 63:
        raise bad_request("'priority' must be a 64-bit integer", "priority")
    return priority


def inputs(value: Any) -> list[str | list[int]]:
    """`input`: str | list[str] | list[int] | list[list[int]] -> one entry per pooled input."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad_request(
            "'input' must be a non-empty string, list of strings, list of token ids or list of "
            "token id lists",
            "input",
        )
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return [value]
    for i, item in enumerate(value):
        ok = isinstance(item, str) or (
            isinstance(item, list)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in item)
        )
        if not ok:
            raise bad_request(f"input[{i}] must be a string or a list of token ids", "input")
        if not item:
            raise bad_request(f"input[{i}] is empty", "input")
    return value


def encode(vector: list, fmt: str) -> list | str:
    """A vector (or a token task's rows) as JSON floats, or as base64 of its little-endian
    float32 values (rows one after the other)."""
    if fmt == "float":
        return vector
    flat = [v for row in vector for v in row] if vector and isinstance(vector[0], list) else vector
    return base64.b64encode(struct.pack(f"<{len(flat)}f", *flat)).decode("ascii")


def truncated_tokens(app: OpenAIApp, tokens: list[int], truncate: int | None) -> list[int]:
    """pooling.truncated: `truncate` tokens cut on the tokenizer's truncation_side (the engine
    set it: the first ones on a pooling-only engine, else the last), a 400 naming
    truncate_prompt_tokens when it exceeds max_model_len."""
    side = getattr(app.tokenizer, "truncation_side", "left")
    try:
        return truncated(tokens, truncate, app.max_model_len, side=side)
    except ValueError as e:
        raise bad_request(str(e), "truncate_prompt_tokens") from None


def text_tokens(
    app: OpenAIApp,
    text: str,
    truncate: int | None,
    add_special_tokens: bool = True,
    *,
    generate: bool = False,
) -> tuple[list[int], bool]:
    """A text prompt's ids, `truncate` of them kept as vLLM's renderer keeps them, and whether
    any were cut: the tokenizer truncates (pooling.encode_truncated: its special tokens, [CLS]
    ... [SEP] or BOS, stay; the text is cut on its truncation_side); a 400 naming
    truncate_prompt_tokens when `truncate` exceeds max_model_len. Encoded once more only when
    a cut is due."""
    tokens = app._encode(text, add_special_tokens)
    if truncate is None:
        return tokens, False
    try:
        limit = truncation_limit(truncate, app.max_model_len, generate=generate)
        assert limit is not None
        if len(tokens) <= limit:
            return tokens, False
        with app.tok_lock:
            cut = encode_truncated(
                app.tokenizer,
                text,
                truncate,
                app.max_model_len,
                generate=generate,
                add_special_tokens=add_special_tokens,
            )
    except ValueError as e:
        raise bad_request(str(e), "truncate_prompt_tokens") from None
    return cut, True


def prompt_tokens(
    app: OpenAIApp,
    item: str | list[int],
    where: str,
    truncate: int | None,
    add_special_tokens: bool = True,
) -> list[int]:
    """One pooled input's token ids: text tokenized (text_tokens), ids checked, `truncate` of
    them kept (truncated_tokens; -1: as many as a prompt may hold); a 400 when it does not fit.
    `where` names the input ("input[2]"); the error's `param` is its field ("input")."""
    param = where.partition("[")[0]
    if isinstance(item, str):
        tokens, _ = text_tokens(app, item, truncate, add_special_tokens)
    else:
        app._check_ids(item, param)
        tokens = truncated_tokens(app, list(item), truncate)
    if len(tokens) > app.max_model_len:  # a pooling prompt may fill the context
        raise bad_request(
            f"{where} has {len(tokens)} tokens; this model's maximum context length is "
            f"{app.max_model_len} (set truncate_prompt_tokens to cut it)",
            param,
        )
    return tokens


def run_pooling(
    app: OpenAIApp,
    h: Handler,
    rid: str,
    ids: list[list[int] | dict],
    params: PoolingParams,
    lora: Any,
    priority: int,
) -> list[Any]:
    """Pool each token list (or engine prompt: ids and processed images) as one engine
    request; the `PoolingRequestOutput`s in order. A client that leaves aborts every request
    of the call."""
    app.client.check_queue()
    rids = [f"{rid}-{i}" for i in range(len(ids))]
    prompts = [t if isinstance(t, dict) else {"prompt_token_ids": t} for t in ids]
    group = app.client.add(rids, prompts, params, lora, priority)
    with app._in_flight(h, group, rids):
        app._wait(h, group)
    return list(group.latest)


def serve_embeddings(app: OpenAIApp, h: Handler, route: str = "/v1/embeddings") -> None:
    """`/v1/embeddings`; with `route="/pooling"` vLLM's pooling API over the same inputs."""
    req = parse_embedding(h.read_json(), route)
    model, lora = app._resolve(req.model)  # an adapter name: the engine pools with it
    ids: list[list[int] | dict]
    if req.chat is not None:
        ids = [chat_input(app, req.chat, req.add_special_tokens, req.truncate_prompt_tokens)]
    else:
        ids = [
            prompt_tokens(
                app, item, f"input[{i}]", req.truncate_prompt_tokens, req.add_special_tokens
            )
            for i, item in enumerate(req.inputs)
        ]
    pooling = route == "/pooling"
    rid = f"{'pool' if pooling else 'embd'}-{app.base_request_id(h, req.request_id)}"
    outs = run_pooling(app, h, rid, ids, req.params, lora, req.priority)
    key = "data" if pooling else "embedding"
    data = [
        {
            "object": "pooling" if pooling else "embedding",
            "index": i,
            key: encode(out.outputs.data.tolist(), req.encoding_format),
        }
        for i, out in enumerate(outs)
    ]
    num_tokens = sum(len(t["prompt_token_ids"] if isinstance(t, dict) else t) for t in ids)
    h.log_extra += f" prompt_tokens={num_tokens}"
    usage = {"completion_tokens": 0} if pooling else {}
    h.send_json(200, list_answer(rid, model, data, num_tokens, **usage))


def list_answer(rid: str, model: str, data: list, num_tokens: int, **usage: int) -> dict:
    """A pooling answer: `{"id", "object": "list", "created", "model", "data", "usage"}`, the
    usage counting `num_tokens` prompt tokens (plus any other `usage` fields)."""
    return {
        "id": rid,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, **usage},
    }
