"""vLLM's prompt dicts (`vllm.inputs`), for type hints and ports: plain dicts at run time, the
forms every `prompt` argument takes besides a string or a list of token ids."""

from __future__ import annotations

from typing import Any, TypedDict


class _Shared(TypedDict, total=False):
    multi_modal_data: dict[str, Any]  # {"image": ..., "video": ...}
    mm_processor_kwargs: dict[str, Any]
    cache_salt: str  # prefix-cache entries are shared only under the same salt


class _Text(TypedDict):
    prompt: str


class TextPrompt(_Text, _Shared, total=False):
    pass


class _Tokens(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_Tokens, _Shared, total=False):
    prompt: str  # the text, when the caller has it (shown in outputs)


class _Embeds(TypedDict):
    prompt_embeds: Any  # a [num_tokens, hidden_size] tensor (enable_prompt_embeds=True)


class EmbedsPrompt(_Embeds, total=False):
    cache_salt: str


PromptType = str | list[int] | TextPrompt | TokensPrompt | EmbedsPrompt
