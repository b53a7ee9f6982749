"""Molmo2's pixels and pooling windows on the host (transformers' Molmo2ImageProcessor, in
torch alone where its torchvision class cannot run): `Molmo2TorchProcessor` and `Geometry`, an
image's crops and tokens as plain ints (multimodal/molmo2.py has the prompt side; its module doc
draws the rule).

    tiling (th, tw): select_tiling over th * tw <= max_crops of (H - (l + r) p, W - (l + r) p)
        in windows of (cp - l - r) p pixels (the smallest scale-up, else the largest
        scale-down; ties to fewer crops, then fewer rows; float32 as transformers computes it)
    canvas th * window * p + (l + r) p by tw * ...: resized (bilinear, no antialias, in float32,
        rounded back to uint8), normalized, cut into th x tw crops of S x S overlapping by
        l + r patches; the global view (the image at S x S) first
    Geometry.pooling: the global view's cp x cp grid and the canvas' patch grid (overlapped
        margins dropped), each padded with -1 to whole ph x pw windows, windows row-major
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from paged_engine.multimodal.layouts import Size
from paged_engine.multimodal.torch_processors import (
    ProcessorKwargs,
    TorchImageProcessor,
    normalize,
)


@dataclass(frozen=True, slots=True)
class Geometry:
    """An image's crops and tokens, as plain ints (its `ImageInput.image_size`): the tiling,
    patches a crop side, margins, pooling window, the global view's start token and the column
    tokens of the two grids (-1: none)."""

    tiling_h: int
    tiling_w: int
    crop_patches: int
    left: int
    right: int
    pool_h: int
    pool_w: int
    low_start: int
    low_col: int
    high_col: int

    @property
    def views(self) -> int:
        return 1 + self.tiling_h * self.tiling_w

    def grids(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """((rh, rw), (rows, cols)): the pooled grids of the global view and of the canvas."""
        window = self.crop_patches - self.left - self.right
        canvas = (
            self.tiling_h * window + self.left + self.right,
            self.tiling_w * window + self.left + self.right,
        )
        low = (
            math.ceil(self.crop_patches / self.pool_h),
            math.ceil(self.crop_patches / self.pool_w),
        )
        return low, (math.ceil(canvas[0] / self.pool_h), math.ceil(canvas[1] / self.pool_w))

    def segment(self, patch: int, start: int, end: int) -> list[int]:
        """The tokens the image writes (Molmo2Processor.replace_image_token)."""
        (rh, rw), (rows, cols) = self.grids()
        low_row = [patch] * rw + ([self.low_col] if self.low_col >= 0 else [])
        high_row = [patch] * cols + ([self.high_col] if self.high_col >= 0 else [])
        return [self.low_start, *low_row * rh, end, start, *high_row * rows, end]

    def pooling(self) -> torch.Tensor:
        """[tokens, pool_h * pool_w] int64 indices into the views' patches (-1: padding): the
        global view's windows, then the canvas' (image_token_pooling)."""
        cp, left, right = self.crop_patches, self.left, self.right
        per_crop = cp * cp
        grid = torch.arange(self.tiling_h * self.tiling_w * per_crop).reshape(
            self.tiling_h, self.tiling_w, cp, cp
        )
        if left:  # a crop's leading margin overlaps the crop before it: dropped
            grid[1:, :, :left, :] = -1
            grid[:, 1:, :, :left] = -1
        if right:
            grid[:-1, :, -right:, :] = -1
            grid[:, :-1, :, -right:] = -1
        grid = grid.permute(0, 2, 1, 3).reshape(-1)
        window = cp - left - right
        canvas = grid[grid >= 0].reshape(
            self.tiling_h * window + left + right, self.tiling_w * window + left + right
        )
        high = _windows(canvas, self.pool_h, self.pool_w)
        low = _windows(torch.arange(per_crop).reshape(cp, cp), self.pool_h, self.pool_w)
        return torch.cat([low, torch.where(high >= 0, high + per_crop, -1)])


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _pair(v: Any, least: int) -> bool:
    """Whether v is two ints >= least (a list or tuple)."""
    return (
        isinstance(v, (list, tuple)) and len(v) == 2 and all(_is_int(x) and x >= least for x in v)
    )


def _windows(grid: torch.Tensor, ph: int, pw: int) -> torch.Tensor:
    """A [h, w] index grid padded with -1 to whole ph x pw windows (the odd row or column
    after), windows row-major -> [windows, ph * pw]."""
    h, w = grid.shape
    dh, dw = -h % ph, -w % pw
    grid = F.pad(grid, (dw // 2, (dw + 1) // 2, dh // 2, (dh + 1) // 2), value=-1)
    rows, cols = grid.shape[0] // ph, grid.shape[1] // pw
    return grid.reshape(rows, ph, cols, pw).permute(0, 2, 1, 3).reshape(rows * cols, ph * pw)


def select_tiling(height: int, width: int, window: int, max_crops: int) -> tuple[int, int]:
    """(th, tw) of th * tw <= max_crops windows of `window` pixels: the one needing the least
    scale-up to cover (height, width), else (every one shrinks it) the least shrinking; ties to
    fewer crops, then fewer rows (transformers' float32 arithmetic). A covering tiling needs
    th >= ceil(height / window) and tw >= ceil(width / window) and its scale grows with both,
    so tilings past that grid's crop count never win: max_crops is capped there (the same
    choice; max_crops=10**9 would enumerate 10**18 pairs)."""
    need = max(1, -(-height // window)) * max(1, -(-width // window))
    max_crops = min(max_crops, need)
    tilings = sorted(
        (
            t
            for t in itertools.product(range(1, max_crops + 1), repeat=2)
            if t[0] * t[1] <= max_crops
        ),
        key=lambda t: (t[0] * t[1], t[0]),
    )
    sizes = torch.tensor(tilings, dtype=torch.int32) * window
    scale = (sizes.float() / torch.tensor([height, width], dtype=torch.float32)).amin(-1)
    if bool(torch.all(scale < 1)):
        return tilings[int(scale.argmax())]
    return tilings[int(torch.where(scale < 1.0, 10e9, scale).argmin())]


def tiling(height: int, width: int, s: dict[str, Any]) -> tuple[int, int]:
    """The (th, tw) crop grid of an image under the processor settings `s`."""
    p, crop = int(s["patch_size"]), int(s["size"]["height"])
    left, right = (int(m) for m in s["overlap_margins"])
    window = (crop // p - left - right) * p
    margin = (left + right) * p
    return select_tiling(height - margin, width - margin, window, int(s["max_crops"]))


class _Molmo2Kwargs(ProcessorKwargs, total=False):
    size: dict[str, int]
    max_crops: int
    overlap_margins: list[int]
    pooling_size: list[int]


class Molmo2TorchProcessor(TorchImageProcessor):
    """Molmo2ImageProcessor in torch alone (transformers' needs torchvision). Out, as its:
    pixel_values [sum of views, cp * cp, p * p * 3], image_token_pooling, image_grids
    [images, 4], image_num_crops [images]."""

    name = "Molmo2ImageProcessor"
    defaults: ClassVar[dict[str, Any]] = {
        "do_resize": True,
        "resample": 2,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True,
        "size": {"height": 378, "width": 378},
        "max_crops": 8,
        "overlap_margins": [4, 4],
        "patch_size": 14,
        "pooling_size": [2, 2],
    }
    valid_kwargs = _Molmo2Kwargs

    def check(self, s: dict[str, Any]) -> None:
        super().check(s)
        for key, want in (("resample", 2), ("do_resize", True)):
            if s[key] != want:
                raise ValueError(f"{self.name}'s {key}={s[key]!r} is not supported: {want!r}")
        size = s["size"]
        if not isinstance(size, dict) or size.get("height") != size.get("width"):
            raise ValueError(f"{self.name}'s size={size!r}: equal height and width")
        crop, p = size["height"], s["patch_size"]
        if not (_is_int(crop) and _is_int(p) and 0 < p <= crop):
            raise ValueError(f"{self.name}'s size={size!r}: at least patch_size={p!r} pixels")
        if not (_is_int(s["max_crops"]) and s["max_crops"] >= 1):
            raise ValueError(f"{self.name}'s max_crops={s['max_crops']!r}: an int >= 1")
        margins, pool = s["overlap_margins"], s["pooling_size"]
        if not (_pair(margins, 0) and crop // p - sum(margins) > 0):
            raise ValueError(
                f"{self.name}'s overlap_margins={margins!r}: two ints >= 0 leaving a crop "
                f"({crop // p} patches) a window"
            )
        if not _pair(pool, 1):
            raise ValueError(f"{self.name}'s pooling_size={pool!r}: two ints >= 1")

    def _resize(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """Bilinear without antialias in float32, rounded back to uint8 (transformers')."""
        y = F.interpolate(x[None].float(), size=(h, w), mode="bilinear", align_corners=False)
        return y[0].round().clamp(0, 255).to(torch.uint8)

    def views(self, x: torch.Tensor, s: dict[str, Any]) -> tuple[torch.Tensor, Geometry]:
        """One uint8 image [3, H, W] -> its views' patches [views, cp * cp, p * p * 3]."""
        p, crop = int(s["patch_size"]), int(s["size"]["height"])
        left, right = (int(m) for m in s["overlap_margins"])
        ph, pw = (int(v) for v in s["pooling_size"])
        th, tw = tiling(*x.shape[-2:], s)
        step = (crop // p - left - right) * p
        canvas = normalize(
            self._resize(x, th * step + (left + right) * p, tw * step + (left + right) * p), s
        )
        crops = canvas.unfold(1, crop, step).unfold(2, crop, step)  # [3, th, tw, S, S]
        crops = crops.permute(1, 2, 3, 4, 0).reshape(th * tw, crop, crop, 3)
        small = normalize(self._resize(x, crop, crop), s).permute(1, 2, 0)[None]
        views = torch.cat([small, crops])  # [views, S, S, 3]
        n, cp = views.shape[0], crop // p
        patches = views.reshape(n, cp, p, cp, p, 3).transpose(2, 3).reshape(n, cp * cp, p * p * 3)
        return patches.contiguous(), Geometry(th, tw, cp, left, right, ph, pw, -1, -1, -1)

    def preprocess(self, images: list[torch.Tensor], s: dict[str, Any]) -> dict[str, Any]:
        pixels, pooling, grids, crops = [], [], [], []
        for x in images:
            patches, g = self.views(x, s)
            (rh, rw), (rows, cols) = g.grids()
            pixels.append(patches)
            pooling.append(g.pooling())
            grids.append([rh, rw, rows, cols])
            crops.append(patches.shape[0])
        return {
            "pixel_values": torch.cat(pixels),
            "image_token_pooling": torch.cat(pooling),
            "image_grids": torch.tensor(grids, dtype=torch.int64),
            "image_num_crops": torch.tensor(crops, dtype=torch.int64),
        }


def geometries(size: Size) -> list[Geometry]:
    """The geometries an `ImageInput.image_size` holds (one per image of its run, 10 ints
    each); ValueError where it is not Molmo2's."""
    n = len(Geometry.__slots__)
    if (
        not size
        or len(size) % n
        or any(
            v <= 0 for i in range(0, len(size), n) for v in (*size[i : i + 3], *size[i + 5 : i + 7])
        )
    ):
        raise ValueError(f"multi_modal_data['image']: image_size {size} is not Molmo2's")
    return [Geometry(*size[i : i + n]) for i in range(0, len(size), n)]
