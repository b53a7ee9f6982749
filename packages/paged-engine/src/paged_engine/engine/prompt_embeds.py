"""vLLM's prompt embeddings input: `{"prompt_embeds": tensor}` in place of a prompt's tokens.

    prompt_embeds [L, D]  ->  L placeholder token ids (0) and one `ImageInput` per KV block:
    rows [i * bs, (i + 1) * bs) with `token_rows` set, keyed by the SHA-256 of those rows

The rows are what the model's token embedding gives for tokens (HF's
`model.get_input_embeddings()(ids)`): the worker puts them where the embedding lookup's output
would be (worker/image_embeds.py), so a model's own scaling (Gemma, Granite), position
embeddings (GPT-2) or projection (OPT) still apply, and the embeddings of a prompt's tokens give
that prompt's outputs. A hash per block lets prompts that share leading rows share KV blocks
through the prefix cache as tokens do (core/block_manager.py puts the hash in a block's key).
The placeholders are not tokens: penalties skip them and the request's output has
`prompt_token_ids=None`, as in vLLM.
"""

from __future__ import annotations

from typing import Any

import torch

from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import digest
from paged_engine.pooling import check_prompt_len

PLACEHOLDER = 0  # the token id under each row: a valid lookup whose output is replaced
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def embedding_width(hf_config: Any) -> int:
    """Columns of the token embedding's output: the hidden size, or OPT's projection width."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return int(getattr(text, "word_embed_proj_dim", None) or text.hidden_size)


def check_prompt_embeds(config: Any, hf_config: Any, is_encoder: bool) -> None:
    """A ValueError naming enable_prompt_embeds for a model whose layers read the token ids
    themselves, where rows have none."""
    if not config.enable_prompt_embeds:
        return
    if is_encoder:
        raise ValueError("enable_prompt_embeds: an encoder model (BERT family) reads token ids")
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    if getattr(text, "hidden_size_per_layer_input", None) or getattr(text, "ple_layer_ids", None):
        raise ValueError(
            "enable_prompt_embeds: this model's layers embed the token ids again (Gemma 4's and "
            "Gemma 3n's per-layer embeddings, Qwen4-Exp's n-gram ones), which a prompt given "
            "as embeddings does not have"
        )
    if "hash_moe" in (getattr(text, "mlp_layer_types", None) or ()):
        raise ValueError(
            "enable_prompt_embeds: this model routes tokens to experts by their ids (DeepSeek-V4's "
            "hash-routed MoE layers), which a prompt given as embeddings does not have"
        )


def prompt_embeds_inputs(
    embeds: Any, *, width: int, max_len: int, block_size: int, pooling: bool = False
) -> tuple[list[int], tuple[ImageInput, ...]]:
    """(placeholder token ids, the rows as one ImageInput per block), or a ValueError naming
    `prompt_embeds`. Shapes are checked before anything is copied: a tensor of the right shape
    holds at most max_model_len rows (`pooling`), max_model_len - 1 for generation."""
    if not isinstance(embeds, torch.Tensor):
        raise ValueError(
            f"prompt_embeds must be a torch.Tensor [num_tokens, {width}], got "
            f"{type(embeds).__name__}"
        )
    if embeds.layout != torch.strided:
        raise ValueError(f"prompt_embeds must be a dense tensor, got layout {embeds.layout}")
    if embeds.dtype not in _DTYPES:
        raise ValueError(f"prompt_embeds must be float32, bfloat16 or float16, got {embeds.dtype}")
    if embeds.dim() == 3 and embeds.shape[0] == 1:  # a batch of one, as HF returns it
        embeds = embeds[0]
    if embeds.dim() != 2 or embeds.shape[1] != width or embeds.shape[0] == 0:
        raise ValueError(
            f"prompt_embeds must have shape [num_tokens, {width}] (the model's token embedding "
            f"width), got {list(embeds.shape)}"
        )
    num = int(embeds.shape[0])
    check_prompt_len(num, "prompt_embeds rows", max_len, pooling)
    rows = embeds.detach().to("cpu")
    if not bool(torch.isfinite(rows).all()):
        raise ValueError("prompt_embeds must be finite (found NaN or infinity)")
    inputs = []
    for i, chunk in enumerate(rows.split(block_size)):
        # a contiguous copy of its own: the caller may change its tensor later (the hash must
        # not go stale), and a pickled view would carry all the rows to every rank
        chunk = chunk.clone(memory_format=torch.contiguous_format)
        inputs.append(
            ImageInput(
                pixel_values=None,
                offset=i * block_size,
                length=int(chunk.shape[0]),
                mm_hash=digest(chunk, None),  # (its dtype and shape, the width, with it)
                embeds=chunk,
                token_rows=True,
            )
        )
    return [PLACEHOLDER] * num, tuple(inputs)
