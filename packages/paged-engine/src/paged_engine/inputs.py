"""vLLM's prompt dicts and prompt type names (`vllm.inputs`), for type hints and ports: plain
dicts at run time, the forms every `prompt` argument takes besides a string or a list of token
ids."""

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


DecoderOnlyPrompt = str | list[int] | TextPrompt | TokensPrompt | EmbedsPrompt
# one side of an encoder-decoder prompt (no prompt_embeds)
EncoderPrompt = str | list[int] | TextPrompt | TokensPrompt
DecoderPrompt = EncoderPrompt
SingletonPrompt = DecoderOnlyPrompt


class _EncoderPrompt(TypedDict):
    encoder_prompt: Any  # a str, token ids, TextPrompt or TokensPrompt


class ExplicitEncoderDecoderPrompt(_EncoderPrompt, total=False):
    """A text encoder-decoder's prompt (BART, mBART: engine/encoder_prompt.py) as vLLM 0.10 took
    it; decoder_prompt None or absent: [bos_token_id] after decoder_start_token_id."""

    decoder_prompt: Any  # the same forms, or None


# an encoder-decoder model also takes a lone encoder prompt (its decoder prompt: the default)
EncoderDecoderPrompt = EncoderPrompt | ExplicitEncoderDecoderPrompt
# what every `LLM` method's prompts take, whatever the model
PromptType = DecoderOnlyPrompt | ExplicitEncoderDecoderPrompt


def zip_enc_dec_prompts(
    encoder_prompts: list[Any], decoder_prompts: list[Any] | None = None
) -> list[ExplicitEncoderDecoderPrompt]:
    """vLLM's `zip_enc_dec_prompts`: one explicit prompt per encoder prompt, paired in order
    with `decoder_prompts` (None: the default decoder prompt for each)."""
    decoders = [None] * len(encoder_prompts) if decoder_prompts is None else decoder_prompts
    if len(decoders) != len(encoder_prompts):
        raise ValueError(
            f"decoder_prompts has {len(decoders)} prompts for {len(encoder_prompts)} "
            "encoder_prompts"
        )
    return [
        ExplicitEncoderDecoderPrompt(encoder_prompt=e, decoder_prompt=d)
        for e, d in zip(encoder_prompts, decoders, strict=True)
    ]
