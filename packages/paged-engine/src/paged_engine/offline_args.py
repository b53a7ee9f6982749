"""Argument checks of the offline API (`LLM`, llm.py) that vLLM leaves to deeper code: each
refuses a careless value with a ValueError naming the parameter, before any request reaches the
engine, so the LLM keeps serving the next call.

- `per_prompt`: `sampling_params` / `pooling_params` as one object or one per prompt (vLLM's
  `LLM.generate` / `LLM.encode` rule); a str, dict or int is refused by name instead of being
  iterated.
- `conversations`: `LLM.chat`'s messages as a list of conversations; every message a dict with a
  string role and content that is a string, a list of parts or None (OpenAI's message shape, as
  vLLM's chat_utils reads it), so a message without a role is not rendered as an empty one.
- `tokenization_options`: vLLM's `tokenization_kwargs` (the keys its renderer reads) as a
  `TokenizationOptions`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True, slots=True)
class TokenizationOptions:
    """vLLM's `tokenization_kwargs`, read as its renderer reads them.

    keep: truncate_prompt_tokens (k of the prompt's tokens; -1: as many as fit), from
        `truncate_prompt_tokens` or from `truncation=True` with `max_length` (None: no cut).
    max_length: without truncation, the most tokens a prompt may hold (longer: ValueError).
    add_special_tokens / do_lower_case: how a text prompt is encoded (None: the model's way).
    side: truncation_side, which end a cut keeps: "left" cuts the start (keeps the last k),
        "right" the end (None: the tokenizer's: "right" on a pooling-only engine, else "left").
    """

    keep: int | None = None
    max_length: int | None = None
    add_special_tokens: bool | None = None
    do_lower_case: bool | None = None
    side: str | None = None

    @property
    def encodes(self) -> bool:
        """Whether text prompts must be encoded here rather than by the engine."""
        return (
            self.add_special_tokens is not None
            or bool(self.do_lower_case)
            or (self.max_length is not None and self.keep is None)
        )


def tokenization_options(kwargs: Any) -> TokenizationOptions:
    """`tokenization_kwargs` (a dict or None) as options; ValueError naming a bad value. Keys
    vLLM's renderer does not read are ignored with a warning, as vLLM does."""
    if kwargs is None:
        return TokenizationOptions()
    if not isinstance(kwargs, dict):
        raise ValueError(f"tokenization_kwargs must be a dict or None, got {kwargs!r:.200}")
    rest = dict(kwargs)
    max_length = _optional_int(rest.pop("max_length", None), "max_length", minimum=1)
    keep = _optional_int(rest.pop("truncate_prompt_tokens", None), "truncate_prompt_tokens")
    if keep is not None and keep != -1 and keep < 1:
        raise ValueError(
            f"tokenization_kwargs['truncate_prompt_tokens'] must be an int >= 1, -1 or None, "
            f"got {keep!r}"
        )
    special = _optional_bool(rest.pop("add_special_tokens", None), "add_special_tokens")
    lower = _optional_bool(rest.pop("do_lower_case", None), "do_lower_case")
    rest.pop("needs_detokenization", None)  # outputs follow SamplingParams.detokenize
    side = rest.pop("truncation_side", None)
    if side not in (None, "left", "right"):
        raise ValueError(
            f"tokenization_kwargs['truncation_side'] must be 'left', 'right' or None, got "
            f"{side!r:.200}"
        )
    truncation = rest.pop("truncation", None)
    if truncation in (True, "longest_first"):  # HF's: cut to max_length (none: what fits)
        keep = -1 if max_length is None else max_length
    elif truncation in (False, "do_not_truncate"):
        keep = None
    elif truncation is not None:
        rest["truncation"] = truncation
    if keep is not None and max_length is not None:  # vLLM: -1 is what max_length allows
        if keep == -1:
            keep = max_length
        elif keep > max_length:
            raise ValueError(
                f"tokenization_kwargs['truncate_prompt_tokens'] = {keep} is more than its "
                f"max_length = {max_length}"
            )
    if rest:
        logger.warning("tokenization_kwargs %s are not supported and are ignored", sorted(rest))
    return TokenizationOptions(keep, max_length, special, lower, side)


def _optional_int(value: Any, key: str, minimum: int | None = None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"tokenization_kwargs[{key!r}] must be an int, got {value!r:.200}")
    if minimum is not None and value < minimum:
        raise ValueError(f"tokenization_kwargs[{key!r}] must be >= {minimum}, got {value}")
    return value


def _optional_bool(value: Any, key: str) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"tokenization_kwargs[{key!r}] must be a bool, got {value!r:.200}")
    return value
