"""H2OVL-Mississippi (`H2OVLChatModel`, the Hub's remote code: modeling_h2ovl_chat.py,
image_process.py; vLLM's h2ovl.py): the remote InternVL-Chat model (multimodal/internvl_chat.py
reads its config.json and weights: the same InternViT tower, v2 pixel shuffle, mlp1 projector,
<img> run of <IMG_CONTEXT> </img> prompt) with one difference, its multi-scale adaptive
cropping (`use_msac`), which applies when the prompt holds exactly one image:

    pass 1: InternVL's tiling over the grids (i, j) with 1 <= i j <= max_dynamic_patch (the
        closest aspect ratio, ties to the later grid where the image's area exceeds half the
        grid's pixels), tiles row-major, the whole image as a thumbnail after more than one
    pass 2: the same over the grids with 3 <= i j <= max_dynamic_patch whose sides both fail
        to divide pass 1's (prior_i % i != 0 and prior_j % j != 0); none left: (1, 1)
    tiles: pass 2's tiles, pass 1's (its last view dropped: its thumbnail, or its one tile),
        pass 2's last view (the thumbnail; its one tile where it had one)
    -> n2 + n1 - 1 tiles, each a run of the tower's tokens inside one <img> ... </img>

Each tile is a PIL bicubic resize and crop (Image.resize's default), then GotOcr2's rescale and
ImageNet normalization, as the InternVL-Chat path runs them. Two or more images in a prompt, or
use_msac false, take InternVL-Chat's tiling unchanged (by_count: the processor cache keys the
image count). Refused by name: mm_processor_kwargs that change the tiling (InternVL-Chat's
refusals), a decoder whose llm_config text_wrappers' row does not name.
"""

from __future__ import annotations

from typing import Any

from paged_engine.multimodal.inputs import to_rgb
from paged_engine.multimodal.internvl_chat import InternVLChatLayout
from paged_engine.multimodal.layouts import Loaded, Run, _shape_error, _side

ARCH = "H2OVLChatModel"


def target_ratios(low: int, high: int) -> list[tuple[int, int]]:
    """The grids (i, j) with low <= i j <= high, by tile count (the remote set's order kept
    among equal counts, as its sort is stable over the same set)."""
    grids = {
        (i, j)
        for n in range(low, high + 1)
        for i in range(1, n + 1)
        for j in range(1, n + 1)
        if low <= i * j <= high
    }
    return sorted(grids, key=lambda g: g[0] * g[1])


def closest_ratio(
    width: int, height: int, grids: list[tuple[int, int]], side: int
) -> tuple[int, int]:
    """InternVL's find_closest_aspect_ratio: (1, 1) when `grids` is empty."""
    aspect, best, best_diff = width / height, (1, 1), float("inf")
    for grid in grids:
        diff = abs(aspect - grid[0] / grid[1])
        if diff < best_diff:
            best_diff, best = diff, grid
        elif diff == best_diff and width * height > 0.5 * side * side * grid[0] * grid[1]:
            best = grid
    return best


def tile(image: Any, grids: list[tuple[int, int]], side: int) -> tuple[list[Any], tuple[int, int]]:
    """(the views: grid tiles row-major, the thumbnail after more than one; the grid)."""
    grid = closest_ratio(*image.size, grids, side)
    resized = image.resize((side * grid[0], side * grid[1]))
    views = [
        resized.crop((c * side, r * side, (c + 1) * side, (r + 1) * side))
        for r in range(grid[1])
        for c in range(grid[0])
    ]
    if len(views) > 1:
        views.append(image.resize((side, side)))
    return views, grid


def msac_views(image: Any, most: int, side: int) -> list[Any]:
    """The two passes' views in the remote order (see the module doc)."""
    first, prior = tile(image, target_ratios(1, most), side)
    second_grids = [
        g for g in target_ratios(3, most) if prior[0] % g[0] != 0 and prior[1] % g[1] != 0
    ]
    second, _ = tile(image, second_grids, side)
    return second[:-1] + first[:-1] + second[-1:]


class H2OVLLayout(InternVLChatLayout):
    """InternVL-Chat's tiles and <img> run </img>; one image alone tiled by MSAC."""

    by_count = True

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        config = self.config
        if count != 1 or not getattr(config, "use_msac", False) or not config.dynamic_image_size:
            return super().load(run, image, count)
        side = _side(config)
        views = msac_views(to_rgb(image), config.max_dynamic_patch, side)
        tiles = run(views, crop_to_patches=False)["pixel_values"].float()
        want = (len(views), 3, side, side)
        if tuple(tiles.shape) != want:
            raise _shape_error(tiles, want)
        return tiles, (tiles.shape[0],)
