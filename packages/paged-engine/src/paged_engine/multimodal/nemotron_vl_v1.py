"""Llama Nemotron Nano VL v1's images (`Llama_Nemotron_Nano_VL`, remote code: config read by
models/nemotron_vl_v1_config.py): Nano VL v2's tiles and C-RADIO tower
(multimodal/nemotron_nano_vl.py, nemotron_h_omni.py) with v1's own tile rule, PIL resizes, the
timm ViT's final norm and InternVL's GELU projector, into Llama (models/text_wrappers.py's
row). As vLLM's nemotron_vl.py (LlamaNemotronVLChatModel, NemotronVLProcessor) runs it:

    tiles: over the grids of 1 .. max_num_tiles tiles (sorted by tile count), the first with
        the largest min(tiles x S^2 / image area, 0.6) x min(r / a, a / r) (r the grid's
        ratio, a the image's); RGB -> PIL bicubic resize to the grid's pixels -> cut into
        S x S tiles row-major; after more than one tile (use_thumbnail) the whole image PIL
        bicubic resized to S x S; / 255 -> (x - norm_mean) / norm_std (the tower's input
        conditioner, CLIP's by default)
    each tile: S/p x S/p patches -> the tower (CPE table resized to the grid, prefix tokens
        dropped; the timm ViT's final LayerNorm unless vision_config.args.gp pools; layer
        scales as the checkpoint's ls1 / ls2 gammas, 1 where it has none) -> pixel shuffle
        (v2) -> mlp1: LayerNorm -> Linear -> GELU -> Linear (biases): S^2 / (4 p^2) rows
    prompt: each "<image>" (the placeholder, also each context token) becomes <img>, a run of
        tiles x S^2 / (4 p^2) "<image>", </img>

Pixels [tiles, 3, S, S], size (tiles,). Videos are not run (refused: no video path here).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from paged_engine.multimodal.nemotron_h_omni import NemotronOmniImageEncoder
from paged_engine.multimodal.nemotron_nano_vl import (
    NanoNemotronVLImageEncoder,
    NanoNemotronVLLayout,
    NanoNemotronVLTiler,
)

_TOWER = "vision_model.radio_model.model."
_UNUSED = (_TOWER + "fc_norm.", _TOWER + "head.")  # timm's pooled head: not in the features


def tile_grid(width: int, height: int, side: int, high: int) -> tuple[int, int]:
    """(cols, rows) of v1's tiles: the module doc's size x closeness rule, first best wins."""
    ratios = sorted(
        {
            (c, r)
            for n in range(1, high + 1)
            for c in range(1, n + 1)
            for r in range(1, n + 1)
            if c * r <= high
        },
        key=lambda x: x[0] * x[1],
    )  # the same set and stable sort as the release: ties go to the same grid
    aspect, area = width / height, width * height
    best, pick = float("-inf"), (1, 1)
    for c, r in ratios:
        score = min(c * r * side * side / area, 0.6) * min((c / r) / aspect, aspect / (c / r))
        if score > best:
            best, pick = score, (c, r)
    return pick


class NemotronVLV1Tiler(NanoNemotronVLTiler):
    """v1's tiling (the module doc's steps): pixel_values [tiles, 3, S, S]."""

    name = "NemotronVLProcessor"

    def tiles(self, image: torch.Tensor, side: int, most: int) -> torch.Tensor:
        """RGB uint8 [3, H, W] -> [tiles, 3, side, side] float32 in [0, 1] (PIL's resizes)."""
        from PIL import Image  # only where images arrive: the engine imports without Pillow

        pil = Image.fromarray(image.permute(1, 2, 0).contiguous().numpy())
        cols, rows = tile_grid(pil.width, pil.height, side, most)
        whole = pil.resize((cols * side, rows * side), Image.Resampling.BICUBIC)
        crops = [
            whole.crop((x * side, y * side, (x + 1) * side, (y + 1) * side))
            for y in range(rows)
            for x in range(cols)
        ]
        if self.config.use_thumbnail and len(crops) > 1:
            crops.append(pil.resize((side, side), Image.Resampling.BICUBIC))
        tiles = torch.from_numpy(np.stack([np.asarray(t) for t in crops]))
        return tiles.permute(0, 3, 1, 2).float() / 255.0


class NemotronVLV1Layout(NanoNemotronVLLayout):
    """Nano VL v2's layout (<img>, tiles x (S / 2p)^2 placeholders, </img>), v1's tiler."""

    def image_processor(self) -> NemotronVLV1Tiler:
        return NemotronVLV1Tiler({"max_num_tiles": int(self.config.max_num_tiles)}, self.config)


class _Projector(nn.Module):
    """`mlp1` as the Hub's Sequential: 0 LayerNorm, 1 Linear, 2 GELU, 3 Linear."""

    def __init__(self, width: int, hidden: int, out: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.LayerNorm(width), nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, out)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class NemotronVLV1ImageEncoder(NanoNemotronVLImageEncoder):
    """v2's tile-by-tile tower with the timm final norm and InternVL's GELU projector."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        vision = config.vision_config
        d = int(vision.hidden_size)
        self.final_norm = (
            nn.LayerNorm(d, eps=float(vision.layer_norm_eps)) if config.vision_final_norm else None
        )
        merged = d * round(1 / self.ratio) ** 2
        text = int(config.text_config.hidden_size)
        self.mlp1 = _Projector(merged, int(config.projector_hidden_size), text)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The release's tower (`vision_model.radio_model.model.*`: blocks' ls1 / ls2 gammas as
        the layer scales, else 1; `norm.*` as the final norm), `mlp1.*`; the rest passed over."""
        blocks = _TOWER + "blocks."
        width = self.radio.patch_generator.embedder.weight.shape[0]

        def renamed() -> Iterator[tuple[str, torch.Tensor]]:
            scaled: set[str] = set()
            for name, tensor in weights:
                if name.startswith(_UNUSED):
                    continue
                if name.startswith(blocks) and name.endswith((".ls1.gamma", ".ls2.gamma")):
                    block, key = name.removeprefix(blocks).split(".")[:2]
                    name = f"{blocks}{block}.layer_scale{key[-1]}.lambda1"
                    scaled.add(name)
                elif name.startswith(_TOWER + "norm."):
                    name = "vision_projector.vision_final_layernorm." + name.rsplit(".", 1)[1]
                yield name, tensor
            for i in range(len(self.radio.blocks)):
                for k in (1, 2):
                    name = f"{blocks}{i}.layer_scale{k}.lambda1"
                    if name not in scaled:
                        yield name, torch.ones(width)

        return NemotronOmniImageEncoder.load_weights(self, renamed())
