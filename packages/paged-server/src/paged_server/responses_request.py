"""A Responses API request (`POST /v1/responses`) -> the chat request that runs it.

    instructions + (the previous response's context) + input items
    -> a chat-completions body -> parse_chat (messages, tools, tool_choice, structured outputs
    and sampling checked there)

Input items (normalized to `message` / `function_call` / `function_call_output` / `reasoning`
dicts) become chat messages: a `reasoning` item opens an assistant message as its
`reasoning_content` (its content's text, else its summary's; vLLM's reading too), which the
assistant message or `function_call`s after it join, so the template sees the turn as the
model wrote it (Qwen3's keeps the current turn's thinking, drops older turns'); a
`function_call` joins the assistant message before it as one of its `tool_calls`, a
`function_call_output` is a `tool` message; a user message's `input_image` parts become chat
`image_url` parts. Errors name the Responses field (`max_output_tokens`, `text.format`,
`input[2].content`, `input[0].content[1].image_url`), never the chat one.
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from paged_server.errors import APIError, bad_request, renamed_params
from paged_server.openai_protocol import GenerationRequest, check_defaults, parse_chat
from paged_server.responses_truncation import TurnCuts, turn_cuts

if TYPE_CHECKING:
    from paged_server.responses_api import ResponseStore

# fmt: off
# vLLM's extras of ResponsesRequest (sent by clients' extra_body: the Agents SDK's,
# pydantic-ai's): passed to the chat request as they are, checked and named there
# (`request_id` becomes the response's id: responses_api).
_VLLM_SAMPLING = (
    "top_k", "repetition_penalty", "stop", "ignore_eos", "logit_bias", "skip_special_tokens",
    "include_stop_str_in_output", "vllm_xargs", "mm_processor_kwargs", "media_io_kwargs",
    "structured_outputs", "kv_transfer_params", "request_id",
)
_FIELDS = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "seed",
    "stream", "stream_options", "tools", "tool_choice", "parallel_tool_calls", "text", "store",
    "previous_response_id", "metadata", "user", "include", "background", "truncation",
    "reasoning", "max_tool_calls", "top_logprobs", "priority", "cache_salt", *_VLLM_SAMPLING,
})
# Accepted and ignored: they change nothing about generation.
_IGNORED = frozenset({
    "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
    "prompt_cache_options",
    "chat_template_kwargs",  # vLLM's internal field: it overwrites whatever a client sent
})
# vLLM's extras left out, accepted at their defaults only
_OFF = {"enable_response_messages": (None, False), "previous_input_messages": (None, [])}
# fmt: on
_NOT_SUPPORTED = frozenset({"conversation", "prompt", "context_management"})
# `include` values: the message's logprobs are returned; the others name what built-in tools
# (none here) or encrypted reasoning (none here: reasoning items are plain) would add.
LOGPROBS = "message.output_text.logprobs"
_INCLUDES = frozenset({
    LOGPROBS, "reasoning.encrypted_content", "code_interpreter_call.outputs",
    "computer_call_output.output.image_url", "file_search_call.results",
    "message.input_image.image_url", "web_search_call.action.sources", "web_search_call.results",
})  # fmt: skip
# reasoning.summary (generate_summary: its deprecated name): OpenAI's three values are taken,
# and there is no summarizer (vLLM validates them the same way and makes none either).
_SUMMARY_KEYS = ("summary", "generate_summary")
_SUMMARIES = (None, "auto", "concise", "detailed")
_REASONING_KEYS = frozenset({"effort", *_SUMMARY_KEYS})
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")
_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})
# chat-completions parameter names as the Responses API spells them (errors name these)
_RENAMED = {
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}


def responses_params() -> AbstractContextManager[None]:
    """Errors of the chat path, renamed to the Responses fields the client sent."""
    return renamed_params(_RENAMED, "input")


# ---- the request ----------------------------------------------------------------------------
@dataclass(slots=True)
class ResponsesRequest:
    chat: GenerationRequest  # what the chat path runs
    context: list[dict[str, Any]]  # normalized items: the previous context + this input
    echo: dict[str, Any]  # request fields the response object repeats
    store: bool
    input_items: list[dict[str, Any]]  # normalized items of this request's `input` alone
    background: bool = False  # answered at once, run on (response_background.py)
    cuts: TurnCuts | None = None  # truncation "auto": where the conversation may be cut


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


_IMAGE_DETAILS = ("auto", "low", "high")


def _message_content(param: str, role: str, content: Any, images: bool) -> str | list:
    """A message's content: its text; or, when it holds `input_image` parts (a user message,
    a model that takes images), its parts in order, normalized: `input_text` and
    `input_image` (`image_url` a data: or http(s) URL; `file_id` is not supported)."""
    has_image = isinstance(content, list) and any(
        isinstance(part, dict) and part.get("type") == "input_image" for part in content
    )
    if not (images and has_image):
        return _text(param, content, _TEXT_PARTS)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "input_image":
            if role != "user":
                raise bad_request(f"{p}: images are taken in user messages only", p)
            url, detail = part.get("image_url"), part.get("detail", "auto")
            if not isinstance(url, str) or not url:
                why = "file_id is not supported: " if part.get("file_id") is not None else ""
                raise bad_request(
                    f"{p}.image_url: {why}give the image as a data:image/...;base64 URL or an "
                    "http(s) URL",
                    f"{p}.image_url",
                )
            if detail not in _IMAGE_DETAILS:
                raise bad_request(
                    f"{p}.detail must be one of {', '.join(_IMAGE_DETAILS)}", f"{p}.detail"
                )
            parts.append({"type": "input_image", "image_url": url, "detail": detail})
        elif kind not in _TEXT_PARTS:
            raise bad_request(
                f"{p}: content part {kind!r} is not supported (only input_text, output_text, "
                "input_image)",
                p,
            )
        elif not isinstance(part.get("text"), str):
            raise bad_request(f"{p}.text must be a string", f"{p}.text")
        else:
            parts.append({"type": "input_text", "text": part["text"]})
    return parts


def _chat_content(content: str | list) -> str | list:
    """Normalized message content -> chat-completions content (image parts as `image_url`)."""
    if isinstance(content, str):
        return content
    return [
        {"type": "text", "text": part["text"]}
        if part["type"] == "input_text"
        else {"type": "image_url", "image_url": {"url": part["image_url"]}}
        for part in content
    ]


def _image_params(items: list[dict[str, Any]], earlier: int) -> list[str]:
    """Where each image of the conversation came from, in order: an earlier turn
    (`previous_response_id`; the first `earlier` items), or `input[i].content[j].image_url`."""
    names = []
    for k, it in enumerate(items):
        content = it.get("content") if it["type"] == "message" else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if part["type"] == "input_image":
                i = k - earlier
                names.append(
                    f"input[{i}].content[{j}].image_url" if i >= 0 else "previous_response_id"
                )
    return names


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param}.{key} must be a non-empty string", f"{param}.{key}")
    return value


def _input_items(value: Any, images: bool = False) -> list[dict[str, Any]]:
    """`input` -> normalized items; a string is one user message. `images`: the model takes
    images (else an `input_image` part is a 400)."""
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
            content = _message_content(f"{p}.content", role, item.get("content"), images)
            items.append({"type": "message", "role": role, "content": content})
        elif kind == "function_call":
            args = item.get("arguments")
            try:
                ok = isinstance(args, str) and isinstance(json.loads(args or "{}"), dict)
            except (ValueError, RecursionError):  # 100k "[" raise the latter
                ok = False
            if not ok:
                raise bad_request(f"{p}.arguments must be a JSON object as text", f"{p}.arguments")
            call = {"call_id": _string(item, "call_id", p), "name": _string(item, "name", p)}
            items.append({"type": "function_call", **call, "arguments": args})
        elif kind == "function_call_output":
            output = _text(f"{p}.output", item.get("output"), ("input_text",))
            call_id = _string(item, "call_id", p)
            items.append({"type": "function_call_output", "call_id": call_id, "output": output})
        elif kind == "reasoning":
            items.append({"type": "reasoning", "text": _reasoning_text(item, p)})
        else:
            raise bad_request(
                f"{p}: input items of type {kind!r} are not supported (message, function_call, "
                "function_call_output, reasoning)",
                p,
            )
    return items


def _reasoning_text(item: dict[str, Any], p: str) -> str:
    """A reasoning item's text: its content's `reasoning_text` parts, else its summary's
    parts; encrypted reasoning (which this server never returns) is a 400."""
    if item.get("encrypted_content"):
        raise bad_request(
            f"{p}.encrypted_content: encrypted reasoning is not supported (this server returns "
            "reasoning as plain content)",
            f"{p}.encrypted_content",
        )
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list) or not all(
            isinstance(x, dict) and isinstance(x.get("text"), str) for x in parts
        ):
            raise bad_request(f"{p}.{key} must be a list of text parts", f"{p}.{key}")
        if parts:
            return "".join(x["text"] for x in parts)
    return ""


def _messages(
    instructions: str | None, items: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[int]]:
    """Normalized items -> (chat messages, the index of the message each item opens or joins);
    a function call joins the assistant turn before it."""
    messages: list[dict[str, Any]] = []
    starts: list[int] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    for it in items:
        last = messages[-1] if messages else {}
        # a reasoning item's message waits for the answer it reasoned toward
        thought = (
            "reasoning_content" in last and last["content"] is None and "tool_calls" not in last
        )
        answer = it["type"] == "message" and it["role"] == "assistant" and thought
        more = it["type"] == "reasoning" and bool(it["text"]) and thought  # one turn's thinking
        joins = (
            answer or more or (it["type"] == "function_call" and last.get("role") == "assistant")
        )
        starts.append(len(messages) - 1 if joins else len(messages))
        if answer:
            last["content"] = _chat_content(it["content"])
        elif more:
            last["reasoning_content"] += "\n" + it["text"]
        elif it["type"] == "message":
            messages.append({"role": it["role"], "content": _chat_content(it["content"])})
        elif it["type"] == "reasoning":
            if it["text"]:  # (an empty one adds nothing)
                messages.append(
                    {"role": "assistant", "content": None, "reasoning_content": it["text"]}
                )
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
    return messages, starts


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
    return chat or None, echo  # (none: no tools; the chat route refuses an empty list)


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
    if body.get("truncation") not in (None, "disabled", "auto"):
        raise bad_request(
            f"'truncation' must be 'auto' or 'disabled', got {body['truncation']!r}", "truncation"
        )
    include = body.get("include") or []
    known = isinstance(include, list) and all(isinstance(v, str) for v in include)
    if not known or not set(include) <= _INCLUDES:
        raise bad_request(
            f"'include' must be a list of {', '.join(sorted(_INCLUDES))}; got {include!r}",
            "include",
        )
    top = body.get("top_logprobs")
    if top is not None and (
        isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20
    ):
        raise bad_request("'top_logprobs' must be an integer from 0 to 20", "top_logprobs")
    reasoning = body.get("reasoning")
    if reasoning is not None and (
        not isinstance(reasoning, dict)
        or any(v is not None for k, v in reasoning.items() if k not in _REASONING_KEYS)
    ):
        raise bad_request(
            "'reasoning' options other than 'effort' are not supported: the model reasons as "
            "its chat template lets it (--reasoning-parser splits it off)",
            "reasoning",
        )
    for key in _SUMMARY_KEYS:  # LangChain's and the Agents SDK's {"summary": "auto"}
        value = (reasoning or {}).get(key)
        if not isinstance(value, (str, type(None))) or value not in _SUMMARIES:
            raise bad_request(
                f"'reasoning.{key}' must be 'auto', 'concise', 'detailed' or null, got "
                f"{value!r} (there is no summarizer here: the reasoning item's 'content' "
                "carries the reasoning text, its 'summary' is empty)",
                f"reasoning.{key}",
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


def parse_responses(
    body: Any, tool_parser: str | None, store: ResponseStore, images: bool = False
) -> ResponsesRequest:
    """The request; `images`: the model takes images (`input_image` parts)."""
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    for key in body:
        if key in _NOT_SUPPORTED:
            if body[key] is None:  # no value (vLLM's: a null `prompt` is accepted)
                continue
            raise bad_request(f"parameter '{key}' is not supported by this server", key)
        if key not in _FIELDS and key not in _IGNORED and key not in _OFF:
            raise bad_request(f"Unrecognized request argument supplied: {key}", key)
    check_defaults(body, _OFF)
    _check_off(body)
    if "input" not in body:
        raise bad_request("'input' is required", "input")
    items = own = _input_items(body["input"], images)
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
        if prev.body["status"] in ("queued", "in_progress"):  # a background one, still running
            raise bad_request(
                f"Previous response {prev_id!r} is still {prev.body['status']}: continue it "
                "once it finished (poll GET /v1/responses/{id})",
                "previous_response_id",
            )
        items = prev.context + items  # its instructions are not carried over (OpenAI's rule)
    messages, starts = _messages(instructions, items)
    if not messages:
        raise bad_request("'input' must hold at least one item", "input")
    do_store = body.get("store", True)
    if not isinstance(do_store, bool):
        raise bad_request("'store' must be a boolean", "store")
    background = body.get("background") is True
    if body.get("background") not in (None, True, False):
        raise bad_request("'background' must be a boolean", "background")
    if background and not do_store:
        raise bad_request("background responses need 'store': true (they are polled)", "background")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("'user' must be a string", "user")
    parallel = body.get("parallel_tool_calls")
    tools, tools_echo = _tools(body.get("tools"))
    response_format, text_echo = _text_format(body.get("text"))
    effort = (body.get("reasoning") or {}).get("effort")  # checked by parse_chat
    summary = (body.get("reasoning") or {}).get("summary")  # one of _SUMMARIES (_check_off)
    chat_body = {
        "messages": messages,
        "model": body.get("model"),
        "stream": body.get("stream"),
        "max_completion_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "seed": body.get("seed"),
        "priority": body.get("priority"),
        "cache_salt": body.get("cache_salt"),
        "tools": tools,
        "tool_choice": _tool_choice(body.get("tool_choice"), bool(tools)),
        "parallel_tool_calls": True if parallel is None else parallel,
        "response_format": response_format,
        "reasoning_effort": effort,
        **{key: body[key] for key in _VLLM_SAMPLING if key in body},
    }
    if LOGPROBS in (body.get("include") or []):
        chat_body.update(logprobs=True, top_logprobs=body.get("top_logprobs") or 0)
    with responses_params():
        chat = parse_chat(chat_body, tool_parser, images)
    if chat.structured_param is not None:  # as the client sent it (a refusal on add names it)
        chat.structured_param = _RENAMED.get(chat.structured_param, chat.structured_param)
    if chat.media_refs:  # a URL that cannot be loaded is named as the client sent it
        names = _image_params(items, len(items) - len(own))
        chat.media_refs = [replace(r, param=n) for r, n in zip(chat.media_refs, names, strict=True)]
    echo = {
        "instructions": instructions,
        "max_output_tokens": chat.max_tokens,
        "max_tool_calls": body.get("max_tool_calls"),
        "metadata": _metadata(body.get("metadata")) or {},
        "parallel_tool_calls": chat_body["parallel_tool_calls"],
        "previous_response_id": prev_id,
        "reasoning": {"effort": effort, "summary": summary},
        "service_tier": "default",
        "store": do_store,
        "temperature": chat.sampling.get("temperature", 1.0),
        "text": text_echo,
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": tools_echo,
        "top_logprobs": body.get("top_logprobs") or 0,
        "top_p": chat.sampling.get("top_p", 1.0),
        "truncation": body.get("truncation") or "disabled",
        "user": user,
    }
    cuts = None
    if echo["truncation"] == "auto":
        cuts = turn_cuts(items, starts, chat.messages, instructions is not None)
    return ResponsesRequest(chat, items, echo, do_store, own, background, cuts)
