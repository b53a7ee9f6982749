"""A checkpoint whose tensors contradict its config's `tie_word_embeddings=True`.

transformers 5 (`PreTrainedModel.tie_weights` in from_pretrained) decides by what the
checkpoint holds, and paged follows it (vLLM instead skips the head whenever the config ties):

    embedding  head              transformers 5 and paged
    present    absent            tied: the head is the embedding
    present    present, equal    tied (one tensor)
    present    present, unequal  NOT tied, with a warning: each keeps its own tensor
    absent     present           tied the other way: the embedding takes the head's values
    absent     absent            HF: random values and a warning; paged: ValueError (missing)

`untie_differing_head` decides the third row after the model is built and before it loads;
`TiedHeadStream` (CausalLMBase.load_weights) the fourth; load_named_weights' missing-weight
check the fifth. A GGUF file ties only when it lacks output.weight (gguf/hf_config.py), as
llama.cpp does, so neither applies to it. A VLM wrapper served text-only (multimodal_text.py)
decides alike on its language model's tensors, named by `text_model_weights`, and so do its
Mistral consolidated weights (Mistral Small 3.x: config.json omits the top-level flag, which
transformers reads as tied, yet the weights hold a head); a text model's consolidated format
ties as its config says.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from paged_engine.loader import ResolvedModel

logger = logging.getLogger(__name__)

_ROWS = 4096  # rows compared at a time: the casts stay small on a large vocabulary


def same_values(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether two checkpoint tensors load as the same weight: equal shapes and, floating
    ones, equal values in the model `dtype` (transformers compares the loaded parameters);
    others (packed codes) bit for bit. Shared storage (a `.bin`'s tied pair) reads nothing."""
    if a.shape != b.shape:
        return False
    if a.dtype == b.dtype and a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True
    floating = a.is_floating_point() and b.is_floating_point()
    if not floating and a.dtype != b.dtype:
        return False
    flat_a, flat_b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)  # [V, D]
    for start in range(0, flat_a.shape[0], _ROWS):
        rows_a, rows_b = flat_a[start : start + _ROWS], flat_b[start : start + _ROWS]
        if floating:
            rows_a, rows_b = rows_a.to(dtype), rows_b.to(dtype)
        else:
            rows_a, rows_b = rows_a.view(torch.uint8), rows_b.view(torch.uint8)
        if not torch.equal(rows_a, rows_b):
            return False
    return True


def untie_differing_head(
    model: nn.Module,
    resolved: ResolvedModel,
    hf_config: Any,
    load_format: str,
    dtype: torch.dtype,
) -> bool:
    """Give a built model's tied head a weight of its own where the checkpoint holds both
    tensors with different values (transformers' rule, above), setting the model's and
    `hf_config`'s `tie_word_embeddings` to False; True when it did. Reads the checkpoint's
    names and, only where both are there, those two tensors. Safetensors and `.bin` files,
    and a VLM wrapper's Mistral consolidated weights: GGUF never ties a head it has, a text
    model's consolidated format ties by its config."""
    from paged_engine.loader import iter_weights, weights_format
    from paged_engine.models.multimodal_text import MARKER, text_model_weights
    from paged_engine.models.utils import CausalLMBase

    if not (isinstance(model, CausalLMBase) and model.tie_word_embeddings):
        return False
    fmt = weights_format(resolved, load_format)
    wrapped = getattr(hf_config, MARKER, None) is not None
    if fmt not in ("safetensors", "pt") and not (fmt == "mistral" and wrapped):
        return False
    head, embed = f"{model.head_name}.weight", f"{model.embed_path}.weight"
    found: dict[str, torch.Tensor] = {}
    for name, tensor in text_model_weights(iter_weights(resolved, fmt), hf_config):
        ours = model.rename_weight(name)
        if ours in (head, embed):
            found[ours] = tensor
    if len(found) < 2 or same_values(found[embed], found[head], dtype):
        return False
    logger.warning(
        "the config ties %s to %s (tie_word_embeddings=True) but the checkpoint holds both "
        "with different values, so they are NOT tied (as transformers does); set "
        "tie_word_embeddings=False in config.json to silence this warning",
        head,
        embed,
    )
    model.get_submodule(model.head_name).untie()
    model.tie_word_embeddings = False
    hf_config.tie_word_embeddings = False  # what a reload or a rebuilt model reads
    return True


class TiedHeadStream:
    """A tied model's weight stream (checkpoint names, as `load_weights` takes them) without
    the head's copy, which has no parameter of its own; where no embedding came, that copy
    comes last and loads as the embedding (transformers ties the other way).

    `rename` (the model's `rename_weight`) tells which checkpoint name is which; pass
    `weights(...)` and `self.rename` to load_named_weights: the held copy, the stream's
    last item, is renamed to `embed` there."""

    def __init__(self, rename: Callable[[str], str], head: str, embed: str) -> None:
        self._rename, self.head, self.embed = rename, head, embed
        self._head_as_embedding = False

    def weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        held: tuple[str, torch.Tensor] | None = None
        embedding_seen = False
        for name, tensor in weights:
            ours = self._rename(name)
            if ours == self.head:
                held = (name, tensor)  # not read unless it becomes the embedding
                continue
            embedding_seen = embedding_seen or ours == self.embed
            yield name, tensor
        if held is not None and not embedding_seen:
            logger.info(
                "the checkpoint has %s but no %s: the tied embedding takes the head's values "
                "(as transformers does)",
                held[0],
                self.embed,
            )
            self._head_as_embedding = True
            yield held

    def rename(self, name: str) -> str:
        ours = self._rename(name)
        return self.embed if self._head_as_embedding and ours == self.head else ours
