"""Nemotron Nano VL v2's images (`NemotronH_Nano_VL_V2`, remote code: config read by
models/nemotron_nano_vl_config.py): InternVL-style tiles through Nemotron-H Omni's C-RADIO tower,
pixel shuffle and relu^2 projector (multimodal/nemotron_h_omni.py: the same maths), into the
Nemotron-H decoder (models/text_wrappers.py's row). As vLLM's nano_nemotron_vl.py and
processors/nano_nemotron_vl.py run the release:

    tiles: the grid (cols x rows, min 1 .. max_num_tiles tiles) whose ratio is closest to the
        image's, a tie to the later (larger) one only where the image's area passes half the
        grid's pixels (InternVL's rule); RGB uint8 -> bicubic resize with antialias to the
        grid's pixels (torch on uint8: rounded, clamped) -> / 255 -> cut into S x S tiles
        (S = force_image_size) row-major; after more than one tile (use_thumbnail) the whole
        image resized to S x S the same way; (x - norm_mean) / norm_std
    each tile: S/p x S/p patches -> the tower (CPE table resized to the grid, prefix tokens
        dropped; no final norm; layer scale 1: vLLM never reads ls1 / ls2) -> pixel shuffle
        (v2) -> mlp1: S^2 / (4 p^2) rows a tile, the tiles' rows in order
    prompt: each "<image>" (img_context_token, also the placeholder) becomes <img>, a run of
        tiles x S^2 / (4 p^2) "<image>", </img>

Pixels [tiles, 3, S, S], size (tiles,). Videos are not run (refused: no video path here).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, TypedDict

import torch
import torch.nn.functional as F

from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import (
    token_ids,
)
from paged_engine.multimodal.layouts_single_run import BoundedLayout
from paged_engine.multimodal.nemotron_h_omni import NemotronOmniImageEncoder
from paged_engine.multimodal.torch_processors import TorchImageProcessor

_BLOCKS = "vision_model.radio_model.model.blocks."


def tile_grid(width: int, height: int, side: int, low: int, high: int) -> tuple[int, int]:
    """(cols, rows) of the tiles: InternVL's closest-ratio search over low..high tiles."""
    ratios = sorted(
        {
            (c, r)
            for n in range(low, high + 1)
            for c in range(1, n + 1)
            for r in range(1, n + 1)
            if low <= c * r <= high
        },
        key=lambda x: x[0] * x[1],
    )
    aspect, best, pick = width / height, float("inf"), (1, 1)
    for c, r in ratios:
        diff = abs(aspect - c / r)
        if diff < best:
            best, pick = diff, (c, r)
        elif diff == best and width * height > 0.5 * side * side * c * r:
            pick = (c, r)
    return pick


def _resize(image: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """uint8 [3, H, W] -> float [3, h, w] in [0, 1] (vLLM's resize: torch bicubic on uint8)."""
    out = F.interpolate(
        image[None], size=(h, w), mode="bicubic", align_corners=False, antialias=True
    )
    return out[0].float() / 255.0


class _TileKwargs(TypedDict, total=False):
    max_num_tiles: int


class NanoNemotronVLTiler(TorchImageProcessor):
    """The release's tiling (the module doc's steps): pixel_values [tiles, 3, S, S]."""

    name = "NanoNemotronVLProcessor"
    defaults: ClassVar[dict[str, Any]] = {"max_num_tiles": 12}
    valid_kwargs = _TileKwargs

    def check(self, s: dict[str, Any]) -> None:
        n = s.get("max_num_tiles")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"mm_processor_kwargs max_num_tiles={n!r} is not a positive int")

    def preprocess(self, images: list[torch.Tensor], s: dict[str, Any]) -> dict[str, Any]:
        c = self.config
        side, most = int(c.force_image_size), s["max_num_tiles"]
        mean = torch.tensor(c.norm_mean).view(1, 3, 1, 1)
        std = torch.tensor(c.norm_std).view(1, 3, 1, 1)
        out = [(self.tiles(image, side, most) - mean) / std for image in images]
        return {"pixel_values": torch.cat(out)}  # every image's tiles, as InternVL's

    def tiles(self, image: torch.Tensor, side: int, most: int) -> torch.Tensor:
        """RGB uint8 [3, H, W] -> [tiles, 3, side, side] float32 in [0, 1], the thumbnail last."""
        cols, rows = tile_grid(image.shape[2], image.shape[1], side, 1, most)
        whole = _resize(image, rows * side, cols * side)
        tiles = whole.view(3, rows, side, cols, side).permute(1, 3, 0, 2, 4)
        tiles = tiles.reshape(rows * cols, 3, side, side)
        if self.config.use_thumbnail and rows * cols > 1:
            tiles = torch.cat([tiles, _resize(image, side, side)[None]])
        return tiles


class NanoNemotronVLLayout(BoundedLayout):
    """InternVL's bounded tiles (layouts_single_run.BoundedLayout): <img>, tiles x (S / 2p)^2
    placeholders, </img>; pixels [tiles, 3, S, S] from the release's tiler; no features input."""

    takes_embeds = False
    refused_kwargs: ClassVar[dict[str, str]] = {}
    run_kwargs: ClassVar[dict[str, Any]] = {}

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        self.config = config
        self.placeholder = placeholder
        self.fixed = None
        self.side = int(config.force_image_size)
        grid = self.side // int(config.vision_config.patch_size)
        self.tile_rows = (grid // 2) ** 2
        self.bounds = token_ids(tokenizer, "<img>", "</img>")

    def image_processor(self) -> NanoNemotronVLTiler:
        return NanoNemotronVLTiler({"max_num_tiles": int(self.config.max_num_tiles)}, self.config)

    def _tile_side(self) -> int:
        return self.side


class NanoNemotronVLImageEncoder(NemotronOmniImageEncoder):
    """Nemotron-H Omni's tower and projector run tile by tile; no vision final norm."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.final_norm = None  # vLLM's nano_nemotron_vl has none, whatever the LLM's MTP
        self.patch = int(config.vision_config.patch_size)

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        weight = self.radio.patch_generator.embedder.weight
        p, out = self.patch, []
        for m in images:
            assert m.pixel_values is not None
            tiles = m.pixel_values.to(weight.device, weight.dtype)  # [T, 3, S, S]
            t, _, s, _ = tiles.shape
            g = s // p
            # [T, 3, g, p, g, p] -> [T, g * g, 3 p p]: row-major patches, each channel-major
            patches = tiles.view(t, 3, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(t, g * g, -1)
            out.append(torch.cat([self(x, g, g) for x in patches]))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The release's tower (`vision_model.radio_model.model.*`) and `mlp1.*`; its ls1 / ls2
        (if any) passed over and the layer scales set to 1, as vLLM runs them."""

        def kept() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                scale = (".ls1", ".ls2", ".layer_scale")
                if name.startswith(_BLOCKS) and any(k in name for k in scale):
                    continue
                yield name, tensor
            ones = torch.ones(self.radio.patch_generator.embedder.weight.shape[0])
            for i in range(len(self.radio.blocks)):
                for k in (1, 2):
                    yield f"{_BLOCKS}{i}.layer_scale{k}.lambda1", ones

        return super().load_weights(kept())
