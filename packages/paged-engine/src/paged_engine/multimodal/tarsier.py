"""Tarsier v1 (omni-research/Tarsier-7b / -34b, TarsierForConditionalGeneration): LLaVA 1.5 with
two separator rows in each image's run, as vLLM's tarsier.py serves it.

config.json is a LLaVA one (model_type "llava", a Llama text_config, a CLIP tower, LLaVA's
two-layer projector) under the name TarsierForConditionalGeneration, with two ids of the text
vocabulary: `image_newline_idx` (ends each row of patches) and `image_new_idx` (ends an image).

    pixels [N, 3, S, S] -> LLaVA's tower, feature selection and projector (multimodal/llava.py)
        -> [N, P, D], read as a grid of h = isqrt(P) rows of w = P // h patches
        -> each row followed by the text embedding of image_newline_idx, the whole followed
           by that of image_new_idx: [N, h * (w + 1) + 1, D]

The prompt: each `<image>` token becomes a run of P + h + 1 `<image>` placeholders (601 for
CLIP ViT-L/14 at 336 pixels under "default": 576 + 24 + 1), as vLLM's processor replaces it;
the separators are rows of that run, not tokens of the prompt. Their two rows are taken from
the text model's embed_tokens at load (the release's `language_model.model.embed_tokens.weight`,
transformers 5's `model.language_model.embed_tokens.weight`), so they equal vLLM's lookup bit
for bit; the rest of the weights are LLaVA's.

Refused by name: image features instead of images (vLLM adds the separators to them; paged's
feature rows skip the encoder, which holds the separator rows), a patch count no h x w grid
with h = isqrt(P) holds (vision_feature_select_strategy "full" on a CLIP tower: P = side^2 + 1,
where vLLM's reshape fails), separator ids outside the text vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from paged_engine.multimodal.layouts import Layout
from paged_engine.multimodal.llava import LlavaImageEncoder, tokens_per_image

ARCH = "TarsierForConditionalGeneration"
_SEPARATORS = ("image_newline_idx", "image_new_idx")  # config fields, in the run's order
# the text embedding, as the releases (transformers 4.x LLaVA) and transformers 5 save it
_EMBEDS = ("language_model.model.embed_tokens.weight", "model.language_model.embed_tokens.weight")


def patch_grid(config: Any) -> tuple[int, int]:
    """(h, w): the projected patches of an image as vLLM lays them out, h = isqrt(P) rows of
    w = P // h; ValueError naming vision_feature_select_strategy where h * w != P."""
    patches = tokens_per_image(config)
    rows = math.isqrt(patches)
    cols = patches // rows
    if rows * cols != patches:
        raise ValueError(
            f"{ARCH}: vision_feature_select_strategy="
            f"{getattr(config, 'vision_feature_select_strategy', None)!r} leaves {patches} "
            f"patches an image, which no grid of {rows} rows holds (Tarsier ends each row "
            "with image_newline_idx); use 'default'"
        )
    return rows, cols


def separator_ids(config: Any) -> tuple[int, int]:
    """(image_newline_idx, image_new_idx); ValueError naming the field that is missing or
    outside the text vocabulary."""
    vocab = int(config.text_config.vocab_size)
    ids = []
    for field in _SEPARATORS:
        value = getattr(config, field, None)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
            raise ValueError(
                f"{ARCH}: config.json's {field}={value!r} must be a token id of the text "
                f"vocabulary (0 to {vocab - 1})"
            )
        ids.append(value)
    return ids[0], ids[1]


def tarsier_tokens(config: Any) -> int:
    """Placeholders an image takes: its P patches, a newline per grid row, one image end."""
    rows, cols = patch_grid(config)
    return rows * (cols + 1) + 1


class TarsierImageEncoder(LlavaImageEncoder):
    """Images -> rows of the text model's input embedding, separators in (module doc)."""

    own_weights = ("separators",)

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.rows, self.cols = patch_grid(config)
        self.separator_ids = separator_ids(config)
        self.tokens_per_image = tarsier_tokens(config)
        # [newline, image end]: the text embedding's rows of the two separator ids
        self.separators = nn.Parameter(torch.empty(2, int(config.text_config.hidden_size)))
        self.separators.weight_loader = self._load_separators

    def _load_separators(self, param: nn.Parameter, table: torch.Tensor) -> None:
        """Takes the whole text embedding [vocab, hidden] and keeps the two separator rows."""
        if table.dim() != 2 or table.shape[1] != param.shape[1]:
            raise ValueError(f"embedding {tuple(table.shape)}, expected [vocab, {param.shape[1]}]")
        param.data.copy_(table[list(self.separator_ids)])

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, 3, S, S] -> [N, run, D]
        patches = super().forward(pixels)  # [N, h * w, D]
        n, _, dim = patches.shape
        newline, end = self.separators.to(patches.dtype)
        grid = patches.view(n, self.rows, self.cols, dim)
        lines = torch.cat([grid, newline.expand(n, self.rows, 1, dim)], dim=2)
        return torch.cat([lines.reshape(n, -1, dim), end.expand(n, 1, dim)], dim=1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """LLaVA's tower and projector tensors, and the text embedding (its separator rows
        kept); ValueError naming a missing or unexpected one."""
        return super().load_weights(
            ("separators" if name in _EMBEDS else name, tensor) for name, tensor in weights
        )


class TarsierLayout(Layout):
    """LLaVA 1.5's fixed run, P + h + 1 placeholders long; pixels [3, S, S]."""

    takes_embeds = False  # feature rows skip the encoder, which adds the separators

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        super().__init__(config, placeholder, tokenizer)
        separator_ids(config)  # refused at load, not with the first image
        self.fixed = tarsier_tokens(config)
