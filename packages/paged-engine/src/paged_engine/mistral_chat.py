"""Chats in Mistral's instruct layout, built in code as mistral_common builds them for vLLM's
`tokenizer_mode="mistral"` (`encode_chat_completion`): token ids, no chat template.

    chat = MistralChat("v13", {"<s>": 1, "[INST]": 3, ...}, raw_tokenizer)
    ids = chat.render(messages, tools, add_generation_prompt=True)

tekken.py attaches one to a tekken.json tokenizer that has no chat template
(`tokenizer.mistral_chat`); LLM.chat and paged-server's chat routes use it unless a template
is given. Messages are OpenAI's (and paged's split-media parts, {"type": "image"}). The steps
are mistral_common's, per tokenizer version (tekken.json `config.version`):
- checks (its "test" mode): the roles' order, the last message a user / tool one (or the
  assistant's, continued), tool call ids 9 letters or digits (longer ones cut to their last 9,
  as vLLM does), function names `[a-zA-Z0-9_-]{1,64}`, v11+ tool results answering a call;
- normalizing: consecutive user (and assistant) messages merge, their texts joined by a blank
  line; tool-call arguments (and v3 tool results) re-serialized as JSON; v3 gathers every
  system message into one prompt put before the last user message's text, v7+ keeps each as
  [SYSTEM_PROMPT] .. [/SYSTEM_PROMPT] where it stands; v11+ order a run of tool results as the
  calls were made;
- ids: <s>, then [INST] user [/INST], the assistant's text (trailing spaces cut) and </s>; the
  tools as JSON in [AVAILABLE_TOOLS] before the last user message (v13: the first); calls as
  [TOOL_CALLS] + a JSON list (v3, v7) or name [CALL_ID] id [ARGS] arguments each (v11; v13
  without the id); results as [TOOL_RESULTS] JSON with call_id (v3), id [TOOL_CONTENT] text
  (v7, v11) or text alone (v13), then [/TOOL_RESULTS]; reasoning as [THINK] .. [/THINK] (v13
  with those tokens). Each text piece is encoded alone, special tokens' text as plain bytes.
An image part is one [IMG]: the engine's image processor widens it to the image's rows of
[IMG] / [IMG_BREAK] / [IMG_END], the run mistral_common's image encoder writes. What is not
built here (audio parts, other versions, reasoning on a version without [THINK]) is refused by
a ValueError naming the message field or the version.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

VERSIONS = (3, 7, 11, 13)
_JOIN = "\n\n"  # between merged messages' texts (and a v3 system prompt and its user text)
_CALL_ID = re.compile(r"[a-zA-Z0-9]{9}")
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_IMAGE_PARTS = ("image", "image_url", "image_pil")
# Roles that may follow each role (mistral_common's message order check).
_NEXT = {
    "system": {"user", "assistant", "system"},
    "user": {"assistant", "system", "user"},
    "assistant": {"assistant", "user", "tool"},
    "tool": {"assistant", "tool", "user"},
}
# A part of a message's content: ("text", str), ("image",) or ("think", str, closed).
Part = tuple


class _Specials(dict):
    """Special token ids by name; one the chat needs and the file lacks is refused by name."""

    def __missing__(self, name: str) -> int:
        raise ValueError(f"tekken.json special_tokens has no {name}, which this chat needs")


@dataclass(slots=True)
class _Message:
    role: str
    content: str | list[Part]
    calls: list[tuple[str, str, Any]] = field(default_factory=list)  # (id, name, arguments)
    call_id: str | None = None
    prefix: bool = False


class MistralChat:
    """mistral_common's chat layout for one tekken.json (`version` "v3" .. "v13", its special
    tokens' ids by name, a `tokenizers.Tokenizer` of its own for the text pieces)."""

    def __init__(self, version: str, specials: dict[str, int], text_tokenizer: Any) -> None:
        self.version_name = version
        self.version = int(version[1:]) if version[1:].isdigit() else 0
        self.specials = _Specials(specials)
        self._text = text_tokenizer  # a copy of its own: the flag below changes it
        self._text.encode_special_tokens = True  # a special's text in a message is bytes

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._text.encode_special_tokens = True  # tokenizers' pickling drops the flag

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """The conversation's prompt ids (vLLM's rules for the two flags: a last assistant
        message is continued, never closed by a generation prompt)."""
        if self.version not in VERSIONS:
            raise ValueError(
                f"tekken.json config.version {self.version_name!r}: paged builds Mistral chats "
                f"for v3, v7, v11 and v13 only; pass chat_template"
            )
        if not messages:
            raise ValueError("messages: a conversation needs at least one message")
        last = messages[-1].get("role") if isinstance(messages[-1], dict) else None
        if add_generation_prompt and last == "assistant":
            raise ValueError(
                "add_generation_prompt=True but the last message is the assistant's: pass "
                "continue_final_message=True (and add_generation_prompt=False) to continue it"
            )
        if continue_final_message and last != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        parsed = [self._parse(i, m) for i, m in enumerate(messages)]
        if continue_final_message:
            parsed[-1].prefix = True
        tool_json = [self._tool(i, t) for i, t in enumerate(tools or [])]
        self._check(parsed)
        system, merged = self._normalize(parsed)
        return self._encode(merged, system, tool_json)

    # ---- OpenAI messages in ----------------------------------------------------------------
    def _parse(self, i: int, m: Any) -> _Message:
        param = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in (*_NEXT, "developer"):
            raise ValueError(f"{param}.role must be system, developer, user, assistant or tool")
        role = "system" if m["role"] == "developer" else m["role"]
        content = m.get("content")
        if content is None and role != "assistant":
            raise ValueError(f"{param}.content is required for role {role!r}")
        parts = self._parts(param, role, content or "")
        msg = _Message(role, parts)
        if role == "assistant":
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if reasoning:  # mistral_common's ThinkChunk, closed, before the content
                self._think_ok(f"{param}.reasoning_content")
                rest = [("text", parts)] if isinstance(parts, str) else parts
                msg.content = [("think", str(reasoning), True), *rest]
            msg.calls = [
                self._call(f"{param}.tool_calls[{j}]", c)
                for j, c in enumerate(m.get("tool_calls") or [])
            ]
            if self.version < 7 and msg.calls and _has_text(msg.content):
                raise ValueError(
                    f"{param}: v3 takes tool_calls or content in one message, not both"
                )
        elif m.get("tool_calls"):
            raise ValueError(f"{param}.tool_calls is only allowed on assistant messages")
        if role == "tool":
            msg.call_id = _short_id(f"{param}.tool_call_id", m.get("tool_call_id"))
        return msg

    def _parts(self, param: str, role: str, content: Any) -> str | list[Part]:
        if isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise ValueError(f"{param}.content must be a string or a list of parts")
        parts: list[Part] = []
        for j, p in enumerate(content):
            kind = p.get("type") if isinstance(p, dict) else None
            where = f"{param}.content[{j}]"
            if kind == "text" and isinstance(p.get("text"), str):
                parts.append(("text", p["text"]))
            elif kind in _IMAGE_PARTS and role == "user":
                if "[IMG]" not in self.specials:
                    raise ValueError(f"{where}: this tokenizer has no [IMG] token for images")
                parts.append(("image",))
            elif kind == "thinking" and role in ("assistant", "system"):
                self._think_ok(where)
                parts.append(("think", str(p.get("thinking", "")), bool(p.get("closed", True))))
            else:
                raise ValueError(
                    f"{where}: a {kind!r} part in a {role} message is not built by paged's "
                    f"Mistral chat ({self.version_name}); pass chat_template"
                )
        return parts

    def _think_ok(self, where: str) -> None:
        if self.version < 13 or "[THINK]" not in self.specials or "[/THINK]" not in self.specials:
            raise ValueError(f"{where}: reasoning needs a v13+ tokenizer with [THINK] / [/THINK]")

    def _call(self, param: str, call: Any) -> tuple[str, str, Any]:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{param}.function.name is required")
        if not _NAME.fullmatch(fn["name"]):
            raise ValueError(f"{param}.function.name must match [a-zA-Z0-9_-]{{1,64}}")
        return _short_id(f"{param}.id", call.get("id")), fn["name"], _arguments(fn.get("arguments"))

    def _tool(self, i: int, tool: Any) -> dict:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"tools[{i}] must be a function tool ({{'type': 'function', ...}})")
        if not isinstance(fn.get("name"), str) or not _NAME.fullmatch(fn["name"]):
            raise ValueError(f"tools[{i}].function.name must match [a-zA-Z0-9_-]{{1,64}}")
        # mistral_common's Tool, dumped without `strict`: these keys in this order.
        described = {
            "name": fn["name"],
            "description": fn.get("description") or "",
            "parameters": fn.get("parameters") or {},
        }
        return {"type": "function", "function": described}

    # ---- checks and normalizing (mistral_common's validator and normalizer) ---------------
    def _check(self, msgs: list[_Message]) -> None:
        if len(msgs) == 1 and msgs[0].role not in ("user", "system"):
            raise ValueError("messages: a single message must be the user's or a system one")
        if len(msgs) > 1 and msgs[-1].role not in ("user", "tool") and not msgs[-1].prefix:
            raise ValueError("messages: the last message must be a user or tool message")
        for i, (a, b) in enumerate(pairwise(msgs), start=1):
            if b.role not in _NEXT[a.role]:
                raise ValueError(f"messages[{i}]: role {b.role!r} cannot follow {a.role!r}")
        for i, m in enumerate(msgs):  # (v7+ check the merged message: _encode)
            if self.version < 7 and m.role == "assistant" and not m.calls and not m.content:
                raise ValueError(f"messages[{i}]: an assistant message needs content or tool_calls")
        # Each assistant turn's calls are answered before the next assistant message (v11+: by
        # id, each once); as mistral_common's check, the first message is not counted.
        expected, pending, seen = 0, set(), set()
        for i, m in enumerate(msgs[1:], start=1):
            if m.role == "tool":
                expected -= 1
                if self.version >= 11 and (m.call_id not in pending or m.call_id in seen):
                    raise ValueError(
                        f"messages[{i}].tool_call_id {m.call_id!r} answers no pending call"
                    )
                seen.add(m.call_id)
            elif m.role == "assistant":
                if (len(pending) != len(seen)) if self.version >= 11 else expected:
                    raise ValueError(
                        f"messages[{i}]: the tool calls before it are not all answered"
                    )
                pending, seen = {c[0] for c in m.calls}, set()
                if self.version >= 11 and len(pending) != len(m.calls):
                    raise ValueError(f"messages[{i}].tool_calls: duplicate ids")
                expected = len(m.calls)

    def _normalize(self, msgs: list[_Message]) -> tuple[str | None, list[_Message]]:
        """(v3's system prompt, the messages merged): runs of one role become one message."""
        v3 = self.version < 7
        system = [_text(m.content) for m in msgs if v3 and m.role == "system" and m.content]
        out: list[_Message] = []
        latest_ids: list[str] = []  # calls since the last run of tool results (v11+ order)
        runs: list[list[_Message]] = []
        for m in msgs:
            if runs and runs[-1][0].role == m.role:
                runs[-1].append(m)
            else:
                runs.append([m])
        for run in runs:
            role = run[0].role
            if role == "user":
                out.append(_Message("user", _merge([m.content for m in run])))
            elif role == "assistant":
                calls = [c for m in run for c in m.calls]
                out.append(
                    _Message(
                        "assistant",
                        _merge([m.content for m in run]),
                        calls,
                        None,
                        any(m.prefix for m in run),
                    )
                )
                latest_ids += [c[0] for c in calls]
            elif role == "tool":
                results = [
                    _Message("tool", _merge([m.content], _require_str=True), [], m.call_id)
                    for m in run
                ]
                if self.version >= 11:
                    order = {cid: k for k, cid in enumerate(latest_ids)}
                    results.sort(key=lambda r: order.get(r.call_id, len(order)))  # stable
                out += results
                latest_ids = []
            elif self.version >= 7:
                out += [_Message("system", _merge([m.content])) for m in run]
        if not out or (self.version < 7 and out[0].role != "user"):
            out.insert(0, _Message("user", ""))
        return (_JOIN.join(system) if system else None), out

    # ---- ids ------------------------------------------------------------------------------
    def _encode(self, msgs: list[_Message], system: str | None, tools: list[dict]) -> list[int]:
        s = self.specials
        users = [i for i, m in enumerate(msgs) if m.role == "user"]
        tools_at = (users[0] if self.version >= 13 else users[-1]) if users else -1
        ids = [s["<s>"]]
        for i, m in enumerate(msgs):
            if m.role == "user":
                if i == tools_at and tools:
                    ids += [
                        s["[AVAILABLE_TOOLS]"],
                        *self._enc(_dumps(tools)),
                        s["[/AVAILABLE_TOOLS]"],
                    ]
                ids.append(s["[INST]"])
                ids += self._user_text(m.content, system if i == users[-1] else None)
                ids.append(s["[/INST]"])
            elif m.role == "assistant":
                if not m.content and not m.calls:
                    raise ValueError("messages: an assistant message needs content or tool_calls")
                if isinstance(m.content, str):
                    ids += self._enc(m.content.rstrip(" "))
                else:
                    ids += self._chunks(m.content)
                if m.calls:
                    ids += self._calls(m.calls)
                if not m.prefix:
                    ids.append(s["</s>"])
            elif m.role == "tool":
                ids += self._result(m)
            else:
                ids += [s["[SYSTEM_PROMPT]"], *self._chunks(m.content), s["[/SYSTEM_PROMPT]"]]
        return ids

    def _user_text(self, content: str | list[Part], system: str | None) -> list[int]:
        if isinstance(content, str):
            return self._enc(f"{system}{_JOIN}{content}" if system else content)
        if (
            len(content) >= 2
            and content[-1][0] == "image"
            and all(p[0] == "text" for p in content[:-1])
        ):
            content = [content[-1], *content[:-1]]  # a trailing image goes first
        return (self._enc(system + _JOIN) if system else []) + self._chunks(content)

    def _chunks(self, content: str | list[Part]) -> list[int]:
        if isinstance(content, str):
            return self._enc(content)
        ids: list[int] = []
        for part in content:
            if part[0] == "text":
                ids += self._enc(part[1])
            elif part[0] == "image":
                ids.append(self.specials["[IMG]"])
            else:
                ids += [self.specials["[THINK]"], *self._enc(part[1])]
                ids += [self.specials["[/THINK]"]] if part[2] else []
        return ids

    def _calls(self, calls: list[tuple[str, str, Any]]) -> list[int]:
        s = self.specials
        if self.version < 11:
            listed = [{"name": name, "arguments": args, "id": cid} for cid, name, args in calls]
            return [s["[TOOL_CALLS]"], *self._enc(_dumps(listed))]
        ids: list[int] = []
        for cid, name, args in calls:
            ids += [s["[TOOL_CALLS]"], *self._enc(name)]
            if self.version == 11:
                ids += [s["[CALL_ID]"], *self._enc(cid)]
            ids += [s["[ARGS]"], *self._enc(_dumps(args))]
        return ids

    def _result(self, m: _Message) -> list[int]:
        s = self.specials
        assert isinstance(m.content, str) and m.call_id is not None
        if self.version < 7:
            body = self._enc(
                _dumps({"content": _json_or_text(m.content or "{}"), "call_id": m.call_id})
            )
        elif self.version < 13:
            body = [*self._enc(m.call_id), s["[TOOL_CONTENT]"], *self._enc(m.content)]
        else:
            body = self._enc(m.content)
        return [s["[TOOL_RESULTS]"], *body, s["[/TOOL_RESULTS]"]]

    def _enc(self, text: str) -> list[int]:
        return self._text.encode(text, add_special_tokens=False).ids if text else []


def _short_id(param: str, value: Any) -> str:
    """A tool call id as mistral_common takes it: vLLM keeps a longer id's last 9 characters."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{param} is required (9 letters or digits)")
    value = value[-9:]
    if not _CALL_ID.fullmatch(value):
        raise ValueError(f"{param} {value!r} must be 9 letters or digits (a-z, A-Z, 0-9)")
    return value


def _arguments(value: Any) -> Any:
    """Call arguments as mistral_common re-reads them: JSON parsed (a string that is not JSON
    stays a string), none or empty as {}."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        return _json_or_text(value)
    return json.loads(json.dumps(value))  # an object: as its JSON round trip


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _has_text(content: str | list[Part]) -> bool:
    return (
        bool(content) if isinstance(content, str) else any(p[0] == "text" and p[1] for p in content)
    )


def _text(content: str | list[Part]) -> str:
    merged = _merge([content])
    if not isinstance(merged, str):
        raise ValueError("messages: a v3 system message takes text only")
    return merged


def _merge(contents: list[str | list[Part]], _require_str: bool = False) -> str | list[Part]:
    """Messages' contents as one: adjacent texts joined by a blank line (empty ones dropped),
    a plain string when only text remains (mistral_common's chunk aggregation)."""
    out: list[Part] = []
    texts: list[str] = []
    for content in contents:
        items = [("text", content)] if isinstance(content, str) else content
        for part in items:
            if part[0] != "text":
                if texts:
                    out.append(("text", _JOIN.join(texts)))
                    texts = []
                out.append(part)
            elif part[1]:
                texts.append(part[1])
    if not out:
        return _JOIN.join(texts)
    if texts:
        out.append(("text", _JOIN.join(texts)))
    if _require_str:
        raise ValueError("messages: a tool message takes text parts only")
    return out
