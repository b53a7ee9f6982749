"""Idefics3 / SmolVLM's image path: an image as tiles, each tile its own run of placeholders.

    image -> the checkpoint's image processor: resized, cut into rows x cols tiles of S x S
        (none for a small image), plus the whole image squeezed to S x S ("global")
    prompt: each <image> token becomes (HF's layout, the text between runs included)
        <fake_token_around_image><row_1_col_1><image> x n ... <row_1_col_{cols}><image> x n \\n
        ... (a line per row) \\n<fake_token_around_image><global-img><image> x n
        <fake_token_around_image>
      or, untiled: <fake_token_around_image><global-img><image> x n <fake_token_around_image>
    each tile -> SigLIP-style tower (all layers, post_layernorm)
        -> connector: pixel shuffle (scale_factor^2 neighbouring patches into one row)
        -> modality_projection (no bias) -> n = (S / patch)^2 / scale_factor^2 rows

A tile is one `ImageInput` (its pixels, its run, its hash): the runs of one image are apart, but
each is whole, so the runner's splice and the prefix-cache keys treat tiles as images. Tiles
are full S x S squares, so the tower's patch mask is all ones and its position ids are
transformers' bucketed ones for a full grid (`VisionEmbeddings.position_ids`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.vision_transformer import FinalNormTower, pixel_shuffle

ARCHS = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")
FAKE, GLOBAL, IMAGE = "<fake_token_around_image>", "<global-img>", "<image>"


def tile_tokens(config) -> int:
    """n: placeholders (= feature rows) of one tile."""
    vision, scale = config.vision_config, int(config.scale_factor)
    side = int(vision.image_size) // int(vision.patch_size)
    if scale < 1:  # each tile's side / scale patches a side: the pixel shuffle's factor
        raise ValueError(f"config.scale_factor must be a positive integer, got {scale}")
    if side % scale:
        raise ValueError(f"scale_factor={scale} does not divide the tower's {side} patches a side")
    return (side // scale) ** 2


def image_prompt(rows: int, cols: int, n: int) -> str:
    """The text an image's <image> token becomes, for a rows x cols tiling (0, 0: untiled)."""
    whole = f"{FAKE}{GLOBAL}{IMAGE * n}{FAKE}"
    if rows == 0 and cols == 0:
        return whole
    lines = [
        "".join(f"{FAKE}<row_{r + 1}_col_{c + 1}>{IMAGE * n}" for c in range(cols)) + "\n"
        for r in range(rows)
    ]
    return "".join(lines) + "\n" + whole


class _Projection(nn.Module):
    def __init__(self, width: int, out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, out, bias=False)


class _Connector(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.scale = int(config.scale_factor)
        width = int(config.vision_config.hidden_size) * self.scale**2
        self.modality_projection = _Projection(width, int(config.text_config.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, side * side, D]
        """Pixel shuffle: each scale x scale block of patches (row-major within the block) as
        one row of scale^2 * D features, blocks row-major; then the projection."""
        return self.modality_projection.proj(pixel_shuffle(x, self.scale))


class TowerConnectorEncoder(nn.Module):
    """An image encoder of a SigLIP-style `vision_model` (its final-norm states) then a
    `connector`, in the checkpoint's names (Idefics3's, and Idefics2's at each view's size)."""

    vision_model: FinalNormTower
    connector: nn.Module

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, 3, h, w] -> [N, n, D]
        return self.connector(self.vision_model.last(pixels))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `[model.]vision_model.*` and `[model.]connector.*` tensors (any
        other name is passed over); ValueError naming a missing or unexpected one."""

        def ours(name: str) -> str | None:
            name = name.removeprefix("model.")
            return name if name.startswith(("vision_model.", "connector.")) else None

        picked = ((n, t) for n, t in ((ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self, picked)


class Idefics3ImageEncoder(TowerConnectorEncoder):
    """Tiles -> rows of the text model's input embedding, one per placeholder."""

    def __init__(self, config) -> None:
        super().__init__()
        self.tile_tokens = tile_tokens(config)
        self.vision_model = FinalNormTower(config.vision_config)
        self.connector = _Connector(config)

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        weight = self.connector.modality_projection.proj.weight
        pixels = torch.stack([m.pixel_values for m in images])  # type: ignore[misc]
        return list(self(pixels.to(weight.device, weight.dtype)))
