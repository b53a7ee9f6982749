"""LFM2-VL's image processor: transformers' Lfm2VlImageProcessor (torchvision-only) in torch
alone, and the bounds on a request's mm_processor_kwargs for it.

`Lfm2VlTorchProcessor` is registered in torch_processors.PROCESSORS: where torchvision is
missing the engine calls it as it calls transformers' class (`processor(images=[...],
return_tensors="pt", **kwargs)`, the same valid kwargs, output keys and dtypes):

    image (uint8 [3, H, W]) -> u = encoder_patch_size * downsample_factor
        smart size (h, w): multiples of u (Python's round), scaled down (floor) over
            max_image_tokens * u^2 pixels, up (ceil) under min_image_tokens * u^2
        too large (H, W rounded, each at least encoder_patch_size: over max_image_tokens *
        u^2 * max_pixels_tolerance) and splitting (do_image_splitting; not min = max = 1):
            the (w, h) tile ratio of min_tiles..max_tiles tiles closest to W / H (a tie to
            the later ratio where the image covers over half its area), the image resized to
            rows x cols tiles of tile_size, cut row-major; then (use_thumbnail, more than one
            tile) the image resized to the smart size
        else: the image resized to the smart size
        resize: torchvision's (torch_processors.resize, antialias); rescale fused into
        normalize (float32); patches [h * w, p * p * 3] (row-major, each (row, col, channel))
    out: pixel_values [views, max_num_patches, p * p * 3] float32 (zero padded; do_pad),
        pixel_attention_mask [views, max_num_patches] int32, spatial_shapes [views, 2] int64,
        with return_row_col_info image_rows / image_cols [images], image_sizes [images, 2]
        (the smart size); max_num_patches = max(max_image_tokens * f^2, (tile_size / p)^2
        with splitting). Where a view has more patches than that (a thin strip's smart size
        runs past max_image_tokens) the batch pads to the longest view and masks it whole;
        transformers leaves its mask max_num_patches long there.

The tile ratios: transformers lists them with a comprehension over n in min..max_tiles and
w, h in 1..n (max_tiles^3 / 3 steps: a hang at max_tiles=1024), a set of them sorted (stably)
by w * h. `target_ratios` adds the same pairs to a set in the order that comprehension first
meets them (by n = max(w, h), then w, then h; O(max_tiles log max_tiles)), which gives the
same set order, hence the same sorted list and the same choice on exact ties.

`check_kwargs` (Lfm2VlLayout's, before any pixel is made) refuses by name what would make
more pixels or tiles than the budget (kwargs_budget.MOST_PIXELS), a search transformers could
not finish, or views the model does not read.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from paged_engine.multimodal.kwargs_budget import MOST_PIXELS
from paged_engine.multimodal.torch_processors import (
    ProcessorKwargs,
    TorchImageProcessor,
    normalize,
    resize,
)

# max_tiles a request may ask for with splitting: transformers' search lists ~max_tiles^3 / 3
# candidates (~90k at 64, milliseconds; 3.6e8 at 1024) and each tile is a tower run
MOST_TILES = 64
_FLAGS = ("do_image_splitting", "use_thumbnail", "do_pad", "return_row_col_info")
_FLAGS += ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")
_COUNTS = ("min_tiles", "max_tiles", "min_image_tokens", "max_image_tokens")
_COUNTS += ("encoder_patch_size", "downsample_factor", "tile_size")
_TILE_KNOBS = ("do_image_splitting", "min_tiles", "max_tiles", "tile_size")


class _Lfm2VlKwargs(ProcessorKwargs, total=False):
    size: dict[str, int]
    downsample_factor: int
    do_image_splitting: bool
    min_tiles: int
    max_tiles: int
    use_thumbnail: bool
    min_image_tokens: int
    max_image_tokens: int
    encoder_patch_size: int
    tile_size: int
    max_pixels_tolerance: float
    do_pad: bool
    return_row_col_info: bool


@lru_cache(maxsize=64)
def target_ratios(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """transformers' _target_ratios: the (w, h) with min_tiles <= w * h <= max_tiles, in its
    order (see the module)."""
    found: set[tuple[int, int]] = set()
    first = max(min_tiles, 1)
    for w in range(1, min(first, max_tiles) + 1):  # n = first: every w, h <= first, w-major
        for h in range(max(1, -(-min_tiles // w)), min(first, max_tiles // w) + 1):
            found.add((w, h))
    for n in range(first + 1, max_tiles + 1):  # then the pairs whose larger side is n
        least = max(1, -(-min_tiles // n))
        for w in range(least, min(n - 1, max_tiles // n) + 1):
            found.add((w, n))
        for h in range(least, min(n, max_tiles // n) + 1):
            found.add((n, h))
    return tuple(sorted(found, key=lambda r: r[0] * r[1]))


def closest_ratio(
    aspect: float, ratios: tuple[tuple[int, int], ...], area: int, tile: int
) -> tuple[int, int]:
    """transformers' find_closest_aspect_ratio: (w, h) tiles."""
    best_diff, best = float("inf"), (1, 1)
    for ratio in ratios:
        diff = abs(aspect - ratio[0] / ratio[1])
        if diff < best_diff:
            best_diff, best = diff, ratio
        elif diff == best_diff and area > 0.5 * tile * tile * ratio[0] * ratio[1]:
            best = ratio
    return best


def smart_size(height: int, width: int, s: dict[str, Any]) -> tuple[int, int]:
    """(h, w) of the one view or the thumbnail, multiples of u (transformers' smart_resize)."""
    u = int(s["encoder_patch_size"]) * int(s["downsample_factor"])
    lo, hi = int(s["min_image_tokens"]) * u * u, int(s["max_image_tokens"]) * u * u
    h, w = max(u, round(height / u) * u), max(u, round(width / u) * u)
    if h * w > hi:
        beta = math.sqrt(height * width / hi)
        h = max(u, math.floor(height / beta / u) * u)
        w = max(u, math.floor(width / beta / u) * u)
    elif h * w < lo:
        beta = math.sqrt(lo / (height * width))
        h, w = math.ceil(height * beta / u) * u, math.ceil(width * beta / u) * u
    return h, w


def tile_grid(height: int, width: int, s: dict[str, Any]) -> tuple[int, int] | None:
    """(rows, cols) of tiles where the image is split, else None."""
    p = int(s["encoder_patch_size"])
    u = p * int(s["downsample_factor"])
    lo, hi = (int(s["min_tiles"]), int(s["max_tiles"])) if s["do_image_splitting"] else (1, 1)
    h, w = max(p, round(height / u) * u), max(p, round(width / u) * u)
    large = h * w > int(s["max_image_tokens"]) * u * u * s["max_pixels_tolerance"]
    if not large or lo == hi == 1:
        return None
    tile = int(s["tile_size"])
    cols, rows = closest_ratio(width / height, target_ratios(lo, hi), height * width, tile)
    return rows, cols


def _patches(x: torch.Tensor, p: int) -> torch.Tensor:  # [3, H, W] float -> [h * w, p * p * 3]
    c, height, width = x.shape
    x = x.view(c, height // p, p, width // p, p).permute(1, 3, 2, 4, 0)
    return x.reshape((height // p) * (width // p), p * p * c)


class Lfm2VlTorchProcessor(TorchImageProcessor):
    """Lfm2VlImageProcessor (LFM2-VL; see the module). `config` (the model's, where given):
    its patch size and downsample factor the only ones the settings may name."""

    name = "Lfm2VlImageProcessor"
    defaults: ClassVar[dict[str, Any]] = {  # its class attributes
        "downsample_factor": 2,
        "do_image_splitting": True,
        "min_tiles": 2,
        "max_tiles": 10,
        "use_thumbnail": True,
        "min_image_tokens": 64,
        "max_image_tokens": 256,
        "encoder_patch_size": 16,
        "tile_size": 512,
        "max_pixels_tolerance": 2.0,
        "do_resize": True,
        "size": {"height": 512, "width": 512},
        "resample": 2,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_pad": True,
        "return_row_col_info": False,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    valid_kwargs = _Lfm2VlKwargs

    def check(self, s: dict[str, Any]) -> None:
        """What the model would not read: a patch size or downsample factor unlike the
        model's, tiles not whole blocks of u, a 1 x 1 tile grid (the tile alone, no
        thumbnail: not the run Lfm2VlProcessor counts)."""
        super().check(s)
        patch, factor = int(s["encoder_patch_size"]), int(s["downsample_factor"])
        if self.config is not None:
            want = (int(self.config.vision_config.patch_size), int(self.config.downsample_factor))
            if (patch, factor) != want:
                raise ValueError(
                    f"{self.name}'s encoder_patch_size={patch} / downsample_factor={factor} "
                    f"differ from the model's {want}"
                )
        if patch < 1 or factor < 1 or int(s["tile_size"]) % (patch * factor):
            raise ValueError(
                f"{self.name}'s tile_size={s['tile_size']} is not a multiple of "
                f"encoder_patch_size * downsample_factor ({patch * factor})"
            )
        if s["do_image_splitting"] and not 2 <= int(s["min_tiles"]) <= int(s["max_tiles"]):
            raise ValueError(
                f"{self.name}'s min_tiles={s['min_tiles']}, max_tiles={s['max_tiles']}: "
                "2 <= min_tiles <= max_tiles with do_image_splitting"
            )

    def _views(self, x: torch.Tensor, s: dict[str, Any]) -> tuple[list[torch.Tensor], int, int]:
        """One uint8 image -> its views (tiles row-major, then the thumbnail), rows, cols."""
        height, width = x.shape[-2:]
        size = smart_size(height, width, s)
        grid = tile_grid(height, width, s)
        if grid is None:
            return [resize(x, size, s["resample"])], 1, 1
        rows, cols = grid
        t = int(s["tile_size"])
        big = resize(x, (rows * t, cols * t), s["resample"])
        views = list(big.view(3, rows, t, cols, t).permute(1, 3, 0, 2, 4).reshape(-1, 3, t, t))
        if s["use_thumbnail"] and rows * cols != 1:
            views.append(resize(x, size, s["resample"]))
        return views, rows, cols

    def preprocess(self, images: list[torch.Tensor], s: dict[str, Any]) -> dict[str, Any]:
        p, f = int(s["encoder_patch_size"]), int(s["downsample_factor"])
        longest = int(s["max_image_tokens"]) * f * f
        if s["do_image_splitting"]:
            longest = max(longest, (int(s["tile_size"]) // p) ** 2)
        per_image, grids, rows, cols, sizes = [], [], [], [], []
        for x in images:
            views, r, c = self._views(x, s)
            patches = [_patches(normalize(v, s), p) for v in views]
            per_image.append(patches)
            grids += [(v.shape[-2] // p, v.shape[-1] // p) for v in views]
            rows.append(r)
            cols.append(c)
            sizes.append(list(smart_size(*x.shape[-2:], s)))
        out: dict[str, Any] = {}
        if s["do_pad"]:
            flat = [v for views in per_image for v in views]
            longest = max(longest, *(len(v) for v in flat))
            out["pixel_values"] = torch.stack([F.pad(v, (0, 0, 0, longest - len(v))) for v in flat])
            mask = torch.zeros(len(flat), longest, dtype=torch.int32)
            for i, v in enumerate(flat):
                mask[i, : len(v)] = 1
            out["pixel_attention_mask"] = mask
            out["spatial_shapes"] = torch.tensor(grids)
        else:  # transformers stacks each image's views as they are (one size each, or it fails)
            out["pixel_values"] = torch.cat([torch.stack(views) for views in per_image])
        if s["return_row_col_info"]:
            out["image_rows"], out["image_cols"] = torch.tensor(rows), torch.tensor(cols)
            out["image_sizes"] = torch.tensor(sizes)
        return out


def _refuse(name: str, what: str, value: Any) -> ValueError:
    return ValueError(f"mm_processor_kwargs[{name!r}] {what}, got {value!r}")


def check_kwargs(kwargs: dict[str, Any], settings: dict[str, Any], config: Any) -> None:
    """ValueError naming mm_processor_kwargs and the key for a request's `kwargs` (over the
    checkpoint's `settings`) that transformers' processor (or ours) would run past the budget
    or into views the model does not read: flags not bools (do_pad and return_row_col_info
    must stay True: the layout reads spatial_shapes and the tile grid); counts not ints > 0;
    encoder_patch_size / downsample_factor unlike the model's; tile_size not a multiple of
    their product u; max_pixels_tolerance not a finite float > 0; min_image_tokens over
    max_image_tokens, whose max_image_tokens * u^2 pixels pass kwargs_budget.MOST_PIXELS;
    with splitting, not 2 <= min_tiles <= max_tiles <= MOST_TILES (transformers' cubic ratio
    search stays cheap under it) or max_tiles tiles of tile_size^2 past MOST_PIXELS."""
    if not kwargs:
        return
    for name in _FLAGS:
        if name in kwargs and not isinstance(kwargs[name], bool):
            raise _refuse(name, "must be a bool", kwargs[name])
    for name in ("do_pad", "return_row_col_info"):
        if kwargs.get(name) is False:
            raise _refuse(name, "must be True (the image's views are read by their grids)", False)
    for name in _COUNTS:
        value = kwargs.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _refuse(name, "must be an int > 0", value)
    model = {"encoder_patch_size": int(config.vision_config.patch_size)}
    model["downsample_factor"] = int(config.downsample_factor)
    for name, want in model.items():
        if name in kwargs and kwargs[name] != want:
            raise _refuse(name, f"must be the model's {want}", kwargs[name])
    unit = model["encoder_patch_size"] * model["downsample_factor"]
    tolerance = kwargs.get("max_pixels_tolerance", 1.0)  # a float, as transformers checks
    if not isinstance(tolerance, float) or not math.isfinite(tolerance) or tolerance <= 0:
        raise _refuse("max_pixels_tolerance", "must be a finite float > 0", tolerance)
    s = {**settings, **kwargs}
    if "tile_size" in kwargs and kwargs["tile_size"] % unit:
        what = f"must be a multiple of encoder_patch_size * downsample_factor ({unit})"
        raise _refuse("tile_size", what, kwargs["tile_size"])
    tokens = [k for k in ("min_image_tokens", "max_image_tokens") if k in kwargs]
    if tokens and int(s["min_image_tokens"]) > int(s["max_image_tokens"]):
        what = f"exceeds max_image_tokens ({s['max_image_tokens']})"
        if "min_image_tokens" not in kwargs:
            what = f"is under min_image_tokens ({s['min_image_tokens']})"
        raise _refuse(tokens[0], what, kwargs[tokens[0]])
    if tokens and int(s["max_image_tokens"]) * unit * unit > MOST_PIXELS:
        name = "max_image_tokens" if "max_image_tokens" in kwargs else tokens[0]
        what = f"makes views of {int(s['max_image_tokens']) * unit * unit} pixels"
        raise _refuse(name, f"{what}, over the {MOST_PIXELS} an image may take", kwargs[name])
    tiles = [k for k in _TILE_KNOBS if k in kwargs]
    if not tiles or not s["do_image_splitting"]:
        return
    low, high = int(s["min_tiles"]), int(s["max_tiles"])
    if not 2 <= low <= high <= MOST_TILES:
        bad = "max_tiles" if high > MOST_TILES else "min_tiles"
        name = next(k for k in (bad, "min_tiles", "max_tiles", *tiles) if k in kwargs)
        what = f"with splitting needs 2 <= min_tiles ({low}) <= max_tiles ({high}) <= {MOST_TILES}"
        raise _refuse(name, what, kwargs[name])
    side = int(s["tile_size"])
    if high * side * side > MOST_PIXELS:
        name = "tile_size" if "tile_size" in kwargs else tiles[-1]
        what = f"makes {high} tiles of {side} x {side}, over the {MOST_PIXELS} pixels allowed"
        raise _refuse(name, what, kwargs[name])
