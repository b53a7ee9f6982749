"""Anthropic's Messages API over the chat path: `POST /v1/messages` and `POST
/v1/messages/count_tokens` (vLLM serves both), for Anthropic's SDKs and the tools built on them.

    request    anthropic_request.py: system + messages -> a chat request (parse_chat) -> the
               chat template
    response   the text -> reasoning split (--reasoning-parser) -> tool calls (tools.py)
               -> content blocks: [thinking] [text] [tool_use ...]

`stop_reason`: "tool_use" when the answer calls tools, "stop_sequence" (with the string in
`stop_sequence`) when one of `stop_sequences` ended it, "max_tokens" when `max_tokens` did,
"model_context_window_exceeded" when the context window did (a `max_tokens` larger than the
room left after the prompt is cut to that room, as Anthropic does, instead of a 400), else
"end_turn". `usage.input_tokens` counts the prompt tokens the prefix cache did not serve,
`cache_read_input_tokens` those it did (Anthropic's split: their sum is the prompt).
`GET /v1/models` (and `/v1/models/{id}`) answer in Anthropic's shape to a request that
carries the `anthropic-version` header (as Anthropic's SDKs send it).

A stream is Anthropic's typed events (`event: <type>` + `data: <json>`): message_start (at
once: its usage counts the whole prompt as input, the prefix cache's share being known only
once the prompt ran), ping, then per content block content_block_start, its deltas
(thinking_delta + signature_delta, text_delta, input_json_delta), content_block_stop; last
message_delta (stop_reason, the final usage: the SDKs take its input and cache counts too) and
message_stop. No `[DONE]`. A failure mid-stream is
an `error` event. Errors are Anthropic's shape: {"type": "error", "error": {"type", "message"}}.
Thinking blocks carry a random `signature`: nothing here signs or checks them.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from paged_server.anthropic_request import (
    MessagesRequest,
    messages_params,
    parse_messages,
    tool_input,
)
from paged_server.chat_output import ChatDeltas, split_output, tool_output
from paged_server.errors import APIError, bad_request, query_int
from paged_server.reasoning import ReasoningRequest

if TYPE_CHECKING:
    from paged_server.app import OpenAIApp
    from paged_server.http import Handler
    from paged_server.request_group import RequestGroup

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class AnthropicError(APIError):
    """An APIError in Anthropic's body shape."""

    def body(self) -> bytes:
        kind = _ERROR_TYPES.get(self.status, "api_error" if self.status >= 500 else None)
        err = {"type": kind or "invalid_request_error", "message": self.message}
        return json.dumps({"type": "error", "error": err}).encode()


def is_messages_route(path: str) -> bool:
    """`/v1/messages` and the routes under it: their errors are Anthropic's shape."""
    return path.rstrip("/") == "/v1/messages" or path.startswith("/v1/messages/")


def wants_anthropic_errors(path: str, headers: Any) -> bool:
    """Whether a request's errors (its 401 too) take Anthropic's shape: every Messages API
    route's, and those of `/v1/models` (and `/v1/models/{id}`) asked with the
    `anthropic-version` header, which such a request is answered in Anthropic's shape by."""
    if is_messages_route(path):
        return True
    models = path.rstrip("/") == "/v1/models" or path.startswith("/v1/models/")
    return models and headers.get("anthropic-version") is not None


@contextmanager
def anthropic_errors() -> Iterator[None]:
    """Every error of the Messages API routes, in Anthropic's shape."""
    try:
        yield
    except AnthropicError:
        raise
    except APIError as e:
        raise AnthropicError(e.status, e.message, e.param, e.code, e.headers) from None


def _parse(app: OpenAIApp, h: Handler, count_only: bool = False) -> MessagesRequest:
    budget_ok = app.reasoning_parser is not None
    return parse_messages(
        h.read_json(), app.tool_call_parser, app.takes_media, budget_ok, not count_only
    )


def _thinking_block(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": uuid.uuid4().hex}


def _usage(group: RequestGroup) -> dict[str, int]:
    out = group.latest[0]
    cached = out.num_cached_tokens or 0
    return {
        "input_tokens": len(out.prompt_token_ids) - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": group.num_generated_tokens,
    }


def _stop(
    req: MessagesRequest, finish: str | None, stop: Any, tool_use: bool, window: bool
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence). `window`: the context window capped max_tokens."""
    if finish == "length":
        return ("model_context_window_exceeded" if window else "max_tokens"), None
    if tool_use:
        return "tool_use", None
    if isinstance(stop, str) and stop in req.stop_sequences:
        return "stop_sequence", stop
    return "end_turn", None


def _fit_window(app: OpenAIApp, req: MessagesRequest, n_prompt: int) -> bool:
    """Cut max_tokens to the room the context leaves (True if it was cut); a prompt that
    fills the context is Anthropic's "prompt is too long" 400."""
    limit = app.max_model_len
    if n_prompt >= limit:
        raise bad_request(
            f"prompt is too long: {n_prompt} tokens > {limit - 1} maximum", "messages"
        )
    room = limit - n_prompt
    cut = req.chat.max_tokens is not None and req.chat.max_tokens > room
    if cut:
        req.chat.max_tokens = room
    return cut


# ---- routes ---------------------------------------------------------------------------------
def serve_messages(app: OpenAIApp, h: Handler) -> None:
    req = _parse(app, h)
    chat = req.chat
    # vLLM answers the chat completion's id: "chatcmpl-" + X-Request-Id (else a random id)
    mid = f"chatcmpl-{app.base_request_id(h)}"
    with messages_params():
        model, lora = app._resolve(chat.model)
        text, ids, reasoning = app._chat_prompt(chat)
        window = _fit_window(app, req, len(ids))
        group, rids = app._submit(
            chat, [text], [ids], mid, chat=True, lora=lora, stream=chat.stream
        )
    with app._in_flight(h, group, rids, chat.structured_param):
        if chat.stream:
            _stream(app, h, req, (mid, model, len(ids)), group, reasoning, window)
        else:
            app._wait(h, group)
            body = _whole(app, req, mid, model, group, reasoning, window)
            h.send_json(200, body)
        h.log_extra = f" prompt_tokens={len(ids)} gen_tokens={group.num_generated_tokens}"
        h.log_extra += " stream" if chat.stream else ""


def serve_count_tokens(app: OpenAIApp, h: Handler) -> None:
    """The prompt tokens a `POST /v1/messages` with this body would take (its chat template
    rendered, nothing generated)."""
    req = _parse(app, h, count_only=True)
    with messages_params():
        app._resolve(req.chat.model)
        _, ids, _ = app._chat_prompt(req.chat)
    # vLLM's: context_management reports the count before any trimming (none here)
    n = len(ids)
    h.send_json(200, {"input_tokens": n, "context_management": {"original_input_tokens": n}})


def _whole(
    app: OpenAIApp,
    req: MessagesRequest,
    mid: str,
    model: str,
    group: RequestGroup,
    reasoning: ReasoningRequest | None,
    window: bool,
) -> dict[str, Any]:
    seq = group.latest[0].outputs[0]
    tools = tool_output(req.chat.tools, app.tool_call_parser)
    thought, content, calls = split_output(seq.text, seq.finish_reason, reasoning, tools)
    blocks: list[dict[str, Any]] = []
    if thought:
        blocks.append(_thinking_block(thought if req.show_thinking else ""))
    if content:
        blocks.append({"type": "text", "text": content})
    for c in calls:
        args = tool_input(c["function"]["arguments"])
        if args is not None:  # a call max_tokens cut short is dropped
            blocks.append(
                {"type": "tool_use", "id": c["id"], "name": c["function"]["name"], "input": args}
            )
    tool_use = any(b["type"] == "tool_use" for b in blocks)
    stop_reason, stop_seq = _stop(req, seq.finish_reason, seq.stop_reason, tool_use, window)
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": stop_reason,
        "stop_sequence": stop_seq,
        "usage": _usage(group),
    }


# ---- a stream's events ----------------------------------------------------------------------
class _EventStream:
    """Writes one message's events: one content block is open at a time; a delta of another
    kind (thinking, text, a new tool call) closes it."""

    def __init__(self, h: Handler, show_thinking: bool) -> None:
        self.h, self.show_thinking = h, show_thinking
        self.index = -1  # the open block's index
        self.open: str | None = None  # its type
        self.calls: dict[int, int] = {}  # the tool-call stream's index -> its block's index
        self.tool_use = False

    def send(self, kind: str, **fields: Any) -> None:
        self.h.send_event({"type": kind, **fields}, event=kind)

    def _start(self, block: dict[str, Any]) -> None:
        self.close()
        self.index += 1
        self.open = block["type"]
        self.send("content_block_start", index=self.index, content_block=block)

    def close(self) -> None:
        if self.open is None:
            return
        if self.open == "thinking":
            sig = {"type": "signature_delta", "signature": uuid.uuid4().hex}
            self.send("content_block_delta", index=self.index, delta=sig)
        self.send("content_block_stop", index=self.index)
        self.open = None

    def _piece(self, kind: str, piece: str) -> None:
        if self.open != kind:
            self._start({"type": "text", "text": ""} if kind == "text" else _thinking_start())
        if kind == "thinking" and not self.show_thinking:
            return  # the block is there, its text is not
        field = "text" if kind == "text" else "thinking"
        delta = {"type": f"{field}_delta", field: piece}
        self.send("content_block_delta", index=self.index, delta=delta)

    def delta(self, delta: dict[str, Any]) -> None:
        """One chat-style delta (after the reasoning and tool-call rewrites)."""
        if delta.get("reasoning_content"):
            self._piece("thinking", delta["reasoning_content"])
        if delta.get("content"):
            self._piece("text", delta["content"])
        for entry in delta.get("tool_calls", []):
            fn = entry.get("function", {})
            if entry["index"] not in self.calls:  # announced: its id and name come first
                block = {"type": "tool_use", "id": entry["id"], "name": fn["name"], "input": {}}
                self._start(block)
                self.calls[entry["index"]] = self.index
                self.tool_use = True
            args = fn.get("arguments") or ""
            if args:
                assert self.calls[entry["index"]] == self.index, "a call's input streams open"
                piece = {"type": "input_json_delta", "partial_json": args}
                self.send("content_block_delta", index=self.index, delta=piece)


def _thinking_start() -> dict[str, Any]:
    return {"type": "thinking", "thinking": "", "signature": ""}


def _stream(
    app: OpenAIApp,
    h: Handler,
    req: MessagesRequest,
    message: tuple[str, str, int],
    group: RequestGroup,
    reasoning: ReasoningRequest | None,
    window: bool,
) -> None:
    """`message`: (its id, the model name, the prompt's length)."""
    h.start_stream()
    events = _EventStream(h, req.show_thinking)
    _message_start(events, *message)
    tools = tool_output(req.chat.tools, app.tool_call_parser)
    deltas = ChatDeltas(reasoning, tools, app._decode_one)
    try:
        for delta in deltas.stream(app.arrivals(h, group)):
            events.delta(delta)
    except APIError as e:
        events.send("error", error={"type": "api_error", "message": e.message})
        h.end_stream(done=False)
        h.log_extra = f" failed: {e.message}"
        return
    events.close()
    stop_reason, stop_seq = _stop(
        req, deltas.finish_reason, deltas.stop_reason, events.tool_use, window
    )
    events.send(
        "message_delta",
        delta={"stop_reason": stop_reason, "stop_sequence": stop_seq},
        usage=_usage(group),
    )
    events.send("message_stop")
    h.end_stream(done=False)


def _message_start(events: _EventStream, mid: str, model: str, n_prompt: int) -> None:
    usage = {
        "input_tokens": n_prompt,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 0,
    }
    message = {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }
    events.send("message_start", message=message)
    events.send("ping")


# ---- models ---------------------------------------------------------------------------------
def anthropic_model(card: dict[str, Any]) -> dict[str, Any]:
    """A served model's card as Anthropic's model object."""
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(card["created"]))
    return {
        "type": "model",
        "id": card["id"],
        "display_name": card["id"],
        "created_at": created,
        "lifecycle": "active",
        "max_input_tokens": card["max_model_len"],
        "max_tokens": card["max_model_len"],
    }


def anthropic_model_list(h: Handler, cards: list[dict[str, Any]]) -> dict[str, Any]:
    """Anthropic's model list page: `limit` (1-1000, default 20) after `after_id` or before
    `before_id`."""
    query = parse_qs(urlsplit(h.path).query)
    limit = query_int(query, "limit", 20, 1, 1000, "an integer from 1 to 1000")
    models = [anthropic_model(c) for c in cards]
    ids = [m["id"] for m in models]
    for key in ("after_id", "before_id"):
        cursor = query.get(key, [None])[-1]
        if cursor is not None and cursor not in ids:
            raise bad_request(f"{key} {cursor!r} is not a served model", key)
    after, before = query.get("after_id", [None])[-1], query.get("before_id", [None])[-1]
    if after is not None:
        rest = models[ids.index(after) + 1 :]
        page, more = rest[:limit], len(rest) > limit
    elif before is not None:
        rest = models[: ids.index(before)]
        page, more = rest[-limit:], len(rest) > limit
    else:
        page, more = models[:limit], len(models) > limit
    return {
        "data": page,
        "has_more": more,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
    }
