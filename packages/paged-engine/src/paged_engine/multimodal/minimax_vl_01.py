"""MiniMax-VL-01's images (`MiniMaxVL01ForConditionalGeneration`, remote code: the release's
image_processor.py "anyres" path, as vLLM's minimax_vl_01.py calls it). The model side is
LLaVA-NeXT's (multimodal/llava_next.py: tower, projector, unpadded tile map, image_newline;
the config: models/minimax_vl_01_config.py); the prompt side is AnyResLayout's run of
`AnyRes.tokens` placeholders (vLLM's LlavaNextProcessingInfo count). What differs from
transformers' LlavaNextImageProcessor is how the pixels are made:

    image (w x h, RGB) -> best resolution (R_w, R_h) of image_grid_pinpoints, each read as
        (width, height) (LLaVA-NeXT's rule otherwise: most of the image kept, least waste)
    base view: the image resized (PIL bicubic) straight to S x S (no aspect kept, no crop)
    tiles: the image resized (PIL bicubic) into R_w x R_h with its aspect kept, the scaled
        side int(R * side / other) (floor), pasted centered ((R - scaled) // 2) on black,
        cut into S x S tiles row by row
    every view: / 255, then (x - image_mean) / image_std -> pixels [1 + rows * cols, 3, S, S]

The release's processor reads each pinpoint as (width, height), the model's grid (transformers'
`get_anyres_image_grid_shape`, as vLLM calls it; AnyRes.grid here) as (height, width). Where the
list holds each pinpoint's transpose too (the releases' lists do; one that does not is refused
by name: tile count and grid could differ) both pick the same resolution, except on a tie
between a pinpoint and its transpose (a square image between 1 x 2 and 2 x 1): the same number
of tiles then, cut by the processor's pick and laid out by the model's, as vLLM runs them.

preprocessor_config.json (the release's `ImageProcessor`): `process_image_mode` must be "anyres"
(its "resize", "keepratio_resize", "dynamic_res" are refused by name), `size` the tower's S
(square), `image_grid_pinpoints` the config's; `image_mean` / `image_std` as saved (CLIP's by
default).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paged_engine.models.minimax_vl_01_config import ARCH, DEFAULT_PINPOINTS, MODE, check_mode
from paged_engine.multimodal.layouts_single_run import AnyResLayout
from paged_engine.multimodal.llava_next import AnyRes, best_resolution

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# the release processor class's default mode: a saved preprocessor_config.json without
# process_image_mode runs it, which is refused
MODE_DEFAULT = "resize"


def keep_ratio(image: Any, height: int, width: int) -> Any:
    """`image` scaled (bicubic) into width x height with its aspect kept, centered on black
    (a scaled side of 0 pixels, where the release's processor fails, is 1)."""
    from PIL import Image

    w, h = image.size
    if w / h > width / height:  # wider than the frame: full width, bands above and below
        scaled = max(1, int(width * h / w))
        size, at = (width, scaled), (0, (height - scaled) // 2)
    else:
        scaled = max(1, int(height * w / h))
        size, at = (scaled, height), ((width - scaled) // 2, 0)
    canvas = Image.new("RGB", (width, height), (0, 0, 0))
    canvas.paste(image.resize(size, Image.Resampling.BICUBIC), at)
    return canvas


class MiniMaxVL01ImageProcessor:
    """The release's "anyres" preprocessing (module doc), called as an HF image processor; it
    takes no mm_processor_kwargs (no `valid_kwargs`: processor.py refuses each by name)."""

    def __init__(self, anyres: AnyRes, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        self.anyres = anyres
        self.mean = np.asarray(mean, dtype=np.float32)
        self.std = np.asarray(std, dtype=np.float32)

    def _tensor(self, image: Any) -> torch.Tensor:  # PIL RGB h x w -> [3, h, w]
        x = (np.asarray(image, dtype=np.float32) / 255 - self.mean) / self.std
        return torch.from_numpy(x).permute(2, 0, 1)

    def one(self, image: Any) -> tuple[torch.Tensor, tuple[int, int]]:
        from PIL import Image

        image = image.convert("RGB")
        w, h = image.size
        side = self.anyres.image_size
        # the release's pick: (w, h) against pinpoints read as (width, height); best_resolution
        # reads (h, w) against (height, width), so the swapped call is the same rule
        width, height = best_resolution((w, h), self.anyres.pinpoints)
        rows, cols = height // side, width // side
        base = self._tensor(image.resize((side, side), Image.Resampling.BICUBIC))
        tiles = self._tensor(keep_ratio(image, height, width))  # [3, rows S, cols S]
        # [3, rows S, cols S] -> [rows * cols, 3, S, S], tile (r, c) at r * cols + c
        tiles = tiles.view(3, rows, side, cols, side).permute(1, 3, 0, 2, 4)
        return torch.cat([base[None], tiles.reshape(-1, 3, side, side)]), (h, w)

    def __call__(self, images: list[Any], return_tensors: str = "pt", **_: Any) -> dict:
        done = [self.one(image) for image in images]
        return {"pixel_values": [p for p, _ in done], "image_sizes": [s for _, s in done]}


def _pairs(value: Any) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in value]


class MiniMaxVL01Layout(AnyResLayout):
    """LLaVA-NeXT's runs and views; the pixels by the release's processor (module doc)."""

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        super().__init__(config, placeholder, tokenizer)
        pinpoints = set(self.anyres.pinpoints)
        if any((w, h) not in pinpoints for h, w in pinpoints):
            raise ValueError(
                f"image_grid_pinpoints={[list(p) for p in self.anyres.pinpoints]!r} is not "
                f"supported for {ARCH}: each pinpoint's transpose must be listed too (the "
                "release's processor reads them as (width, height), its model as (height, width))"
            )
        self.mean, self.std = _CLIP_MEAN, _CLIP_STD

    def read_saved(self, path: Path) -> None:
        """preprocessor_config.json's mode, size, pinpoints, mean and std (module doc)."""
        file = Path(path) / "preprocessor_config.json"
        saved = json.loads(file.read_text()) if file.is_file() else {"process_image_mode": MODE}
        check_mode(saved.get("process_image_mode", MODE_DEFAULT), f"{file.name} field")
        side = self.anyres.image_size
        size = saved.get("size", [side, side])
        if isinstance(size, int):
            size = [size, size]
        if not isinstance(size, (list, tuple)) or [int(s) for s in size] != [side, side]:
            raise ValueError(
                f"{file.name} field size={size!r} is not supported for {ARCH}: "
                f"[{side}, {side}] (the vision tower's image_size)"
            )
        saved_points = _pairs(saved.get("image_grid_pinpoints") or DEFAULT_PINPOINTS)
        if saved_points != list(self.anyres.pinpoints):
            raise ValueError(
                f"{file.name} field image_grid_pinpoints={saved_points!r} differs from "
                f"config.json's {list(self.anyres.pinpoints)!r}: the tiles would not match the "
                f"model's grid ({ARCH})"
            )
        self.mean = tuple(float(v) for v in saved.get("image_mean", self.mean))
        self.std = tuple(float(v) for v in saved.get("image_std", self.std))

    def image_processor(self) -> MiniMaxVL01ImageProcessor:
        return MiniMaxVL01ImageProcessor(self.anyres, self.mean, self.std)
