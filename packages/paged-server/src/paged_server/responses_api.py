"""OpenAI's Responses API over the chat path: `POST /v1/responses`, `GET` / `DELETE
/v1/responses/{id}`, `GET /v1/responses/{id}/input_items`, `POST /v1/responses/{id}/cancel`
and `POST /v1/responses/input_tokens`.

    request    responses_request.py: input items -> a chat request (parse_chat) -> the chat
               template (responses_truncation.py: truncation "auto" drops the oldest turns)
    response   the text -> reasoning split (--reasoning-parser) -> tool calls (tools.py)
               -> output items: [reasoning] [message] [function_call ...]

A stream is OpenAI's typed events (`event: <type>` + `data: <json>`, `sequence_number` 0, 1, ...):
response.created, response.in_progress, then per output item output_item.added, its deltas
(reasoning_text / output_text / function_call_arguments), their .done events, output_item.done,
and last response.completed holding the whole response (also when its status is "incomplete",
as vLLM does, so the SDK's `responses.stream(...).get_final_response()` works). No `[DONE]`.

`store` (OpenAI's default: true) keeps the finished response, with its conversation, in a
bounded LRU: `GET /v1/responses/{id}` answers it and `previous_response_id` continues it.
`background` answers at once and runs on (response_background.py).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from paged_server import response_background
from paged_server.chat_output import ChatDeltas, span_logprobs, split_output, tool_output
from paged_server.errors import APIError, query_int
from paged_server.openai_protocol import GenerationRequest
from paged_server.openai_responses import chat_logprobs, token_id_text
from paged_server.reasoning import ReasoningRequest
from paged_server.responses_request import ResponsesRequest, parse_responses, responses_params
from paged_server.responses_truncation import fit_prompt

if TYPE_CHECKING:
    from collections.abc import Callable

    from paged_server.app import OpenAIApp
    from paged_server.http import Handler
    from paged_server.request_group import RequestGroup

MAX_STORED = 1000
# The events kept for background streamed responses' followers, all together (~250 bytes a
# token: 1000 responses of 32k tokens would hold ~8 GB); past it the least recently used
# finished ones are dropped first, as past MAX_STORED.
MAX_EVENT_BYTES = 1 << 30
# The stored conversations, all together, in characters of their strings: an image turn holds
# its data URL (up to the 16 MiB body limit), so 1000 stored turns of a vision model could
# hold ~16 GB. Counted per response (a chain's turns share their earlier items' strings, so
# this overcounts: never undercounts); past it the least recently used go first.
MAX_CONTEXT_CHARS = 1 << 30


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- stored responses -----------------------------------------------------------------------
@dataclass(slots=True)
class StoredResponse:
    body: dict[str, Any]  # the response object, as it was answered
    context: list[dict[str, Any]]  # normalized items: every input so far and this output
    input_items: list[dict[str, Any]] = field(default_factory=list)  # as input_items lists them
    run: response_background.BackgroundRun | None = None  # a background response's
    chars: int = 0  # the characters of its context's and input items' strings (set by put)


def _chars(value: Any) -> int:
    """The characters of the strings inside a JSON-like value (media data URLs dominate)."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return total


class ResponseStore:
    """The newest `capacity` stored responses (least recently used dropped first), their
    conversations at most `max_context_chars` characters in all and their kept background
    events at most `max_event_bytes`: checked as a response is stored, the least recently used
    dropped until both sums fit (never the one stored; for events only finished runs: a
    running one's events still grow, the count bounds those)."""

    def __init__(
        self,
        capacity: int = MAX_STORED,
        max_event_bytes: int = MAX_EVENT_BYTES,
        max_context_chars: int = MAX_CONTEXT_CHARS,
    ) -> None:
        self.capacity = capacity
        self.max_event_bytes = max_event_bytes
        self.max_context_chars = max_context_chars
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.context_chars = 0  # the sum of the stored responses' `chars`
        self._lock = threading.Lock()  # HTTP threads share it

    def put(self, stored: StoredResponse) -> None:
        stored.chars = _chars(stored.context) + _chars(stored.input_items)
        rid = stored.body["id"]
        with self._lock:
            self._drop(rid)  # a background response stored again as it ends
            self._items[rid] = stored
            self.context_chars += stored.chars
            while len(self._items) > self.capacity:
                self._drop(next(iter(self._items)))
            for old in list(self._items):  # least recently used first
                if self.context_chars <= self.max_context_chars:
                    break
                if old != rid:
                    self._drop(old)
            runs = [(old, s.run) for old, s in self._items.items() if s.run is not None]
            total = sum(run.event_bytes for _, run in runs)
            for old, run in runs:  # least recently used first
                if total <= self.max_event_bytes:
                    break
                if run.ended and old != rid:
                    self._drop(old)
                    total -= run.event_bytes

    def _drop(self, rid: str) -> bool:
        """Forget `rid` (the lock held); whether it was stored."""
        gone = self._items.pop(rid, None)
        if gone is not None:
            self.context_chars -= gone.chars
        return gone is not None

    def get(self, rid: str) -> StoredResponse | None:
        with self._lock:
            stored = self._items.get(rid)
            if stored is not None:
                self._items.move_to_end(rid)
            return stored

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._drop(rid)

    def __len__(self) -> int:
        return len(self._items)


def _context_items(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as the next turn's input items (normalized)."""
    items = []
    for it in output:
        if it["type"] == "reasoning":
            text = "".join(part["text"] for part in it["content"])
            items.append({"type": "reasoning", "text": text})
        elif it["type"] == "message":
            text = "".join(part["text"] for part in it["content"])
            items.append({"type": "message", "role": "assistant", "content": text})
        elif it["type"] == "function_call":
            call = {k: it[k] for k in ("call_id", "name", "arguments")}
            items.append({"type": "function_call", **call})
    return items


# ---- output items and the response object ---------------------------------------------------
def _output_text(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _message_item(
    item_id: str, text: str | None, status: str, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    content = [] if text is None else [_output_text(text, logprobs)]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _call_item(item_id: str, call_id: str, name: str, args: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": args,
        "status": status,
    }


def _response(
    rid: str, created: int, model: str, req: ResponsesRequest, status: str
) -> dict[str, Any]:
    """The response object; `output` and `usage` are filled as they become known."""
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": req.background,
        "error": None,
        "incomplete_details": None,
        "model": model,
        "output": [],
        "usage": None,
        **req.echo,
    }


def _finish(
    app: OpenAIApp,
    body: dict[str, Any],
    group: RequestGroup,
    reasoning_text: str | None,
) -> None:
    """Status, usage and the output's last item status, once the request finished."""
    out = group.latest[0]
    incomplete = out.outputs[0].finish_reason == "length"
    body["status"] = "incomplete" if incomplete else "completed"
    if incomplete:
        body["incomplete_details"] = {"reason": "max_output_tokens"}
        if body["output"]:
            body["output"][-1]["status"] = "incomplete"
    else:
        body["completed_at"] = int(time.time())
    n_in, n_out = len(out.prompt_token_ids), group.num_generated_tokens
    # the reasoning text re-tokenized: the engine does not count tokens per part of the output
    n_reason = min(len(app._encode(reasoning_text, False)), n_out) if reasoning_text else 0
    body["usage"] = {
        "input_tokens": n_in,
        "input_tokens_details": {"cached_tokens": out.num_cached_tokens, "cache_write_tokens": 0},
        "output_tokens": n_out,
        "output_tokens_details": {"reasoning_tokens": n_reason},
        "total_tokens": n_in + n_out,
    }


def _whole_output(
    app: OpenAIApp, req: GenerationRequest, seq: Any, reasoning: ReasoningRequest | None
) -> tuple[list[dict[str, Any]], str | None]:
    """A finished output's items: [reasoning] [message] [function_call ...]; and its reasoning
    text. A message is there when it has text, or when nothing else is; with logprobs asked
    for (include "message.output_text.logprobs"), its text's tokens' logprobs (a stream sends
    each delta with the logprobs of the tokens that arrived with it)."""
    tools = tool_output(req.tools, app.tool_call_parser)
    thought, content, calls = split_output(seq.text, seq.finish_reason, reasoning, tools)
    lps = None
    if req.logprobs is not None and content:
        decode = app._decoder(req)
        entries = chat_logprobs(seq.token_ids, seq.logprobs or [], req.logprobs, decode)
        entries = entries["content"]
        if thought is None and not calls:  # the whole output is the message
            lps = entries
        else:  # its tokens located by their text (entries that show ids are decoded for it)
            pieces = [e["token"] for e in entries]
            if decode is token_id_text:
                pieces = [app._decode_one(t) for t in seq.token_ids]
            lps = span_logprobs(entries, pieces, content, thought)
    items = []
    if thought is not None:
        items.append(_reasoning_item(_new_id("rs"), thought, "completed"))
    if content or not (calls or items):
        items.append(_message_item(_new_id("msg"), content or "", "completed", lps))
    for c in calls:
        fn = c["function"]
        items.append(_call_item(_new_id("fc"), c["id"], fn["name"], fn["arguments"], "completed"))
    return items, thought


# ---- a stream's events ----------------------------------------------------------------------
class _EventStream:
    """Writes one response's events and builds its output items as the deltas arrive: one item
    is open at a time; a delta of another kind (reasoning, text, a new call) closes it."""

    def __init__(self, h: Handler, body: dict[str, Any]) -> None:
        self.h, self.body, self.seq = h, body, 0
        self.open: dict[str, Any] | None = None  # the item taking deltas
        # The open item's text (reasoning, message) or arguments (call), as pieces: joined when
        # the item closes (appending to one string would copy it on every piece).
        self.pieces: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}  # the tool-call stream's index -> its item
        self.reasoning_pieces: list[str] = []  # all of it: its token count goes into the usage
        self.logprobs: list[dict[str, Any]] = []  # the open message's, as its deltas brought them

    def send(self, kind: str, **fields: Any) -> None:
        self.h.send_event({"type": kind, "sequence_number": self.seq, **fields}, event=kind)
        self.seq += 1

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.body["output"]) - 1}

    def _add(self, item: dict[str, Any]) -> None:
        self.close("completed")
        self.open, self.pieces = item, []
        self.body["output"].append(item)
        self.send(
            "response.output_item.added", output_index=len(self.body["output"]) - 1, item=item
        )
        if item["type"] == "message":
            self.send(
                "response.content_part.added",
                **self._where(),
                content_index=0,
                part=_output_text(""),
            )
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
            self.send("response.content_part.added", **self._where(), content_index=0, part=part)

    def close(self, status: str) -> None:
        item = self.open
        if item is None:
            return
        where, text = self._where(), "".join(self.pieces)
        if item["type"] == "function_call":
            self.send("response.function_call_arguments.done", **where, arguments=text)
            done = _call_item(item["id"], item["call_id"], item["name"], text, status)
        else:
            if item["type"] == "message":
                lps, self.logprobs = self.logprobs, []
                part = _output_text(text, lps)
                self.send(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=lps
                )
                done = _message_item(item["id"], text, status, lps)
            else:
                part = {"type": "reasoning_text", "text": text}
                self.send("response.reasoning_text.done", **where, content_index=0, text=text)
                done = _reasoning_item(item["id"], text, status)
            self.send("response.content_part.done", **where, content_index=0, part=part)
        self.body["output"][where["output_index"]] = done
        self.send("response.output_item.done", output_index=where["output_index"], item=done)
        self.open = None

    def _piece(self, kind: str, piece: str, logprobs: list[dict[str, Any]] | None = None) -> None:
        """Text for the open item of `kind` (opened first when another kind is open), with a
        message's the logprobs of the tokens that brought it."""
        if self.open is None or self.open["type"] != kind:
            make = _message_item if kind == "message" else _reasoning_item
            self._add(make(_new_id("msg" if kind == "message" else "rs"), None, "in_progress"))
        self.pieces.append(piece)
        event = (
            "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        )
        extra = {"logprobs": logprobs or []} if kind == "message" else {}
        self.logprobs += logprobs or []
        self.send(event, **self._where(), content_index=0, delta=piece, **extra)

    def delta(self, delta: dict[str, Any]) -> None:
        """One chat-style delta (after the reasoning and tool-call rewrites)."""
        if delta.get("reasoning_content"):
            self.reasoning_pieces.append(delta["reasoning_content"])
            self._piece("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            self._piece("message", delta["content"], delta.get("logprobs"))
        for entry in delta.get("tool_calls", []):
            fn = entry.get("function", {})
            item = self.calls.get(entry["index"])
            if item is None:  # announced: its id and name come first
                item = _call_item(_new_id("fc"), entry["id"], fn["name"], "", "in_progress")
                self.calls[entry["index"]] = item
                self._add(item)
            args = fn.get("arguments") or ""
            if args:
                assert item is self.open, "a call's arguments stream while it is the open item"
                self.pieces.append(args)
                self.send("response.function_call_arguments.delta", **self._where(), delta=args)

    def finish(self, incomplete: bool) -> None:
        """Close the last item (an empty message when nothing was generated)."""
        if not self.body["output"]:
            self._add(_message_item(_new_id("msg"), None, "in_progress"))
        self.close("incomplete" if incomplete else "completed")


# ---- routes ---------------------------------------------------------------------------------
def serve_create_response(app: OpenAIApp, h: Handler) -> None:
    images = app.images is not None
    req = parse_responses(h.read_json(), app.tool_call_parser, app.response_store, images)
    chat = req.chat
    for name in ("temperature", "top_p"):  # echo what runs: the model's default if unset
        if name not in chat.sampling and name in app.sampling_defaults:
            req.echo[name] = app.sampling_defaults[name]
    # vLLM's: the body's request_id is the response id as given (its default is "resp_...")
    rid, created = chat.request_id or _new_id("resp"), int(time.time())
    with responses_params():
        model, lora = app._resolve(chat.model)
        text, ids, reasoning = fit_prompt(app, req)  # truncation "auto" drops old turns
        group, rids = app._submit(
            chat, [text], [ids], rid, chat=True, lora=lora, stream=chat.stream
        )
    if req.background:
        body = _response(rid, created, model, req, "queued")
        _start_background(app, h, req, group, rids, body, reasoning)
        return
    with app._in_flight(h, group, rids, chat.structured_param):
        body = _response(rid, created, model, req, "in_progress")
        if chat.stream:
            if not _stream(app, h, req, body, group, reasoning, lambda b: _store(app, req, b)):
                return
        else:
            app._wait(h, group)
            seq = group.latest[0].outputs[0]
            body["output"], thought = _whole_output(app, chat, seq, reasoning)
            _finish(app, body, group, thought)
            _store(app, req, body)
            h.send_json(200, body)
        usage = body["usage"]
        h.log_extra = f" prompt_tokens={usage['input_tokens']} gen_tokens={usage['output_tokens']}"
        h.log_extra += " stream" if chat.stream else ""


def _start_background(
    app: OpenAIApp,
    h: Handler,
    req: ResponsesRequest,
    group: RequestGroup,
    rids: list[str],
    body: dict[str, Any],
    reasoning: ReasoningRequest | None,
) -> None:
    """Store the queued response, run it on its own thread through the stream path (its
    events kept when the request streams) and answer: the queued response, or its events."""
    stored = StoredResponse({}, req.context, _listed_items(req.input_items))
    run = stored.run = response_background.BackgroundRun(stored, keep_events=req.chat.stream)
    run.publish(body)
    queued = stored.body

    def work() -> None:
        run.publish(body, "in_progress")
        context = req.context  # the finished conversation, for previous_response_id
        _stream(
            app, run, req, body, group, reasoning,
            lambda b: run.settle(b, context + _context_items(b["output"])),
        )  # fmt: skip

    app.response_store.put(stored)
    try:
        response_background.start(app, h, run, group, rids, body, work, req.chat.structured_param)
    except BaseException:  # refused: the client gets the error and never learns the id
        app.response_store.delete(body["id"])
        raise
    h.log_extra = " background"
    if req.chat.stream:
        response_background.serve_events(app, h, stored, {})
    else:
        h.send_json(200, queued)


def _store(app: OpenAIApp, req: ResponsesRequest, body: dict[str, Any]) -> None:
    """Keep a finished response (store=true) for retrieval and previous_response_id: before the
    client sees it end, so a next turn sent right away finds it."""
    if req.store:
        context = req.context + _context_items(body["output"])
        app.response_store.put(StoredResponse(body, context, _listed_items(req.input_items)))


def _listed_items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalized input items in the shape `GET .../input_items` lists them, each with an id."""
    listed = []
    for it in items:
        if it["type"] == "message":
            part = "output_text" if it["role"] == "assistant" else "input_text"
            content = it["content"]  # a string, or a user message's parts with its images
            if isinstance(content, str):
                content = [{"type": part, "text": content}]
            item = {"id": _new_id("msg"), "type": "message", "role": it["role"], "content": content}
        elif it["type"] == "function_call":
            item = {"id": _new_id("fc"), **it}
        elif it["type"] == "reasoning":
            item = _reasoning_item(_new_id("rs"), it["text"] or None, "completed")
        else:
            item = {"id": _new_id("fco"), **it}
        listed.append({**item, "status": "completed"})
    return listed


def _stream(
    app: OpenAIApp,
    h: Handler,
    req: ResponsesRequest,
    body: dict[str, Any],
    group: RequestGroup,
    reasoning: ReasoningRequest | None,
    store: Callable[[dict[str, Any]], None],
) -> bool:
    """The events of one response; False when the engine failed it (reported in-band as
    response.failed). `store` keeps the finished body before the client sees it end."""
    h.start_stream()
    events = _EventStream(h, body)
    events.send("response.created", response=body)  # "queued" when in the background
    body["status"] = "in_progress"
    events.send("response.in_progress", response=body)
    tools = tool_output(req.chat.tools, app.tool_call_parser)
    deltas = ChatDeltas(
        reasoning, tools, app._decoder(req.chat), req.chat.logprobs, app._decode_one
    )
    try:
        for delta in deltas.stream(app.arrivals(h, group)):
            events.delta(delta)
    except APIError as e:
        events.close("incomplete")
        body["status"] = "failed"
        body["error"] = {"code": "server_error", "message": e.message}
        events.send("response.failed", response=body)
        h.end_stream(done=False)
        h.log_extra = f" failed: {e.message}"
        return False
    events.finish(group.latest[0].outputs[0].finish_reason == "length")
    _finish(app, body, group, "".join(events.reasoning_pieces) or None)
    store(body)
    events.send("response.completed", response=body)
    h.end_stream(done=False)
    return True


def serve_get_response(app: OpenAIApp, h: Handler, rid: str) -> None:
    """The stored response (a background one as it stands); with `stream=true`, a background
    streamed response's events (`starting_after` a sequence number)."""
    stored = app.response_store.get(rid)
    if stored is None:
        raise _not_found(rid)
    query = parse_qs(urlsplit(h.path).query)
    stream = query.get("stream", ["false"])[-1].lower()
    if stream not in ("true", "false"):
        raise APIError(400, f"stream must be 'true' or 'false', got {stream!r}", "stream")
    if stream == "true":
        response_background.serve_events(app, h, stored, query)
    else:
        h.send_json(200, stored.body)


def serve_delete_response(app: OpenAIApp, h: Handler, rid: str) -> None:
    """Forget a response (a background one still running is cancelled first)."""
    stored = app.response_store.get(rid)
    if stored is not None and stored.run is not None:
        stored.run.cancel()
    if not app.response_store.delete(rid):
        raise _not_found(rid)
    h.send_json(200, {"id": rid, "object": "response", "deleted": True})


def serve_input_items(app: OpenAIApp, h: Handler, rid: str) -> None:
    """OpenAI's `GET /v1/responses/{id}/input_items`: the items of the request's `input`
    (not the earlier turns of `previous_response_id`), newest first unless `order=asc`, `limit`
    (1-100, default 20) at a time after the item id `after`."""
    stored = app.response_store.get(rid)
    if stored is None:
        raise _not_found(rid)
    query = parse_qs(urlsplit(h.path).query)
    order = query.get("order", ["desc"])[-1]
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be 'asc' or 'desc', got {order!r}", "order")
    limit = query_int(query, "limit", 20, 1, 100, "an integer from 1 to 100")
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    after = query.get("after", [None])[-1]
    if after is not None:
        ids = [it["id"] for it in items]
        if after not in ids:
            raise APIError(400, f"no input item {after!r} in response {rid!r}", "after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    h.send_json(
        200,
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > len(page),
        },
    )


def serve_cancel_response(app: OpenAIApp, h: Handler, rid: str) -> None:
    """`POST /v1/responses/{id}/cancel`: a background response still queued or in progress
    stops (its engine requests aborted) and answers "cancelled"; cancelling it again answers
    the same. Any other response is refused (vLLM's message for one that was not background)."""
    stored = app.response_store.get(rid)
    if stored is None:
        raise _not_found(rid)
    if stored.run is None:
        raise APIError(400, "Cannot cancel a synchronous response.", "response_id")
    if not stored.run.cancel():
        raise APIError(
            400,
            f"Cannot cancel response {rid!r}: it is already {stored.body['status']}",
            "response_id",
        )
    h.send_json(200, stored.body)


def serve_input_tokens(app: OpenAIApp, h: Handler) -> None:
    """OpenAI's `POST /v1/responses/input_tokens`: the prompt tokens a `POST /v1/responses`
    with this body would take (its chat template rendered, nothing generated)."""
    images = app.images is not None
    req = parse_responses(h.read_json(), app.tool_call_parser, app.response_store, images)
    with responses_params():
        app._resolve(req.chat.model)
        _, ids, _ = fit_prompt(app, req)
    h.send_json(200, {"object": "response.input_tokens", "input_tokens": len(ids)})


def _not_found(rid: str) -> APIError:
    return APIError(404, f"Response with id {rid!r} not found.", "response_id", "not_found")
