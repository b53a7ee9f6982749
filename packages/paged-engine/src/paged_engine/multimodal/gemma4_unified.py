"""Gemma 4 Unified's image path (Gemma4UnifiedForConditionalGeneration: the encoder-free model).

Built on Gemma 4's (multimodal/gemma4.py): the same aspect-kept resize, the same <|image>
run <image|> prompt and the same two-way image rows on the sliding layers, but no vision tower
at all. Each k x k block of p-pixel patches is one "model patch" of (k p)^2 pixels and one soft
token, embedded by layer norms and a dense layer alone. Each piece as transformers runs it:

    image -> Gemma4UnifiedImageProcessor (torchvision only: `Gemma4UnifiedTorchProcessor` here
        where it is missing): Gemma 4's resize to an h x w grid of (k p)-pixel blocks within
        max_soft_tokens blocks, rescaled to [0, 1]; each block flattened (row, column, channel)
        (`patches_merge` of k x k teacher patches), blocks row-major; positions (column, row)
        of the block; padded to max_soft_tokens rows (positions -1), dropped here
    embedder (`vision_embedder.*` in the checkpoint): LayerNorm -> Linear (bias) -> LayerNorm
        over the raw pixels, + table[col, 0] + table[row, 1] (the factorized position table,
        mm_posemb_size a side), -> LayerNorm (all LayerNorms torch's, eps 1e-5, with bias)
    embed_vision: a weightless RMSNorm (vision rms_norm_eps, float32), a projection of
        output_proj_dims to the text width -> h * w rows, not scaled by sqrt(hidden)
    prompt: each <|image|> becomes <|image> + <|image|> x (h * w) + <image|> (HF's processor)
    attention: with text_config.use_bidirectional_attention="vision" an image's soft tokens see
        each other both ways at prefill on every layer, full and sliding (unlike Gemma 4:
        transformers' `create_masks_for_generate`; models/gemma4_unified.py)

Refused by name: output_proj_dims other than mm_embed_dim (the projection reads the embedder's
rows; transformers fails on it too), an image longer than the position table (mm_posemb_size),
and, with two-way images, an image of more soft tokens than text_config.sliding_window
(transformers ORs the image block after the window, so its rows would see past it; the
engine's key ends keep the window's lower bound).
Audio and video inputs are refused (only multi_modal_data['image'] runs).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.norm import UnitRMSNorm
from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.gemma4 import Gemma4TorchProcessor as _Gemma4TorchProcessor
from paged_engine.multimodal.gemma4 import (
    MultimodalEmbedder,
    bidirectional,
    check_position_table,
    gemma4_size,
)
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.torch_processors import normalize, resize

# the embedder's parts, saved as `vision_embedder.*` (transformers' module: `embed_vision.*`)
_EMBEDDER_PARTS = ("patch_ln1.", "patch_dense.", "patch_ln2.", "pos_embedding", "pos_norm.")


def check_config(config: Any) -> None:
    """ValueError naming the vision_config field this embedder does not run."""
    vision = config.vision_config
    if int(vision.output_proj_dims) != int(vision.mm_embed_dim):
        raise ValueError(
            f"Gemma 4 Unified vision_config.output_proj_dims={vision.output_proj_dims} must "
            f"equal mm_embed_dim={vision.mm_embed_dim} (the projection reads the embedder's rows)"
        )


def model_patch(config: Any) -> int:
    """A soft token's side in pixels: k teacher patches of p pixels."""
    vision = config.vision_config
    return int(vision.patch_size) * int(vision.pooling_kernel_size)


def patch_dim(config: Any) -> int:
    return 3 * model_patch(config) ** 2


def image_tokens(config: Any, grid: tuple[int, ...]) -> int:
    """Soft tokens (= feature rows) of an image of an h x w grid of model patches."""
    h, w = grid
    side = int(config.vision_config.mm_posemb_size)
    check_position_table(h, w, side, "embedder's (mm_posemb_size)")
    window = getattr(config.text_config, "sliding_window", None)
    if bidirectional(config) and window is not None and h * w > int(window):
        raise ValueError(
            f"multi_modal_data['image']: an image of {h * w} soft tokens is longer than "
            f"text_config.sliding_window={window}: transformers' two-way image block reaches "
            "past the window there, which paged does not run (pass a smaller max_soft_tokens "
            "in mm_processor_kwargs)"
        )
    return h * w


class VisionEmbedder(nn.Module):
    """Raw model patches [N, 3 (k p)^2] and their (column, row) -> rows [N, mm_embed_dim]."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vision = config.vision_config
        d, width = patch_dim(config), int(vision.mm_embed_dim)
        self.patch_ln1 = nn.LayerNorm(d)
        self.patch_dense = nn.Linear(d, width)
        self.patch_ln2 = nn.LayerNorm(width)
        self.pos_embedding = nn.Parameter(torch.empty(int(vision.mm_posemb_size), 2, width))
        self.pos_norm = nn.LayerNorm(width)

    def forward(
        self, patches: torch.Tensor, cols: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        x = self.patch_ln1(patches.to(self.patch_dense.weight.dtype))  # as HF: cast, then norm
        x = self.patch_ln2(self.patch_dense(x))
        table = self.pos_embedding  # [mm_posemb_size, 2 (column, row axis), width]
        return self.pos_norm(x + (table[cols, 0] + table[rows, 1]))


class _Projection(MultimodalEmbedder):
    """Gemma 4's weightless RMSNorm and projection into the text width, of output_proj_dims
    (the unified vision config has no hidden_size)."""

    def __init__(self, config: Any) -> None:
        nn.Module.__init__(self)
        vision, width = config.vision_config, int(config.vision_config.output_proj_dims)
        self.embedding_pre_projection_norm = UnitRMSNorm(float(vision.rms_norm_eps))
        self.embedding_projection = nn.Linear(
            width, int(config.text_config.hidden_size), bias=False
        )


class Gemma4UnifiedImageEncoder(nn.Module):
    """Images -> rows of the text model's input embedding (one row per model patch)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        check_config(config)
        self.vision_embedder = VisionEmbedder(config)
        self.embed_vision = _Projection(config)

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        device = self.embed_vision.embedding_projection.weight.device
        cols, rows, sizes = [], [], []
        for m in images:  # no attention: all images' patches go through in one call
            assert m.pixel_values is not None and m.image_size is not None
            h, w = m.image_size
            grid = torch.arange(h * w, device=device)
            rows.append(grid // w)
            cols.append(grid % w)
            sizes.append(h * w)
        patches = torch.cat([m.pixel_values for m in images]).to(device)  # float32
        x = self.vision_embedder(patches, torch.cat(cols), torch.cat(rows))
        return list(self.embed_vision(x).split(sizes))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `[model.]vision_embedder.*` and `[model.]embed_vision.*` tensors
        (transformers' in-memory names, `embed_vision.patch_ln1.*` /
        `embed_vision.multimodal_embedder.*`, too); the text model and audio embedder are passed
        over; ValueError naming a missing or unexpected one."""

        def ours(name: str) -> str | None:
            name = name.removeprefix("model.")
            if name.startswith("embed_vision."):
                tail = name.removeprefix("embed_vision.").removeprefix("multimodal_embedder.")
                prefix = "vision_embedder." if tail.startswith(_EMBEDDER_PARTS) else "embed_vision."
                return prefix + tail
            return name if name.startswith("vision_embedder.") else None

        picked = ((n, t) for n, t in ((ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self, picked)


class Gemma4UnifiedTorchProcessor(_Gemma4TorchProcessor):
    """Gemma4UnifiedImageProcessor (torchvision only in transformers) in torch: Gemma 4's
    resize and rescale, then (k p)-pixel blocks row-major, each flattened (row, column,
    channel), padded to max_soft_tokens rows of 0. Out: pixel_values [images, max_soft_tokens,
    3 (k p)^2], image_position_ids [images, max_soft_tokens, 2] ((column, row); -1 on padding),
    num_soft_tokens_per_image."""

    name = "Gemma4UnifiedImageProcessor"
    defaults: ClassVar[dict[str, Any]] = _Gemma4TorchProcessor.defaults

    def preprocess(self, images: list[torch.Tensor], s: dict[str, Any]) -> dict[str, Any]:
        p, k, most = int(s["patch_size"]), int(s["pooling_kernel_size"]), int(s["max_soft_tokens"])
        side = k * p
        pixels, where, soft = [], [], []
        for x in images:
            if s["do_resize"]:
                x = resize(x, gemma4_size(*x.shape[-2:], p, most * k**2, k), s["resample"])
            x = normalize(x, s)
            c, h, w = x.shape
            rows = x.reshape(c, h // side, side, w // side, side).permute(1, 3, 2, 4, 0)
            rows = rows.reshape(-1, side * side * c)
            cols, lines = torch.meshgrid(
                torch.arange(w // side), torch.arange(h // side), indexing="xy"
            )
            grid = torch.stack([cols, lines], dim=-1).reshape(-1, 2)
            pad = most - rows.shape[0]
            pixels.append(F.pad(rows, (0, 0, 0, pad)))
            where.append(F.pad(grid, (0, 0, 0, pad), value=-1))
            soft.append(rows.shape[0])
        return {
            "pixel_values": torch.stack(pixels),
            "image_position_ids": torch.stack(where),
            "num_soft_tokens_per_image": torch.tensor(soft),
        }
