"""OpenAI's Responses API over the chat path: `POST /v1/responses`, `GET` / `DELETE
/v1/responses/{id}`.

    request    instructions + (the previous response's context) + input items
               -> a chat-completions body -> parse_chat (messages, tools, tool_choice,
               structured outputs and sampling checked there) -> the chat template
    response   the text -> reasoning split (--reasoning-parser) -> tool calls (tools.py)
               -> output items: [reasoning] [message] [function_call ...]

Input items (normalized to `message` / `function_call` / `function_call_output` dicts; a past
turn's `reasoning` items are dropped, as chat templates drop past thinking) become chat
messages: a `function_call` joins the assistant message before it as one of its `tool_calls`,
a `function_call_output` is a `tool` message. Errors name the Responses field
(`max_output_tokens`, `text.format`, `input[2].content`), never the chat one.

A stream is OpenAI's typed events (`event: <type>` + `data: <json>`, `sequence_number` 0, 1, ...):
response.created, response.in_progress, then per output item output_item.added, its deltas
(reasoning_text / output_text / function_call_arguments), their .done events, output_item.done,
and last response.completed holding the whole response (also when its status is "incomplete",
as vLLM does, so the SDK's `responses.stream(...).get_final_response()` works). No `[DONE]`.

`store` (OpenAI's default: true) keeps the finished response, with its conversation, in a
bounded LRU: `GET /v1/responses/{id}` answers it and `previous_response_id` continues it.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paged_server.errors import APIError, bad_request
from paged_server.openai_protocol import GenerationRequest, parse_chat
from paged_server.openai_responses import StreamChoice
from paged_server.reasoning import ReasoningOutput, ReasoningRequest, split_reasoning
from paged_server.tools import ToolOutput, make_parser

if TYPE_CHECKING:
    from paged_server.app import OpenAIApp
    from paged_server.http import Handler
    from paged_server.request_group import RequestGroup

MAX_STORED = 1000
# fmt: off
_FIELDS = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "seed",
    "stream", "stream_options", "tools", "tool_choice", "parallel_tool_calls", "text", "store",
    "previous_response_id", "metadata", "user", "include", "background", "truncation",
    "reasoning", "max_tool_calls", "top_logprobs",
})
# Accepted and ignored: they change nothing about generation.
_IGNORED = frozenset({
    "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
    "prompt_cache_options",
})
# fmt: on
_NOT_SUPPORTED = frozenset({"conversation", "prompt", "context_management"})
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")
_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})
# chat-completions parameter names as the Responses API spells them (errors name these)
_RENAMED = {
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@contextmanager
def _responses_params() -> Iterator[None]:
    """Errors of the chat path, renamed to the Responses fields the client sent."""
    try:
        yield
    except APIError as e:
        if e.param in _RENAMED:
            old, new = e.param, _RENAMED[e.param]
            e.param, e.message = new, e.message.replace(old, new)
        elif e.param is not None and e.param.startswith("messages"):
            e.param = "input"
        raise


# ---- the request ----------------------------------------------------------------------------
@dataclass(slots=True)
class ResponsesRequest:
    chat: GenerationRequest  # what the chat path runs
    context: list[dict[str, Any]]  # normalized items: the previous context + this input
    echo: dict[str, Any]  # request fields the response object repeats
    store: bool


def _text(param: str, content: Any, kinds: tuple[str, ...]) -> str:
    """A string, or a list of text parts of `kinds`, joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or a list of content parts", param)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in kinds:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(
                f"{param}[{j}]: content part {kind!r} is not supported (only {', '.join(kinds)})",
                f"{param}[{j}]",
            )
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{param}[{j}].text must be a string", f"{param}[{j}].text")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param}.{key} must be a non-empty string", f"{param}.{key}")
    return value


def _input_items(value: Any) -> list[dict[str, Any]]:
    """`input` -> normalized items; a string is one user message."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad_request("'input' must be a string or a list of input items", "input")
    items = []
    for i, item in enumerate(value):
        p = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{p} must be an object", p)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad_request(f"{p}.role must be one of {list(_ROLES)}, got {role!r}", p)
            content = _text(f"{p}.content", item.get("content"), _TEXT_PARTS)
            items.append({"type": "message", "role": role, "content": content})
        elif kind == "function_call":
            args = item.get("arguments")
            try:
                ok = isinstance(args, str) and isinstance(json.loads(args or "{}"), dict)
            except ValueError:
                ok = False
            if not ok:
                raise bad_request(f"{p}.arguments must be a JSON object as text", f"{p}.arguments")
            call = {"call_id": _string(item, "call_id", p), "name": _string(item, "name", p)}
            items.append({"type": "function_call", **call, "arguments": args})
        elif kind == "function_call_output":
            output = _text(f"{p}.output", item.get("output"), ("input_text",))
            call_id = _string(item, "call_id", p)
            items.append({"type": "function_call_output", "call_id": call_id, "output": output})
        elif kind != "reasoning":  # a past turn's reasoning: chat templates drop it
            raise bad_request(
                f"{p}: input items of type {kind!r} are not supported (message, function_call, "
                "function_call_output, reasoning)",
                p,
            )
    return items


def _messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalized items -> chat messages; a function call joins the assistant turn before it."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    for it in items:
        if it["type"] == "message":
            messages.append({"role": it["role"], "content": it["content"]})
        elif it["type"] == "function_call":
            fn = {"name": it["name"], "arguments": it["arguments"]}
            call = {"id": it["call_id"], "type": "function", "function": fn}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append(
                {"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]}
            )
    return messages


def _tools(value: Any) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]]]:
    """Responses function tools -> (chat tools, the tools as the response echoes them)."""
    if value is None:
        return None, []
    if not isinstance(value, list):
        raise bad_request("'tools' must be a list of tools", "tools")
    chat, echo = [], []
    for i, tool in enumerate(value):
        p = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{p} must be an object", p)
        if tool.get("type") != "function":
            raise bad_request(
                f"{p}: tool type {tool.get('type')!r} is not supported: this server runs "
                "function tools only",
                p,
            )
        unknown = sorted(set(tool) - _TOOL_KEYS)
        if unknown:
            raise bad_request(f"{p}: unknown field {unknown[0]!r}", f"{p}.{unknown[0]}")
        name = _string(tool, "name", p)
        fn: dict[str, Any] = {"name": name}
        for key, kind in (("description", str), ("parameters", dict), ("strict", bool)):
            v = tool.get(key)
            if v is not None and not isinstance(v, kind):
                raise bad_request(f"{p}.{key} must be a {kind.__name__}", f"{p}.{key}")
            if v is not None and key != "strict":  # strict: no schema check under "auto"
                fn[key] = v
        chat.append({"type": "function", "function": fn})
        echo.append(
            {
                "type": "function",
                "name": name,
                "description": tool.get("description"),
                "parameters": tool.get("parameters"),
                "strict": tool.get("strict"),
            }
        )
    return chat, echo


def _tool_choice(value: Any, has_tools: bool) -> Any:
    """Responses `tool_choice` -> the chat form (parse_tools checks the rest)."""
    if value == "auto" and not has_tools:
        return None  # nothing to choose from: plain text, as OpenAI answers
    if isinstance(value, dict):
        if value.get("type") != "function" or not isinstance(value.get("name"), str):
            raise bad_request(
                "'tool_choice' must be 'none', 'auto', 'required' or "
                "{'type': 'function', 'name': ...}",
                "tool_choice",
            )
        return {"type": "function", "function": {"name": value["name"]}}
    return value


def _text_format(value: Any) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """`text` -> (chat response_format or None, the text config as the response echoes it)."""
    if value is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(value, dict):
        raise bad_request("'text' must be an object", "text")
    for key, v in value.items():
        if key != "format" and v is not None:
            raise bad_request(
                f"parameter 'text.{key}' is not supported by this server", f"text.{key}"
            )
    fmt = value.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return ({"type": kind} if kind == "json_object" else None), {"format": {"type": kind}}
    if kind != "json_schema":
        raise bad_request(
            "'text.format.type' must be 'text', 'json_object' or 'json_schema'", "text.format"
        )
    name, schema, strict = fmt.get("name"), fmt.get("schema"), fmt.get("strict")
    if not isinstance(name, str) or not name:
        raise bad_request("'text.format.name' must be a non-empty string", "text.format.name")
    if not isinstance(schema, dict):
        raise bad_request("'text.format.schema' must be a JSON schema object", "text.format.schema")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("'text.format.strict' must be a boolean", "text.format.strict")
    desc = fmt.get("description")
    if desc is not None and not isinstance(desc, str):
        raise bad_request("'text.format.description' must be a string", "text.format.description")
    spec = {"name": name, "schema": schema, "strict": strict}
    return {"type": "json_schema", "json_schema": spec}, {
        "format": {"type": "json_schema", **spec, "description": desc}
    }


def _metadata(value: Any) -> dict[str, str] | None:
    """OpenAI's limits: at most 16 pairs, keys up to 64 characters, values up to 512."""
    if value is None:
        return None
    ok = (
        isinstance(value, dict)
        and len(value) <= 16
        and all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
            for k, v in value.items()
        )
    )
    if not ok:
        raise bad_request(
            "'metadata' must map at most 16 strings (keys up to 64 characters) to strings "
            "(up to 512 characters)",
            "metadata",
        )
    return value


def _check_off(body: dict[str, Any]) -> None:
    """Fields accepted only at values that ask for nothing this server lacks."""
    if body.get("background"):
        raise bad_request("background responses are not supported by this server", "background")
    if body.get("truncation") not in (None, "disabled"):
        raise bad_request("'truncation' must be 'disabled': input is never dropped", "truncation")
    include = body.get("include")
    if include not in (None, []):
        raise bad_request(
            f"'include' values are not supported by this server: {include!r}", "include"
        )
    if body.get("top_logprobs") not in (None, 0):
        raise bad_request("'top_logprobs' is not supported by this server", "top_logprobs")
    reasoning = body.get("reasoning")
    if reasoning is not None and (
        not isinstance(reasoning, dict) or any(v is not None for v in reasoning.values())
    ):
        raise bad_request(
            "'reasoning' options are not supported: the model reasons as its chat template "
            "lets it (--reasoning-parser splits it off)",
            "reasoning",
        )
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_obfuscation"}):
        raise bad_request(
            "'stream_options' must be {\"include_obfuscation\": bool}", "stream_options"
        )
    max_calls = body.get("max_tool_calls")
    if max_calls is not None and (
        not isinstance(max_calls, int) or isinstance(max_calls, bool) or max_calls < 1
    ):
        raise bad_request("'max_tool_calls' must be a positive integer", "max_tool_calls")


def parse_responses(body: Any, tool_parser: str | None, store: ResponseStore) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    for key in body:
        if key in _NOT_SUPPORTED:
            raise bad_request(f"parameter '{key}' is not supported by this server", key)
        if key not in _FIELDS and key not in _IGNORED:
            raise bad_request(f"Unrecognized request argument supplied: {key}", key)
    _check_off(body)
    if "input" not in body:
        raise bad_request("'input' is required", "input")
    items = _input_items(body["input"])
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("'instructions' must be a string", "instructions")
    prev_id = body.get("previous_response_id")
    if prev_id is not None:
        prev = store.get(prev_id) if isinstance(prev_id, str) else None
        if prev is None:
            raise APIError(
                400,
                f"Previous response with id {prev_id!r} not found.",
                "previous_response_id",
                "previous_response_not_found",
            )
        items = prev.context + items  # its instructions are not carried over (OpenAI's rule)
    messages = _messages(instructions, items)
    if not messages:
        raise bad_request("'input' must hold at least one item", "input")
    do_store = body.get("store", True)
    if not isinstance(do_store, bool):
        raise bad_request("'store' must be a boolean", "store")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("'user' must be a string", "user")
    parallel = body.get("parallel_tool_calls")
    tools, tools_echo = _tools(body.get("tools"))
    response_format, text_echo = _text_format(body.get("text"))
    chat_body = {
        "messages": messages,
        "model": body.get("model"),
        "stream": body.get("stream"),
        "max_completion_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "seed": body.get("seed"),
        "tools": tools,
        "tool_choice": _tool_choice(body.get("tool_choice"), bool(tools)),
        "parallel_tool_calls": True if parallel is None else parallel,
        "response_format": response_format,
    }
    with _responses_params():
        chat = parse_chat(chat_body, tool_parser)
    echo = {
        "instructions": instructions,
        "max_output_tokens": chat.max_tokens,
        "max_tool_calls": body.get("max_tool_calls"),
        "metadata": _metadata(body.get("metadata")) or {},
        "parallel_tool_calls": chat_body["parallel_tool_calls"],
        "previous_response_id": prev_id,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "store": do_store,
        "temperature": chat.sampling.get("temperature", 1.0),
        "text": text_echo,
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": tools_echo,
        "top_logprobs": 0,
        "top_p": chat.sampling.get("top_p", 1.0),
        "truncation": "disabled",
        "user": user,
    }
    return ResponsesRequest(chat=chat, context=items, echo=echo, store=do_store)


# ---- stored responses -----------------------------------------------------------------------
@dataclass(slots=True)
class StoredResponse:
    body: dict[str, Any]  # the response object, as it was answered
    context: list[dict[str, Any]]  # normalized items: every input so far and this output


class ResponseStore:
    """The newest `capacity` stored responses (least recently used dropped first)."""

    def __init__(self, capacity: int = MAX_STORED) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()  # HTTP threads share it

    def put(self, stored: StoredResponse) -> None:
        with self._lock:
            self._items[stored.body["id"]] = stored
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, rid: str) -> StoredResponse | None:
        with self._lock:
            stored = self._items.get(rid)
            if stored is not None:
                self._items.move_to_end(rid)
            return stored

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._items.pop(rid, None) is not None

    def __len__(self) -> int:
        return len(self._items)


def _context_items(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as the next turn's input items (normalized; reasoning dropped)."""
    items = []
    for it in output:
        if it["type"] == "message":
            text = "".join(part["text"] for part in it["content"])
            items.append({"type": "message", "role": "assistant", "content": text})
        elif it["type"] == "function_call":
            call = {k: it[k] for k in ("call_id", "name", "arguments")}
            items.append({"type": "function_call", **call})
    return items


# ---- output items and the response object ---------------------------------------------------
def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_output_text(text)]
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
        "background": False,
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


def _tool_output(app: OpenAIApp, req: GenerationRequest) -> ToolOutput | None:
    if req.tools is None or req.tools.choice == "none":
        return None
    return ToolOutput(req.tools, make_parser(app.tool_call_parser))


def _whole_output(
    app: OpenAIApp, req: GenerationRequest, text: str, reason: str | None, parser: str | None
) -> tuple[list[dict[str, Any]], str | None]:
    """A finished output's items: [reasoning] [message] [function_call ...]; and its reasoning
    text. A message is there when it has text, or when nothing else is."""
    thought, answer = split_reasoning(parser, text) if parser is not None else (None, text)
    content, calls = answer, []
    tool_out = _tool_output(app, req)
    if tool_out is not None:
        msg, _ = tool_out.message(answer, reason)
        content, calls = msg["content"], msg.get("tool_calls", [])
    items = []
    if thought is not None:
        items.append(_reasoning_item(_new_id("rs"), thought, "completed"))
    if content or not (calls or items):
        items.append(_message_item(_new_id("msg"), content or "", "completed"))
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
        self.text = ""  # the open item's text (reasoning, message) or arguments (call)
        self.calls: dict[int, dict[str, Any]] = {}  # the tool-call stream's index -> its item
        self.reasoning = ""  # all of it: its token count goes into the usage

    def send(self, kind: str, **fields: Any) -> None:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        data = b"event: %s\ndata: %s\n\n" % (kind.encode(), json.dumps(event).encode())
        if self.h.chunked:  # http.py's framing (its send_event writes data lines only)
            data = b"%x\r\n%s\r\n" % (len(data), data)
        self.h.wfile.write(data)
        self.h.wfile.flush()

    def end(self) -> None:
        if self.h.chunked:
            self.h.wfile.write(b"0\r\n\r\n")
            self.h.wfile.flush()

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.body["output"]) - 1}

    def _add(self, item: dict[str, Any]) -> None:
        self.close("completed")
        self.open, self.text = item, ""
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
        where, text = self._where(), self.text
        if item["type"] == "function_call":
            self.send("response.function_call_arguments.done", **where, arguments=text)
            done = _call_item(item["id"], item["call_id"], item["name"], text, status)
        else:
            if item["type"] == "message":
                part = _output_text(text)
                self.send(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
                )
                done = _message_item(item["id"], text, status)
            else:
                part = {"type": "reasoning_text", "text": text}
                self.send("response.reasoning_text.done", **where, content_index=0, text=text)
                done = _reasoning_item(item["id"], text, status)
            self.send("response.content_part.done", **where, content_index=0, part=part)
        self.body["output"][where["output_index"]] = done
        self.send("response.output_item.done", output_index=where["output_index"], item=done)
        self.open = None

    def _piece(self, kind: str, piece: str) -> None:
        """Text for the open item of `kind` (opened first when another kind is open)."""
        if self.open is None or self.open["type"] != kind:
            make = _message_item if kind == "message" else _reasoning_item
            self._add(make(_new_id("msg" if kind == "message" else "rs"), None, "in_progress"))
        self.text += piece
        event = (
            "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        )
        extra = {"logprobs": []} if kind == "message" else {}
        self.send(event, **self._where(), content_index=0, delta=piece, **extra)

    def delta(self, delta: dict[str, Any]) -> None:
        """One chat-style delta (after the reasoning and tool-call rewrites)."""
        if delta.get("reasoning_content"):
            self.reasoning += delta["reasoning_content"]
            self._piece("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            self._piece("message", delta["content"])
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
                self.text += args
                self.send("response.function_call_arguments.delta", **self._where(), delta=args)

    def finish(self, incomplete: bool) -> None:
        """Close the last item (an empty message when nothing was generated)."""
        if not self.body["output"]:
            self._add(_message_item(_new_id("msg"), None, "in_progress"))
        self.close("incomplete" if incomplete else "completed")


# ---- routes ---------------------------------------------------------------------------------
def serve_create_response(app: OpenAIApp, h: Handler) -> None:
    req = parse_responses(h.read_json(), app.tool_call_parser, app.response_store)
    chat = req.chat
    rid, created = _new_id("resp"), int(time.time())
    with _responses_params():
        model, lora = app._resolve(chat.model)
        text, ids, reasoning = app._chat_prompt(chat)
        group, rids = app._submit(
            chat, [text], [ids], rid, chat=True, lora=lora, stream=chat.stream
        )
    with app._in_flight(h, group, rids):
        body = _response(rid, created, model, req, "in_progress")
        if chat.stream:
            if not _stream(app, h, req, body, group, reasoning):
                return
        else:
            app._wait(h, group)
            seq = group.latest[0].outputs[0]
            parser = None if reasoning is None else reasoning.parser
            body["output"], thought = _whole_output(app, chat, seq.text, seq.finish_reason, parser)
            _finish(app, body, group, thought)
            h.send_json(200, body)
        usage = body["usage"]
        h.log_extra = f" prompt_tokens={usage['input_tokens']} gen_tokens={usage['output_tokens']}"
        h.log_extra += " stream" if chat.stream else ""
    if req.store:
        app.response_store.put(StoredResponse(body, req.context + _context_items(body["output"])))


def _stream(
    app: OpenAIApp,
    h: Handler,
    req: ResponsesRequest,
    body: dict[str, Any],
    group: RequestGroup,
    reasoning: ReasoningRequest | None,
) -> bool:
    """The events of one response; False when the engine failed it (reported in-band as
    response.failed)."""
    h.start_stream()
    events = _EventStream(h, body)
    events.send("response.created", response=body)
    events.send("response.in_progress", response=body)
    choice = StreamChoice()
    think = None if reasoning is None else ReasoningOutput(reasoning)
    tools = _tool_output(app, req.chat)
    try:
        while not group.done:
            arrived = group.next(app.poll_interval)
            if not arrived:
                if h.client_gone():
                    raise ConnectionResetError("client disconnected")
                continue
            for _, out in arrived:
                for seq in out.outputs:
                    choice.add(seq, out.finished)
            entry = choice.chunk(0, "", None, app._decode_one, True)
            if entry is not None and think is not None:
                entry = think.rewrite(entry)
            if entry is not None and tools is not None:
                entry = tools.rewrite(entry)
            if entry is not None:
                events.delta(entry["delta"])
    except APIError as e:
        events.close("incomplete")
        body["status"] = "failed"
        body["error"] = {"code": "server_error", "message": e.message}
        events.send("response.failed", response=body)
        events.end()
        h.log_extra = f" failed: {e.message}"
        return False
    events.finish(group.latest[0].outputs[0].finish_reason == "length")
    _finish(app, body, group, events.reasoning or None)
    events.send("response.completed", response=body)
    events.end()
    return True


def serve_get_response(app: OpenAIApp, h: Handler, rid: str) -> None:
    stored = app.response_store.get(rid)
    if stored is None:
        raise _not_found(rid)
    h.send_json(200, stored.body)


def serve_delete_response(app: OpenAIApp, h: Handler, rid: str) -> None:
    if not app.response_store.delete(rid):
        raise _not_found(rid)
    h.send_json(200, {"id": rid, "object": "response", "deleted": True})


def _not_found(rid: str) -> APIError:
    return APIError(404, f"Response with id {rid!r} not found.", "response_id", "not_found")
