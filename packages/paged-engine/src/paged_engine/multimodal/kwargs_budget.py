"""The pixel and tile budget of an image's mm_processor_kwargs, checked before any pixel is made.

A request's mm_processor_kwargs (merged over the engine's) steer the checkpoint's image
processor: `size` / `crop_size` / `max_image_size` / LLaVA-NeXT's `image_grid_pinpoints` say how
large it resizes, `max_patches` / `max_image_tiles` / ... how many tiles it may cut. Left
unbounded, one request makes the processor resize a 40 x 50 image to 30000 x 30000 (10 GB of
float32) or list 10**9 candidate tilings, before any shape check can see it. `check_budget`
estimates, from the image's own size and the kwargs given, what the processor would make and
refuses by name (ValueError naming mm_processor_kwargs and the key) beyond:

    MOST_PIXELS    pixels one image may be resized to (2**25: 5792 x 5792, 2.6x Qwen2-VL's
                   default max_pixels); where the size is a pixel count (Qwen2-VL's
                   min_pixels / max_pixels) twice max_model_len tokens' worth instead: an
                   image whose tokens cannot fit max_model_len is refused anyway
                   (input_processor.py's "prompt is too long"), but only after its pixels
    MOST_TILES     tiles / crops / patches one image may be cut into (Molmo2's bound)

Only the knobs the engine or the request gave are checked (a checkpoint's own defaults are its
business). The estimates follow transformers' resizes: `height` x `width` exactly;
`shortest_edge` (capped by `longest_edge`) keeps the aspect ratio; `longest_edge` alone only
shrinks (Pixtral; Idefics3 grows the image up to it but caps it at 4096 itself); a
pixel-count size (processors with a `merge_size`: Qwen2-VL, GLM-4V, ...) is the image's area
clamped into [shortest_edge, longest_edge].
"""

from __future__ import annotations

import math
from typing import Any

MOST_PIXELS = 2**25
MOST_TILES = 1024
# knobs that count tiles / crops / patches per image (ints): at most MOST_TILES, and at most
# MOST_PIXELS pixels of tiles where the size is the tile's height x width (Llama 4, InternVL)
COUNT_KNOBS = (
    "min_patches",
    "max_patches",
    "min_image_tiles",
    "max_image_tiles",
    "max_tiles",
    "max_num_tiles",
    "max_dynamic_patch",
    "max_crops",
    "max_num_crops",
    "pan_and_scan_max_num_crops",
    "max_slice_nums",
)
# kind -> its knobs of those names that count something else (checked by the family if at all):
# Kimi K2.5's max_patches counts 14-pixel patches (16384) and only ever shrinks the image
NOT_COUNTS = {"kimi_k25": ("max_patches",)}
# (the image's size, its tiles' size, the processor's own cap on the first's longest edge):
# Idefics3 / SmolVLM split the image resized to `size` into max_image_size squares, the image's
# longest edge first capped at 4096 (transformers' MAX_IMAGE_SIZE)
TILE_KNOBS = (("size", "max_image_size", 4096),)


def _edges(size: Any) -> dict[str, int]:
    """A size dict's (or SizeDict's) set edges."""
    keys = ("height", "width", "shortest_edge", "longest_edge")
    get = size.get if isinstance(size, dict) else lambda k: getattr(size, k, None)
    return {k: get(k) for k in keys if get(k) is not None}


def _refuse(name: str, what: str) -> ValueError:
    return ValueError(f"mm_processor_kwargs[{name!r}]: {what}")


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise _refuse(name, f"sizes must be numbers > 0, got {value!r}")
    return float(value)


def resized_pixels(name: str, size: Any, image: tuple[int, int], as_pixels: bool) -> float:
    """The pixels the processor resizes a (width, height) `image` to under `size`."""
    edges = {k: _positive(name, v) for k, v in _edges(size).items()}
    w, h = max(image[0], 1), max(image[1], 1)
    if as_pixels and "shortest_edge" in edges and "longest_edge" in edges:
        return min(max(w * h, edges["shortest_edge"]), edges["longest_edge"])
    if "height" in edges and "width" in edges:
        return edges["height"] * edges["width"]
    scale = 1.0  # a longest_edge alone only shrinks (Pixtral; Idefics3 grows to its own cap)
    if "shortest_edge" in edges:
        scale = edges["shortest_edge"] / min(w, h)
    if "longest_edge" in edges:
        scale = min(scale, edges["longest_edge"] / max(w, h))
    return w * h * scale * scale


def check_budget(
    given: dict[str, Any],
    defaults: Any,
    image: tuple[int, int],
    pixels_per_token: int | None,
    max_model_len: int | None,
    size_name: str = "size",
    kind: str = "",
) -> None:
    """ValueError naming mm_processor_kwargs and the key where `given` (the engine's and the
    request's kwargs, as the processor takes them) would make a (width, height) `image` into
    more than the budget. `defaults`: the processor (its `size` where `given` has none);
    `pixels_per_token`: a pixel-count size's pixels per image token (None: sizes are edges);
    `size_name`: what the request called `size` (min_pixels / max_pixels become its edges);
    `kind`: the model's image kind (archs.image_kind), for NOT_COUNTS."""
    as_pixels = pixels_per_token is not None
    most = MOST_PIXELS
    if as_pixels and max_model_len is not None:  # (2x: the processor rounds each side up)
        most = 2 * max_model_len * pixels_per_token
    for name, value in given.items():
        if isinstance(value, dict) or type(value).__name__ == "SizeDict":
            got = resized_pixels(name, value, image, as_pixels and name == "size")
            if got > most:
                raise _refuse(
                    size_name if name == "size" else name,
                    f"{value!r} would resize this {image[0]} x {image[1]} image to "
                    f"~{got:.3g} pixels, over the {most} an image may take",
                )
        elif name == "image_grid_pinpoints" and isinstance(value, (list, tuple)):
            for pair in value:  # LLaVA-NeXT: the image is resized onto one of these canvases
                if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                    raise _refuse(name, f"must be [height, width] pairs, got {pair!r}")
                area = _positive(name, pair[0]) * _positive(name, pair[1])
                if area > most:
                    raise _refuse(name, f"{list(pair)} is over the {most} pixels an image may take")
    for name in COUNT_KNOBS:
        if name not in given or name in NOT_COUNTS.get(kind, ()):
            continue
        count = given[name]
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MOST_TILES:
            raise _refuse(name, f"must be an int in [1, {MOST_TILES}], got {count!r}")
        edges = _edges(given.get("size") or getattr(defaults, "size", None) or {})
        tile = edges.get("height", 0) * edges.get("width", 0)
        if count * tile > most:
            raise _refuse(name, f"{count} tiles of {tile} pixels are over the {most} allowed")
    for whole, part, cap in TILE_KNOBS:
        if whole not in given and part not in given:
            continue
        big = _edges(given.get(whole) or getattr(defaults, whole, None) or {}).get("longest_edge")
        side = _edges(given.get(part) or getattr(defaults, part, None) or {}).get("longest_edge")
        if side is None:
            continue
        # Idefics3 resizes the image to multiples of the tile's side (unsplit: one such
        # square) before cutting it: max_image_size {"longest_edge": 10**6} made 2.7 GB
        tiles = 1 if big is None else math.ceil(min(big, cap) / _positive(part, side)) ** 2
        if part in given and tiles * _positive(part, side) ** 2 > most:
            raise _refuse(
                part,
                f"{given[part]!r} would make {tiles} tiles of {side} x {side} pixels, over "
                f"the {most} an image may take",
            )
        if tiles > MOST_TILES:
            name = part if part in given else whole
            raise _refuse(
                name,
                f"{given[name]!r} would cut an image into {tiles} tiles, over "
                f"the {MOST_TILES} allowed",
            )


def pixels_per_token(processor: Any) -> int | None:
    """A pixel-count size's pixels per image token ((patch x merge)**2: Qwen2-VL, GLM-4V,
    PaddleOCR-VL, ...), or None where the processor's sizes are edges."""
    size = _edges(getattr(processor, "size", None) or {})
    merge, patch = getattr(processor, "merge_size", 0), getattr(processor, "patch_size", 0)
    if not isinstance(merge, int) or not isinstance(patch, int) or merge < 1 or patch < 1:
        return None
    return (patch * merge) ** 2 if {"shortest_edge", "longest_edge"} <= set(size) else None
