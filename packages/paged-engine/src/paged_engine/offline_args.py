"""Argument checks of the offline API (`LLM`, llm.py) that vLLM leaves to deeper code: each
refuses a careless value with a ValueError naming the parameter, before any request reaches the
engine, so the LLM keeps serving the next call.

- `per_prompt`: `sampling_params` / `pooling_params` as one object or one per prompt (vLLM's
  `LLM.generate` / `LLM.encode` rule); a str, dict or int, or a list entry of the other kind
  (a PoolingParams in `generate`'s list), is refused by name instead of being run.
- `conversations`: `LLM.chat`'s messages as a list of conversations; every message a dict with a
  string role and content that is a string, a list of parts or None (OpenAI's message shape, as
  vLLM's chat_utils reads it), so a message without a role is not rendered as an empty one.
- `chat_template_variables`: `LLM.chat`'s chat_template_kwargs merged with its own arguments as
  vLLM merges them (an argument wins unless it is None), so no key is passed twice.
- `tokenization_options`: vLLM's `tokenization_kwargs` (the keys its renderer reads) as a
  `TokenizationOptions`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


def per_prompt(
    params: Any,
    num_prompts: int,
    name: str,
    kinds: tuple[type, ...],
    default: Callable[[], Any],
) -> list[Any]:
    """`params` as one entry per prompt: one of `kinds` for every prompt, or a list / tuple of
    exactly `num_prompts` of them; None (the whole argument or an entry) is `default()`. An
    entry of another kind is refused by name (`name[i]`): the engine would run it as what it
    is, e.g. a PoolingParams given to `generate` as an embedding, and return its output."""
    kinds_text = " or ".join(k.__name__ for k in kinds)
    if params is None:
        return [default()] * num_prompts
    if isinstance(params, kinds):
        return [params] * num_prompts
    if not isinstance(params, (list, tuple)):
        raise ValueError(
            f"{name} must be a {kinds_text}, a list of one per prompt, or None; got "
            f"{type(params).__name__}"
        )
    if len(params) != num_prompts:
        raise ValueError(
            f"got {num_prompts} prompts but {len(params)} {name}: pass one, or one per prompt"
        )
    fallback = None
    out = []
    for i, p in enumerate(params):
        if p is None:
            fallback = default() if fallback is None else fallback
            p = fallback
        elif not isinstance(p, kinds):
            raise ValueError(f"{name}[{i}] must be a {kinds_text} or None, got {type(p).__name__}")
        out.append(p)
    return out


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


# LLM.chat's own render arguments: a chat_template_kwargs key of the same name gives way to
# the argument, or fills it where the argument is None (vLLM's merge), never goes twice.
_CHAT_ARGS = frozenset(
    {"add_generation_prompt", "continue_final_message", "tools", "chat_template"}
)
# transformers' switches for what apply_chat_template returns: chat renders text (vLLM forces
# both off)
_RETURN_SWITCHES = frozenset({"tokenize", "return_dict"})
# the conversation itself, which `messages` gives
_CONVERSATION = frozenset({"messages", "conversation"})


def chat_template_variables(
    kwargs: Any, args: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the template's extra variables, `args` completed) from LLM.chat's chat_template_kwargs
    and its own render arguments `args` (add_generation_prompt, continue_final_message, tools,
    chat_template). ValueError naming a key that is no variable (not a str, or the
    conversation); keys the arguments or the text rendering decide are left out with a warning
    when they would have changed something."""
    if kwargs is None:
        return {}, args
    if not isinstance(kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be a dict or None, got {kwargs!r:.200}")
    args = dict(args)
    variables: dict[str, Any] = {}
    for key, value in kwargs.items():
        if not isinstance(key, str):
            raise ValueError(f"chat_template_kwargs keys must be strings, got {key!r:.80}")
        if key in _CONVERSATION:
            raise ValueError(
                f"chat_template_kwargs[{key!r}] would replace the conversation: pass it as messages"
            )
        if key in _CHAT_ARGS:
            if args.get(key) is None:
                args[key] = value
            elif value != args[key]:
                logger.warning(
                    "chat_template_kwargs[%r] is ignored: the %s argument decides", key, key
                )
        elif key in _RETURN_SWITCHES:
            if value:
                logger.warning("chat_template_kwargs[%r] is ignored: chat renders text", key)
        else:
            variables[key] = value
    return variables, args


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
