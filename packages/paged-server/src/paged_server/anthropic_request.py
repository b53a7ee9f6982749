"""An Anthropic Messages API request (`POST /v1/messages`) -> the chat request that runs it.

    system + messages (content blocks) -> chat messages -> parse_chat (tools, tool_choice,
    structured outputs and sampling checked there) -> the chat template

Blocks become chat message parts: `text` and `image` (base64 or URL source) parts of a user
message; an assistant turn's `thinking` its reasoning (`redacted_thinking` is dropped: its
text is opaque), its `tool_use` blocks its `tool_calls`; a user turn's `tool_result` blocks
one `tool` message each, where they stand among the turn's other blocks (their images, which a
tool message cannot hold, open the user message after them). A conversation that
ends with the assistant's turn is continued (Anthropic's prefill), as `continue_final_message`.
As vLLM reads them: `system` turns inside `messages` add their text to the system prompt (one
system message first, after the top-level `system`); the roles "ctx" and "msg" (newer Claude
Code) are user turns; a system text block that is Claude Code's per-request
`x-anthropic-billing-header` is dropped (its changing hash would defeat the prefix cache);
`tool_reference` blocks (naming a deferred tool to load) are dropped: every tool is rendered.

`thinking` ({"type": "enabled", "budget_tokens": N} / "disabled" / "adaptive") sets the chat
template's `enable_thinking` (and `thinking`, DeepSeek's name); the budget becomes
`thinking_token_budget` when the server knows the reasoning markers (--reasoning-parser).
`output_config.format` (and the older `output_format`) JSON schema becomes structured output.
vLLM's extras pass on to the chat path: `chat_template_kwargs` (over what `thinking` sets) and
`kv_transfer_params`.
Errors name the Anthropic field (`stop_sequences`, `messages[2].content[0].tool_use_id`).
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any

from paged_server.errors import bad_request, renamed_params
from paged_server.openai_protocol import GenerationRequest, parse_chat

_FIELDS = frozenset({
    "model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature",
    "top_p", "top_k", "tools", "tool_choice", "thinking", "metadata", "output_config",
    "output_format", "chat_template_kwargs", "kv_transfer_params",  # (vLLM's extras)
})  # fmt: skip
# Accepted and ignored: they change nothing about what is generated here (cache_control:
# the prefix cache is automatic; context_management: nothing is trimmed, the context is kept).
_IGNORED = frozenset({
    "service_tier", "cache_control", "context_management", "inference_geo", "speed",
    "diagnostics", "user_profile_id", "workspace_id",
})  # fmt: skip
# Fields that need Anthropic's servers (code execution containers, remote MCP servers).
_NOT_SUPPORTED = frozenset({"container", "mcp_servers"})
_BLOCKS = (
    "text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking", "tool_reference",
)  # fmt: skip
_USER_ROLES = {"user": "user", "ctx": "user", "msg": "user"}  # Claude Code's, as vLLM maps them
_BILLING_HEADER = "x-anthropic-billing-header"
_IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
# chat-completions parameter names as the Messages API spells them (errors name these)
_RENAMED = {
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    "response_format": "output_config.format",
    "thinking_token_budget": "thinking.budget_tokens",
    "reasoning_effort": "output_config.effort",
}
_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


def messages_params() -> AbstractContextManager[None]:
    """Errors of the chat path, renamed to the Messages API fields the client sent."""
    return renamed_params(_RENAMED, "messages")


@dataclass(slots=True)
class MessagesRequest:
    chat: GenerationRequest  # what the chat path runs
    stop_sequences: list[str]  # a stop string among them ends the answer as "stop_sequence"
    show_thinking: bool = True  # thinking.display "omitted": thinking blocks without their text


def _string(value: Any, param: str, empty: bool = True) -> str:
    if not isinstance(value, str) or (not empty and not value):
        raise bad_request(f"{param} must be a{'' if empty else ' non-empty'} string", param)
    return value


def _object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be an object", param)
    return value


def _text_blocks(value: Any, param: str) -> list[dict[str, Any]]:
    """A string, or a list of `text` blocks, as chat text parts."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise bad_request(f"{param} must be a string or a list of text blocks", param)
    parts = []
    for j, block in enumerate(value):
        p = f"{param}[{j}]"
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise bad_request(f"{p}: block type {kind!r} is not supported here (only text)", p)
        parts.append({"type": "text", "text": _string(block.get("text"), f"{p}.text")})
    return parts


def _system_parts(value: Any, param: str) -> list[dict[str, Any]]:
    """System text (a string or text blocks) as chat text parts, less Claude Code's billing
    header block (a block: a plain string is kept whole, as vLLM keeps it)."""
    parts = _text_blocks(value, param)
    if isinstance(value, str):
        return parts
    return [p for p in parts if not p["text"].startswith(_BILLING_HEADER)]


def _image_url(block: dict[str, Any], param: str) -> str:
    """An image block's source as the URL the chat path loads: base64 data as a data: URL."""
    source = _object(block.get("source"), f"{param}.source")
    kind = source.get("type")
    if kind == "base64":
        media = source.get("media_type")
        if media not in _IMAGE_TYPES:
            raise bad_request(
                f"{param}.source.media_type must be one of {', '.join(_IMAGE_TYPES)}",
                f"{param}.source.media_type",
            )
        data = _string(source.get("data"), f"{param}.source.data", empty=False)
        return f"data:{media};base64,{data}"
    if kind == "url":
        return _string(source.get("url"), f"{param}.source.url", empty=False)
    raise bad_request(
        f"{param}.source.type must be 'base64' or 'url' (files are not supported), got {kind!r}",
        f"{param}.source.type",
    )


def _tool_result(
    block: dict[str, Any], param: str, images: bool, image_params: list[str]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A `tool_result` block -> (a chat `tool` message with its text, an error result marked;
    its images as user image parts: a tool message holds text only)."""
    call_id = _string(block.get("tool_use_id"), f"{param}.tool_use_id", empty=False)
    content = block.get("content", "")
    pictures: list[dict[str, Any]] = []
    if isinstance(content, list):
        texts = []
        for k, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "image":
                p = f"{param}.content[{k}]"
                pictures.append(_image_part(b, p, images, image_params))
            elif kind != "tool_reference":  # (every tool is rendered: nothing to load)
                texts.append(b)
        content = texts
    text = "\n".join(p["text"] for p in _text_blocks(content, f"{param}.content"))
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise bad_request(f"{param}.is_error must be a boolean", f"{param}.is_error")
    if is_error:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": call_id, "content": text}, pictures


def _image_part(
    block: dict[str, Any], param: str, images: bool, image_params: list[str]
) -> dict[str, Any]:
    url = _image_url(block, param)
    if not images:
        raise bad_request(f"{param}: this model takes no images", param)
    image_params.append(param)
    return {"type": "image_url", "image_url": {"url": url}}


def _message(i: int, m: Any, images: bool, image_params: list[str]) -> list[dict[str, Any]]:
    """One Anthropic message -> its chat messages (a user turn's tool results split it)."""
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_request(f"{param} must be an object", param)
    role = m.get("role")
    role = _USER_ROLES.get(role, role) if isinstance(role, str) else role
    if role not in ("user", "assistant"):
        raise bad_request(
            f"{param}.role must be 'user', 'assistant' or 'system', got {role!r}", param
        )
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(
            f"{param}.content must be a string or a list of content blocks", f"{param}.content"
        )
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []  # the turn's text and image parts not yet emitted
    calls: list[dict[str, Any]] = []
    thinking: list[str] = []
    shown: list[dict[str, Any]] = []  # the tool results' images: a user message after them
    for j, block in enumerate(content):
        p = f"{param}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in _BLOCKS:
            shown = kind if isinstance(block, dict) else type(block).__name__
            raise bad_request(
                f"{p}: content block type {shown!r} is not supported (only {', '.join(_BLOCKS)})",
                p,
            )
        if kind in ("tool_use", "thinking", "redacted_thinking") and role != "assistant":
            raise bad_request(f"{p}: {kind} blocks belong to assistant turns", p)
        if kind in ("tool_result", "image") and role != "user":
            raise bad_request(f"{p}: {kind} blocks belong to user turns", p)
        if kind == "tool_reference":
            continue
        if kind == "text":
            parts.append({"type": "text", "text": _string(block.get("text"), f"{p}.text")})
        elif kind == "image":
            parts.append(_image_part(block, p, images, image_params))
        elif kind == "tool_result":
            if parts:  # the blocks before it, in their place
                out.append({"role": "user", "content": parts})
                parts = []
            tool, pictures = _tool_result(block, p, images, image_params)
            out.append(tool)
            shown += pictures
        elif kind == "tool_use":
            args = block.get("input", {})
            if not isinstance(args, dict):
                raise bad_request(f"{p}.input must be an object", f"{p}.input")
            fn = {"name": _string(block.get("name"), f"{p}.name", empty=False), "arguments": args}
            call_id = _string(block.get("id"), f"{p}.id", empty=False)
            calls.append({"id": call_id, "type": "function", "function": fn})
        elif kind == "thinking":
            thinking.append(_string(block.get("thinking"), f"{p}.thinking"))
    if role == "user":
        if shown or parts or not out:
            out.append({"role": "user", "content": shown + parts})
        return out
    msg: dict[str, Any] = {"role": "assistant", "content": parts or ""}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning_content"] = "".join(thinking)
    return [msg]


def _tools(value: Any) -> list[dict[str, Any]] | None:
    """Client tools (`name`, `description`, `input_schema`) -> chat function tools."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad_request("'tools' must be a list of tools", "tools")
    out = []
    for i, tool in enumerate(value):
        p = f"tools[{i}]"
        tool = _object(tool, p)
        if tool.get("type") not in (None, "custom"):
            raise bad_request(
                f"{p}: tool type {tool['type']!r} is not supported: this server runs client "
                "tools (name, description, input_schema)",
                f"{p}.type",
            )
        fn: dict[str, Any] = {"name": _string(tool.get("name"), f"{p}.name", empty=False)}
        if tool.get("description") is not None:
            fn["description"] = _string(tool["description"], f"{p}.description")
        fn["parameters"] = _object(tool.get("input_schema"), f"{p}.input_schema")
        out.append({"type": "function", "function": fn})
    return out or None  # (none: no tools; the chat route refuses an empty list)


def _tool_choice(value: Any) -> tuple[Any, bool]:
    """(the chat tool_choice, parallel_tool_calls)."""
    if value is None:
        return None, True
    value = _object(value, "tool_choice")
    kind = value.get("type")
    disable = value.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):  # ("false" would disable it)
        raise bad_request(
            f"tool_choice.disable_parallel_tool_use must be a boolean, got {disable!r}",
            "tool_choice.disable_parallel_tool_use",
        )
    parallel = not disable
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool":
        name = _string(value.get("name"), "tool_choice.name", empty=False)
        return {"type": "function", "function": {"name": name}}, parallel
    raise bad_request(
        f"tool_choice.type must be 'auto', 'any', 'tool' or 'none', got {kind!r}",
        "tool_choice.type",
    )


def _thinking(value: Any, budget_ok: bool) -> tuple[dict[str, Any], int | None, bool]:
    """(chat_template_kwargs, thinking_token_budget, show the thinking) for `thinking`:
    "adaptive" and "between_tools" leave it to the model (and its template)."""
    if value is None:
        return {}, None, True
    value = _object(value, "thinking")
    kind, display = value.get("type"), value.get("display")
    if display not in (None, "summarized", "omitted"):
        raise bad_request(
            f"thinking.display must be 'summarized' or 'omitted', got {display!r}",
            "thinking.display",
        )
    show = display != "omitted"  # "summarized": the whole thinking (nothing summarizes it)
    if kind == "disabled":
        return {"enable_thinking": False, "thinking": False}, None, show
    if kind in ("adaptive", "between_tools"):
        return {}, None, show
    if kind != "enabled":
        raise bad_request(
            "thinking.type must be 'enabled', 'adaptive', 'between_tools' or 'disabled', got "
            f"{kind!r}",
            "thinking.type",
        )
    budget = value.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise bad_request(
            "thinking.budget_tokens must be a positive integer", "thinking.budget_tokens"
        )
    return {"enable_thinking": True, "thinking": True}, budget if budget_ok else None, show


def _output_format(body: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """(chat response_format, reasoning_effort) from `output_config` / `output_format`."""
    config = body.get("output_config")
    fmt, effort = body.get("output_format"), None
    if config is not None:
        config = _object(config, "output_config")
        unknown = sorted(set(config) - {"format", "effort"})
        if unknown:
            raise bad_request(
                f"output_config.{unknown[0]} is not supported", f"output_config.{unknown[0]}"
            )
        fmt = config.get("format", fmt)
        if config.get("effort") is not None:
            effort = _EFFORTS.get(config["effort"])
            if effort is None:
                raise bad_request(
                    f"output_config.effort must be one of {', '.join(_EFFORTS)}",
                    "output_config.effort",
                )
    if fmt is None:
        return None, effort
    fmt = _object(fmt, "output_config.format")
    if fmt.get("type") != "json_schema":
        raise bad_request("output_config.format.type must be 'json_schema'", "output_config.format")
    schema = _object(fmt.get("schema"), "output_config.format.schema")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}, effort


def parse_messages(
    body: Any, tool_parser: str | None, images: bool, budget_ok: bool, need_max_tokens: bool = True
) -> MessagesRequest:
    """The request, its images' refs named by their blocks (`messages[i].content[j]`).
    `images`: the model takes images; `budget_ok`: thinking budgets can be enforced;
    `need_max_tokens`: false for count_tokens."""
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    for key in body:
        if key in _NOT_SUPPORTED:
            raise bad_request(f"'{key}' is not supported by this server", key)
        if key not in _FIELDS and key not in _IGNORED:
            raise bad_request(f"{key}: Extra inputs are not permitted", key)
    _string(body.get("model"), "model", empty=False)
    max_tokens = body.get("max_tokens")
    if max_tokens is None and need_max_tokens:
        raise bad_request("max_tokens: Field required", "max_tokens")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages: must be a non-empty list", "messages")
    system = [] if body.get("system") is None else _system_parts(body["system"], "system")
    turns: list[dict[str, Any]] = []
    image_params: list[str] = []
    for i, m in enumerate(raw):
        if isinstance(m, dict) and m.get("role") == "system":
            system += _system_parts(m.get("content"), f"messages[{i}].content")
        else:
            turns += _message(i, m, images, image_params)
    messages = ([{"role": "system", "content": system}] if system else []) + turns
    if not messages:  # system turns of billing headers alone
        raise bad_request("messages: nothing to answer (no user or assistant turn)", "messages")
    last = messages[-1]
    empty = not (last["content"] or last.get("tool_calls"))
    if last["role"] == "assistant" and empty and len(messages) > 1:
        messages.pop()  # an empty last assistant turn prefills nothing: answer afresh
    prefill = messages[-1]["role"] == "assistant"
    if prefill and messages[-1].get("tool_calls"):
        raise bad_request(
            f"messages[{len(raw) - 1}]: the last turn is the assistant's tool_use: send its "
            "tool_result in a user turn",
            f"messages[{len(raw) - 1}]",
        )
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("stop_sequences must be a list of non-empty strings", "stop_sequences")
    metadata = body.get("metadata")
    if metadata is not None:
        user = _object(metadata, "metadata").get("user_id")
        if user is not None and not isinstance(user, str):
            raise bad_request("metadata.user_id must be a string", "metadata.user_id")
    choice, parallel = _tool_choice(body.get("tool_choice"))
    tools = _tools(body.get("tools"))
    if choice == "none" and tools is None:
        choice = None
    template_kwargs, budget, show = _thinking(body.get("thinking"), budget_ok)
    asked = body.get("chat_template_kwargs")  # the client's own variables win over thinking's
    if asked is not None:
        template_kwargs = {**template_kwargs, **_object(asked, "chat_template_kwargs")}
    response_format, effort = _output_format(body)
    chat_body = {
        "messages": messages,
        "model": body["model"],
        "stream": body.get("stream"),
        "max_completion_tokens": max_tokens,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "top_k": body.get("top_k"),
        "stop": stops or None,
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "response_format": response_format,
        "reasoning_effort": effort,
        "chat_template_kwargs": template_kwargs or None,
        "kv_transfer_params": body.get("kv_transfer_params"),
        "thinking_token_budget": budget,
        "add_generation_prompt": not prefill,
        "continue_final_message": prefill,
    }
    with messages_params():
        chat = parse_chat(chat_body, tool_parser, images)
    if chat.structured_param is not None:  # as the client sent it (a refusal on add names it)
        chat.structured_param = _RENAMED.get(chat.structured_param, chat.structured_param)
    if chat.media_refs:  # a URL that cannot be loaded is named as the client sent it
        chat.media_refs = [
            replace(r, param=n) for r, n in zip(chat.media_refs, image_params, strict=True)
        ]
    return MessagesRequest(chat=chat, stop_sequences=stops, show_thinking=show)


def tool_input(arguments: str) -> dict[str, Any] | None:
    """A tool call's arguments text as a `tool_use` block's input; None if it is not a JSON
    object (a call cut short by max_tokens)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
