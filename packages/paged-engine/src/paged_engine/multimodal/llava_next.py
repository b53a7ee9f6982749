"""LLaVA-NeXT's image path ("anyres"): an image as a base view plus a grid of tiles.

    image (h, w) -> best resolution (R_h, R_w) of image_grid_pinpoints for its size
    pixels [1 + rows * cols, 3, S, S]: the whole image resized to S x S, then the image
        resized into R_h x R_w (aspect kept, padded) cut into rows x cols tiles of S x S
        (rows = R_h // S, cols = R_w // S; the checkpoint's image processor does all this)
    tower + feature selection + projector on every view, as LLaVA (multimodal/llava.py)
        -> [1 + rows * cols, p * p, D]   (p = S // patch_size patches a side)
    base view: p * p rows, as they come
    tiles: one feature map [rows * p, cols * p, D], the padding's rows or columns cut off
        (unpad: the image's aspect ratio decides), `image_newline` appended to each row
    image features = base rows, then the map row by row: p * p + H' * (W' + 1) rows

Where HF's processor counts an image's placeholders, `AnyRes.tokens` computes the same number
from the same rule, so a prompt's runs and the features always agree. LLaVA-OneVision
("anyres_max_N") scales a tile map over N views' worth of patches down (bilinear, as HF) and
gives each image of a prompt holding several one padded view: its rows and a newline. Only
the "spatial_unpad" merge (LLaVA-NeXT's, the only one transformers runs) is built.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.llava import LlavaImageEncoder
from paged_engine.multimodal.vision_transformer import TOWERS

ARCH = "LlavaNextForConditionalGeneration"
ONEVISION = "LlavaOnevisionForConditionalGeneration"
# architectures whose tile map is scaled down past vision_aspect_ratio "anyres_max_N"
ANYRES_MAX = (ONEVISION, "BeeForConditionalGeneration")  # Bee: multimodal/bee.py


def best_resolution(size: tuple[int, int], pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The (height, width) of `pinpoints` that keeps the most of an image of `size` (h, w)
    once scaled into it (aspect kept), the one wasting least area on a tie (first wins)."""
    h, w = size
    best, most, waste = None, -1, float("inf")
    for ph, pw in pinpoints:
        scale = min(pw / w, ph / h)
        kept = min(int(w * scale) * int(h * scale), w * h)
        wasted = pw * ph - kept
        if kept > most or (kept == most and wasted < waste):
            best, most, waste = (int(ph), int(pw)), kept, wasted
    assert best is not None
    return best


def unpadded(size: tuple[int, int], height: int, width: int) -> tuple[int, int]:
    """(rows, cols) of a height x width feature map of an image of `size` (h, w) that was
    scaled into the map's frame and padded evenly on both sides, with the padding cut off."""
    h, w = size
    if w / h > width / height:  # wider than the frame: padded above and below
        pad = (height - int(round(h * (width / w), 7))) // 2
        return height - 2 * pad, width
    pad = (width - int(round(w * (height / h), 7))) // 2
    return height, width - 2 * pad


@dataclass(frozen=True)
class AnyRes:
    """The checkpoint's anyres geometry: tiles, feature rows and placeholders of an image."""

    image_size: int  # S: a view's side in pixels
    side: int  # p: patches along a view's side
    base_tokens: int  # feature rows of the base view
    pinpoints: tuple[tuple[int, int], ...]
    # LLaVA-OneVision ("anyres_max_N"): a tile map over N views' worth of patches is scaled
    # down (bilinear) by ratio = sqrt(h * w / (N * p * p)) where ratio > 1.1; None: never
    max_views: int | None = None

    @classmethod
    def from_config(cls, config) -> AnyRes:
        vision = config.vision_config
        pinpoints = getattr(config, "image_grid_pinpoints", None)
        if not pinpoints or any(len(p) != 2 for p in pinpoints):
            raise ValueError(
                f"image_grid_pinpoints={pinpoints!r} must be a list of [height, width] pairs"
            )
        size, side = int(vision.image_size), int(vision.image_size) // int(vision.patch_size)
        strategy = config.vision_feature_select_strategy
        cls_token = bool(TOWERS.get(getattr(vision, "model_type", None), False))
        tokens = side * side + int(cls_token) - int(strategy == "default")
        if tokens != side * side:  # HF's model could not lay the tiles' features out either
            raise ValueError(
                f"vision_feature_select_strategy={strategy!r} on a "
                f"{vision.model_type} tower gives {tokens} features a view, not the "
                f"{side}x{side} patch grid LLaVA-NeXT's tiles need"
            )
        if any(int(h) % size or int(w) % size or int(h) <= 0 or int(w) <= 0 for h, w in pinpoints):
            raise ValueError(
                f"image_grid_pinpoints={pinpoints!r}: each height and width must be a positive "
                f"multiple of the vision tower's image_size {size}"
            )
        max_views = None
        if any(a in ANYRES_MAX for a in getattr(config, "architectures", None) or []):
            aspect = str(getattr(config, "vision_aspect_ratio", "anyres_max_9"))
            if not aspect.startswith("anyres_max_") or not aspect[11:].isdigit():
                raise ValueError(f"vision_aspect_ratio={aspect!r} is not anyres_max_<N>")
            max_views = int(aspect[11:])
        pairs = tuple((int(h), int(w)) for h, w in pinpoints)
        return cls(size, side, tokens, pairs, max_views)

    def scaled(self, h: int, w: int) -> tuple[int, int] | None:
        """OneVision's scaled-down map of an unpadded h x w map, None where it stays."""
        if self.max_views is None:
            return None
        ratio = math.sqrt(h * w / (self.max_views * self.side**2))
        return (int(h // ratio), int(w // ratio)) if ratio > 1.1 else None

    def grid(self, size: tuple[int, int]) -> tuple[int, int]:
        """(rows, cols) of tiles for an image of `size` (h, w)."""
        h, w = best_resolution(size, self.pinpoints)
        return h // self.image_size, w // self.image_size

    def views(self, size: tuple[int, int]) -> int:
        rows, cols = self.grid(size)
        return 1 + rows * cols

    def tokens(self, size: tuple[int, int]) -> int:
        """Placeholders (= feature rows) of an image of `size` (h, w)."""
        rows, cols = self.grid(size)
        h, w = unpadded(size, rows * self.side, cols * self.side)
        h, w = self.scaled(h, w) or (h, w)
        return self.base_tokens + h * (w + 1)


class LlavaNextImageEncoder(LlavaImageEncoder):
    """Images -> rows of the text model's input embedding, one per placeholder (module doc)."""

    own_weights = ("image_newline",)

    def __init__(self, config) -> None:
        super().__init__(config)
        self.anyres = AnyRes.from_config(config)
        self.image_newline = nn.Parameter(torch.empty(config.text_config.hidden_size))

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        dtype = self.image_newline.dtype
        device = self.image_newline.device
        pixels = torch.cat([m.pixel_values for m in images]).to(device, dtype)
        views = self(pixels).split([m.pixel_values.shape[0] for m in images])
        return [self._pack(v, m.image_size) for v, m in zip(views, images, strict=True)]

    def _pack(self, views: torch.Tensor, size: tuple[int, int] | None) -> torch.Tensor:
        if views.shape[0] == 1:  # OneVision, an image among several: its one view, a newline
            return torch.cat([views[0], self.image_newline.to(views.dtype)[None]])
        if size is None:
            raise ValueError("a LLaVA-NeXT image needs its image_size (h, w)")
        base, tiles = views[0], views[1:]
        p, dim = self.anyres.side, views.shape[-1]
        rows, cols = self.anyres.grid(size)
        # [rows * cols, p * p, D] -> [rows * p, cols * p, D]: tile (r, c)'s patch (i, j) at
        # row r * p + i, column c * p + j
        grid = tiles.view(rows, cols, p, p, dim).permute(0, 2, 1, 3, 4)
        grid = grid.reshape(rows * p, cols * p, dim)
        h, w = unpadded(size, rows * p, cols * p)
        top, left = (rows * p - h) // 2, (cols * p - w) // 2
        grid = grid[top : top + h, left : left + w]
        scaled = self.anyres.scaled(h, w)
        if scaled is not None:  # OneVision: [h, w, D] -> [h', w', D], bilinear as HF
            grid = F.interpolate(grid.permute(2, 0, 1)[None], list(scaled), mode="bilinear")
            grid = grid[0].permute(1, 2, 0)
            h, w = scaled
        newline = self.image_newline.to(grid.dtype).expand(h, 1, dim)
        return torch.cat([base, torch.cat([grid, newline], dim=1).reshape(-1, dim)])
