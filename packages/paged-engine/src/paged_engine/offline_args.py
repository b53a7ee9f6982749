"""Argument checks of the offline API (`LLM`, llm.py) that vLLM leaves to deeper code: each
refuses a careless value with a ValueError naming the parameter, before any request reaches the
engine, so the LLM keeps serving the next call.

- `per_prompt`: `sampling_params` / `pooling_params` as one object or one per prompt (vLLM's
  `LLM.generate` / `LLM.encode` rule); a str, dict or int is refused by name instead of being
  iterated.
- `conversations`: `LLM.chat`'s messages as a list of conversations; every message a dict with a
  string role and content that is a string, a list of parts or None (OpenAI's message shape, as
  vLLM's chat_utils reads it), so a message without a role is not rendered as an empty one.
"""

from __future__ import annotations

from typing import Any


def per_prompt(
    params: Any, num_prompts: int, name: str, kinds: tuple[type, ...], default: Any = None
) -> list[Any]:
    """`params` as one entry per prompt: None (-> `default`), one of `kinds` for every prompt,
    or a list / tuple of exactly `num_prompts` (its entries are checked where they are used)."""
    if params is None:
        return [default] * num_prompts
    if isinstance(params, kinds):
        return [params] * num_prompts
    if not isinstance(params, (list, tuple)):
        kinds_text = " or ".join(k.__name__ for k in kinds)
        raise ValueError(
            f"{name} must be a {kinds_text}, a list of one per prompt, or None; got "
            f"{type(params).__name__}"
        )
    if len(params) != num_prompts:
        raise ValueError(
            f"got {num_prompts} prompts but {len(params)} {name}: pass one, or one per prompt"
        )
    return list(params)


def conversations(messages: Any) -> list[list[dict]]:
    """One conversation (a list of message dicts) or a list of them, as a list of
    conversations; ValueError naming the first malformed message (`messages[i]` in one
    conversation, `messages[k][i]` in a batch)."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(
            "messages must be a list of message dicts (one conversation) or a list of such "
            f"lists, got {type(messages).__name__}"
        )
    if not messages:
        return []
    if isinstance(messages[0], dict):
        _check_conversation(messages, "messages")
        return [list(messages)]
    for k, conv in enumerate(messages):
        if not isinstance(conv, (list, tuple)):
            raise ValueError(
                f"messages[{k}] must be a message dict or a list of them (a conversation), got "
                f"{type(conv).__name__}"
            )
        _check_conversation(conv, f"messages[{k}]")
    return [list(c) for c in messages]


def _check_conversation(conv: list | tuple, where: str) -> None:
    for i, message in enumerate(conv):
        at = f"{where}[{i}]"
        if not isinstance(message, dict):
            raise ValueError(f"{at} must be a message dict, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{at}.role must be a non-empty string, got {role!r:.200}")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(
                f"{at}.content must be a string, a list of content parts or None, got "
                f"{type(content).__name__}"
            )
