"""Isaac's image encoder (the remote's `model.vision_embedding`, an nn.Sequential; vLLM's
IsaacVisionEmbedding): a SigLIP2 NaFlex tower, pixel shuffle and a two-layer projector into the
Qwen3 decoder (host side: multimodal/isaac.py; config: models/isaac_config.py).

    pixels [h * w, p * p * 3] of grid (1, h, w)
    -> vision_embedding.0 (the remote's Siglip2SequenceVisionTransformer): transformers'
       Siglip2VisionModel without its head, one image alone (lfm2_vl.Siglip2Tower: the Linear
       patch embedding, the side x side position table resized to h x w by bilinear
       antialiased interpolation, SigLIP's layers, post_layernorm). The remote packs a batch's
       images into one sequence with per-image (varlen) attention: each image's rows as alone
    -> pixel shuffle (s = vision_config.pixel_shuffle_scale_factor): each s x s block of the
       row-major grid one row, its patches row-major in the block, blocks row-major
       [h * w / s^2, s^2 D]
    -> vision_embedding.1 (Linear s^2 D -> 4 s^2 D, no bias) -> SiLU -> vision_embedding.3
       (Linear 4 s^2 D -> text hidden, no bias)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.lfm2_vl import Siglip2Tower
from paged_engine.multimodal.vision_transformer import pixel_shuffle

_PREFIX = "model.vision_embedding."
# the remote's Sequential indices -> ours (index 2 is the SiLU: no weights)
_PARTS = {"0.": "tower.", "1.": "linear_fc1.", "3.": "linear_fc2."}


class IsaacImageEncoder(nn.Module):
    """Images -> rows of the text model's input embedding, one per placeholder."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        v = config.vision_config
        self.shuffle = int(v.pixel_shuffle_scale_factor)
        self.tower = Siglip2Tower(v)
        wide = int(v.hidden_size) * self.shuffle**2
        self.linear_fc1 = nn.Linear(wide, 4 * wide, bias=False)
        self.linear_fc2 = nn.Linear(4 * wide, int(config.text_config.hidden_size), bias=False)

    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image: pixels [h * w, p * p * 3] of grid (1, h, w) -> [h * w / s^2, text hidden]."""
        t, h, w = grid
        s = self.shuffle
        if t != 1 or h % s or w % s:
            raise ValueError(
                f"image_grid_thw {grid}: (1, h, w) with h and w multiples of "
                f"pixel_shuffle_scale_factor {s}"
            )
        weight = self.linear_fc1.weight
        x = self.tower(pixels.to(weight.device, weight.dtype)[None], (h, w))  # [1, h*w, D]
        x = pixel_shuffle(x, s, h)[0]  # [h*w / s^2, s^2 D]
        return self.linear_fc2(F.silu(self.linear_fc1(x)))

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        out = []
        for m in images:
            grid = tuple(int(x) for x in m.image_size)  # type: ignore[union-attr]
            out.append(self(m.pixel_values, grid))  # type: ignore[arg-type]
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `model.vision_embedding.{0,1,3}.*` tensors (anything else is passed
        over); ValueError naming a missing or unexpected one."""

        def ours(name: str) -> str | None:
            if not name.startswith(_PREFIX):
                return None
            rest = name.removeprefix(_PREFIX)
            part = next((p for p in _PARTS if rest.startswith(p)), None)
            return None if part is None else _PARTS[part] + rest.removeprefix(part)

        picked = ((n, t) for n, t in ((ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self, picked)
