"""Chat request parts checked as OpenAI checks them, into what a chat template takes: messages
(text content, image, video and audio parts when the model takes them, assistant tool calls
with their arguments as objects and the reasoning sent back with them, tool results),
documents, and the template variables a client may set.

Every check raises `APIError(400)` naming the offending parameter (`messages[2].content`).
"""

from __future__ import annotations

import json
from typing import Any

from paged_server.errors import bad_request
from paged_server.media import MediaRef

_ROLES = {"system", "developer", "user", "assistant", "tool"}


def chat_message(i: int, m: Any, images: list[MediaRef] | None = None) -> dict[str, Any]:
    """One chat message, checked as OpenAI checks it: a known role; content a string or a list
    of parts, required except on an assistant message that makes tool calls; assistant
    `tool_calls` well formed (their JSON arguments become objects for the chat template, as
    templates index them); a tool message names its `tool_call_id`.

    `images` is None when the model takes no images or videos (such a part is a 400); else a
    user message's image and video parts are appended to it, in order, and the message's
    content becomes Hugging Face's list of parts (`{"type": "image"}`, `{"type": "video"}`,
    `{"type": "text", "text": ...}`) where the chat template puts each one's placeholder."""
    param = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise bad_request(f"{param} must be an object with a string 'role'", param)
    role = m["role"]
    if role not in _ROLES:
        raise bad_request(f"{param}.role '{role}' is not one of {sorted(_ROLES)}", param)
    content = m.get("content")
    tool_calls = m.get("tool_calls")
    if content is None:
        if role != "assistant":
            raise bad_request(f"{param}.content is required for role '{role}'", f"{param}.content")
        content = ""
    elif isinstance(content, list):
        content = _content_parts(param, role, content, images)
    elif not isinstance(content, str):
        raise bad_request(
            f"{param}.content must be a string or a list of parts", f"{param}.content"
        )
    if m.get("function_call"):
        raise bad_request(
            f"{param}.function_call (deprecated) is not supported: use tool_calls",
            f"{param}.function_call",
        )
    out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
    if tool_calls is not None:
        if role != "assistant":
            raise bad_request(f"{param}.tool_calls is only allowed on assistant messages", param)
        out["tool_calls"] = _tool_calls(f"{param}.tool_calls", tool_calls)
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
            raise bad_request(
                f"{param}.tool_call_id is required for role 'tool'", f"{param}.tool_call_id"
            )
        out["tool_call_id"] = m["tool_call_id"]
    reasoning = _reasoning(param, m)
    if reasoning is not None:
        if role != "assistant":
            raise bad_request(f"{param}: reasoning is only allowed on assistant messages", param)
        # Templates read it by either name: Qwen3's `reasoning_content`, gpt-oss's `thinking`
        # (which carries the analysis across a tool call's turns).
        out["reasoning_content"] = out["thinking"] = reasoning
    name = m.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise bad_request(f"{param}.name must be a string", f"{param}.name")
        out["name"] = name
    return out


def _content_parts(
    param: str, role: str, content: list, images: list[MediaRef] | None
) -> str | list[dict[str, str]]:
    """A list of content parts: its texts joined by newlines, or, with an image or video among
    them, the parts in order as a template takes them (each one's ref appended to `images`)."""
    parts: list[dict[str, str]] = []
    found: list[MediaRef] = []
    for j, part in enumerate(content):
        if isinstance(part, str):  # vLLM's: a bare string is a text part
            parts.append({"type": "text", "text": part})
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        key = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is not None:
            if not isinstance(part.get(key), str):
                raise bad_request(
                    f"{param}.content: a {kind} part needs a string '{key}'", f"{param}.content"
                )
            parts.append({"type": "text", "text": part[key]})
        elif kind == "image_url" and images is not None:
            p = f"{param}.content[{j}].image_url"
            if role != "user":
                raise bad_request(
                    f"{p}: images are taken in user messages only, not in role '{role}'", p
                )
            found.append(MediaRef(_image_url(p, part.get("image_url")), p))
            parts.append({"type": "image"})
        elif kind == "video_url" and images is not None:  # vLLM's (the Qwen-VL family)
            p = f"{param}.content[{j}].video_url"
            if role != "user":
                raise bad_request(
                    f"{p}: videos are taken in user messages only, not in role '{role}'", p
                )
            url = _image_url(p, part.get("video_url"), "video")
            found.append(MediaRef(url, p, kind="video"))
            parts.append({"type": "video"})
        elif kind in ("input_audio", "audio_url") and images is not None:
            p = f"{param}.content[{j}].{kind}"
            if role != "user":
                raise bad_request(
                    f"{p}: audio is taken in user messages only, not in role '{role}'", p
                )
            found.append(MediaRef(_audio_url(p, kind, part.get(kind)), p, kind="audio"))
            parts.append({"type": "audio"})
        elif kind == "image_embeds" and images is not None:  # vLLM's, --enable-mm-embeds
            p = f"{param}.content[{j}].image_embeds"
            if role != "user":
                raise bad_request(
                    f"{p}: images are taken in user messages only, not in role '{role}'", p
                )
            value = part.get("image_embeds")
            if not isinstance(value, (str, dict)):
                raise bad_request(
                    f"{p} must be a base64 tensor string (or Qwen2-VL's object of them)", p
                )
            found.append(MediaRef("", p, embeds=value))
            parts.append({"type": "image"})
        elif images is None:
            # A text model (or a VLM served text-only): no image / audio input.
            raise bad_request(
                f"{param}.content: content part type {kind!r} is not supported; this "
                "server takes text only (no image, video, audio or file input): send 'text' parts",
                f"{param}.content",
            )
        else:
            raise bad_request(
                f"{param}.content: content part type {kind!r} is not supported (no file "
                "input): send 'text', 'image_url', 'video_url', 'image_embeds', 'input_audio' "
                "or 'audio_url' parts",
                f"{param}.content",
            )
    if not found:
        return "\n".join(p["text"] for p in parts)
    images.extend(found)
    return parts


# The part types read as text (vLLM's), each with the key holding it: OpenAI's assistant
# `refusal` parts, the Responses API's input / output text
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
_DETAILS = ("auto", "low", "high")
_AUDIO_FORMATS = {"wav": "wav", "mp3": "mpeg", "flac": "flac", "ogg": "ogg", "m4a": "mp4"}


def _audio_url(param: str, kind: str, value: Any) -> str:
    """OpenAI's input_audio `{"data": base64, "format": "wav" | "mp3"}` as a data: URL, or
    vLLM's audio_url (`{"url": ...}` or the bare URL)."""
    if kind == "audio_url":
        return _image_url(param, value, "audio")
    if not isinstance(value, dict) or not isinstance(value.get("data"), str):
        raise bad_request(f"{param} must be an object with base64 'data' and a 'format'", param)
    fmt = value.get("format")
    if fmt not in _AUDIO_FORMATS:
        raise bad_request(
            f"{param}.format must be one of {sorted(_AUDIO_FORMATS)}, got {fmt!r}",
            f"{param}.format",
        )
    return f"data:audio/{_AUDIO_FORMATS[fmt]};base64,{value['data']}"


def _image_url(param: str, value: Any, kind: str = "image") -> str:
    """OpenAI's `{"url": ..., "detail": ...}`, or vLLM's bare URL string. `detail` is checked
    and changes nothing: the checkpoint's image processor sets the resolution."""
    if isinstance(value, dict):
        detail = value.get("detail")
        if detail is not None and detail not in _DETAILS:
            raise bad_request(
                f"{param}.detail must be one of {', '.join(_DETAILS)}, got {detail!r}",
                f"{param}.detail",
            )
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise bad_request(
            f"{param} must be {{'url': URL}} (or a URL string): a data:{kind}/...;base64 URL "
            "or an http(s) URL",
            param,
        )
    return value


def _reasoning(param: str, m: dict[str, Any]) -> str | None:
    """An earlier answer's reasoning as a client sends it back: `reasoning_content` (what our
    answers carry, DeepSeek's name), `reasoning` (vLLM's newer name) or `thinking`."""
    for key in ("reasoning_content", "reasoning", "thinking"):
        value = m.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise bad_request(f"{param}.{key} must be a string", f"{param}.{key}")
            return value
    return None


def _tool_calls(param: str, calls: Any) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise bad_request(f"{param} must be a list", param)
    out = []
    for j, call in enumerate(calls):
        p = f"{param}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(
                f"{p} must be {{'type': 'function', 'function': {{name, arguments}}}}", p
            )
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):  # 100k "[" raise the latter
                raise bad_request(f"{p}.function.arguments must be JSON text", p) from None
        if not isinstance(args, dict):
            raise bad_request(f"{p}.function.arguments must be a JSON object", p)
        entry = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


# The render's own arguments: a template variable of the same name would replace them. A
# "chat_template" key is the template itself (the app lets it through only when trusted).
_RENDER_ARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def template_kwargs(value: Any) -> dict[str, Any]:
    """chat_template_kwargs: variables for the chat template (e.g. {"enable_thinking": false})."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    taken = sorted(_RENDER_ARGS.intersection(value))
    if taken:
        raise bad_request(
            f"'chat_template_kwargs' may not set {taken[0]!r}: the request's own fields do",
            "chat_template_kwargs",
        )
    return value


def chat_documents(value: Any) -> list[dict[str, Any]] | None:
    """documents: a list of objects with string values (e.g. {"title", "text"}) for chat
    templates that ground answers in documents."""
    if value is None:
        return None
    ok = isinstance(value, list) and all(
        isinstance(d, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in d.items())
        for d in value
    )
    if not ok:
        raise bad_request("'documents' must be a list of objects with string values", "documents")
    return value
