"""Aya Vision and Command A Vision's image path (AyaVisionForConditionalGeneration,
Cohere2VisionForConditionalGeneration): GotOcr2-style tiles, a SigLIP tower, pixel shuffle and
a SwiGLU projector into a Cohere / Cohere 2 decoder.

    image -> the checkpoint's image processor (crop_to_patches, as both HF processors ask):
        cols x rows tiles of S x S chosen by the image's aspect ratio, then (for more than one)
        the whole image squeezed to S x S; pixels [T, 3, S, S]
    each tile -> SigLIP tower (vision_transformer.py)
        Aya Vision: hidden_states[vision_feature_layer] (no post_layernorm; "full": every patch)
        Command A Vision: last_hidden_state (every layer, then post_layernorm)
        -> pixel shuffle by downsample_factor f: each f x f block of patches one row of f^2 * D
        -> projector: [LayerNorm (Aya Vision only, eps adapter_layer_norm_eps)] -> linear_1
           -> (x, gate) halves -> silu(gate) * x -> linear_2
        -> n = (S / patch / f)^2 rows a tile
    prompt (HF's processors; the user's image token becomes):
        Aya Vision: "<image>" in the text ->
            <|START_OF_IMG|> TILE_1 <|IMG_PATCH|> x n ... TILE_{T-1} <|IMG_PATCH|> x n
            TILE_GLOBAL <|IMG_PATCH|> x n <|END_OF_IMG|>        (one tile: TILE_GLOBAL alone)
        Command A Vision: the tokenizer's image token (= image_token_id) ->
            <|START_OF_IMG|> (<|IMG_PATCH|> x n <|IMG_LINE_BREAK|>) x T <|END_OF_IMG|>

Each tile is one `ImageInput` (its own run of n placeholders, its own hash), as Idefics3's.
Command A Vision's image processor (Cohere2VisionImageProcessor) is torchvision-only in
transformers: without torchvision `Cohere2VisionTorchProcessor` here runs its steps (canvas:
transformers' get_optimal_tiled_canvas, the columns x rows grid of at most max_patches tiles
needing the least upscaling, else the least downscaling; the image resized onto it bicubic with
antialias, distorting; tiles row-major, the whole image last; CLIP normalization in float32).
Refused by name: Aya Vision's vision_feature_select_strategy "default" (it drops a patch, and
HF's square pixel shuffle then fails) and a list vision_feature_layer (HF's layernorm then
gets a wider input than it was built for); a tower other than SigLIP; a downsample_factor
that does not divide the tower's patch grid.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.internvl import feature_layer
from paged_engine.multimodal.torch_processors import (
    ProcessorKwargs,
    TorchImageProcessor,
    normalize,
    resize,
    square_size,
)
from paged_engine.multimodal.vision_transformer import (
    FinalNormTower,
    VisionTransformer,
    pixel_shuffle,
)

AYA_VISION = "AyaVisionForConditionalGeneration"
COHERE2_VISION = "Cohere2VisionForConditionalGeneration"
ARCHS = (AYA_VISION, COHERE2_VISION)
# HF's processors' token texts (AyaVisionProcessor's defaults, Command A's tokenizer's)
START, END, PATCH = "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>"
LINE_BREAK, TILE, TILE_GLOBAL = "<|IMG_LINE_BREAK|>", "TILE", "TILE_GLOBAL"
MARKER = "<image>"  # what an Aya Vision prompt writes for an image (AyaVisionProcessor's)
_TOWER = "vision_tower.vision_model."
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]  # transformers' OPENAI_CLIP_MEAN / _STD
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def is_cohere2(config: Any) -> bool:
    return COHERE2_VISION in (getattr(config, "architectures", None) or [])


def tile_tokens(config: Any) -> int:
    """n: placeholders (= feature rows) of one tile."""
    vision, scale = config.vision_config, int(config.downsample_factor)
    side = int(vision.image_size) // int(vision.patch_size)
    if scale <= 0 or side % scale:
        raise ValueError(
            f"downsample_factor={scale} does not divide the tower's {side} patches a side"
        )
    return (side // scale) ** 2


def aya_prompt(tiles: int, n: int) -> str:
    """The text Aya Vision's "<image>" becomes for an image of `tiles` tiles (the last the
    whole image), as AyaVisionProcessor writes it."""
    body = "".join(f"{TILE}_{i}{PATCH * n}" for i in range(1, tiles))
    return f"{START}{body}{TILE_GLOBAL}{PATCH * n}{END}"


class Projector(nn.Module):
    """Pixel shuffle, Aya Vision's LayerNorm, then the SwiGLU (gate: linear_1's second half)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.scale = int(config.downsample_factor)
        width = int(config.vision_config.hidden_size) * self.scale**2
        text = int(config.text_config.hidden_size)
        inner = int(getattr(config, "alignment_intermediate_size", text))
        if inner % 2:
            raise ValueError(f"alignment_intermediate_size={inner} is not even (SwiGLU halves)")
        eps = getattr(config, "adapter_layer_norm_eps", None)
        # Command A Vision's projector has no LayerNorm
        self.layernorm = None if is_cohere2(config) else nn.LayerNorm(width, eps=float(eps))
        self.linear_1 = nn.Linear(width, inner)
        self.linear_2 = nn.Linear(inner // 2, text)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, side^2, Dv] -> [T, n, Dt]
        x = pixel_shuffle(x, self.scale)
        if self.layernorm is not None:
            x = self.layernorm(x)
        x, gate = self.linear_1(x).chunk(2, dim=-1)
        return self.linear_2(F.silu(gate) * x)


class _VisionTower(nn.Module):  # the checkpoint's `vision_tower.vision_model` nesting
    def __init__(self, vision: Any, layer: int | None) -> None:
        super().__init__()
        # layer None: last_hidden_state (Command A Vision); else hidden_states[layer]
        self.layer = layer
        self.vision_model: VisionTransformer = (
            FinalNormTower(vision) if layer is None else VisionTransformer(vision, layer)
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        if self.layer is None:
            assert isinstance(self.vision_model, FinalNormTower)
            return self.vision_model.last(pixels)
        return self.vision_model(pixels, [self.layer])[0]


class AyaVisionImageEncoder(nn.Module):
    """Tiles -> rows of the text model's input embedding, one per placeholder."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vision = config.vision_config
        model_type = getattr(vision, "model_type", None)
        if model_type != "siglip_vision_model":
            raise ValueError(
                f"vision_config.model_type={model_type!r} is not supported: 'siglip_vision_model'"
            )
        self.tile_tokens = tile_tokens(config)
        layer = None
        if not is_cohere2(config):
            strategy = config.vision_feature_select_strategy
            if strategy != "full":
                raise ValueError(
                    f"vision_feature_select_strategy={strategy!r} is not supported: 'full' (a "
                    "SigLIP tower has no CLS token to drop)"
                )
            layer = feature_layer(config)
        self.vision_tower = _VisionTower(vision, layer)
        self.multi_modal_projector = Projector(config)

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:  # [T, 3, S, S] -> [T, n, D]
        return self.multi_modal_projector(self.vision_tower(tiles))

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        weight = self.multi_modal_projector.linear_1.weight
        pixels = torch.stack([m.pixel_values for m in images])  # type: ignore[misc]
        return list(self(pixels.to(weight.device, weight.dtype)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `[model.]vision_tower[.vision_model].*` and
        `[model.]multi_modal_projector.*` tensors (the pooling head, an unread post_layernorm,
        layers after the one read and any other name are passed over); ValueError naming a
        missing or unexpected one."""
        final_norm = self.vision_tower.layer is None
        built = len(self.vision_tower.vision_model.encoder.layers)

        def ours(name: str) -> str | None:
            name = name.removeprefix("model.")
            if name.startswith("vision_tower.") and not name.startswith(_TOWER):
                name = _TOWER + name.removeprefix("vision_tower.")  # transformers 5's saves
            inner = name.removeprefix(_TOWER)
            if name.startswith(_TOWER) and (
                inner.startswith("head.")
                or (inner.startswith("post_layernorm.") and not final_norm)
                or (inner.startswith("encoder.layers.") and int(inner.split(".")[2]) >= built)
            ):
                return None
            return name if name.startswith((_TOWER, "multi_modal_projector.")) else None

        picked = ((n, t) for n, t in ((ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self, picked)


class _Cohere2Kwargs(ProcessorKwargs, total=False):
    size: dict[str, int]
    crop_to_patches: bool
    min_patches: int
    max_patches: int


def cohere2_grid(size: tuple[int, int], side: int, max_tiles: int) -> tuple[int, int]:
    """transformers' get_optimal_tiled_canvas: (columns, rows) of S x S tiles, the canvas that
    needs the least upscaling, else the least downscaling (min_patches plays no part)."""
    sides = range(1, max_tiles + 1)
    grids = sorted(
        ((w, h) for w in sides for h in sides if w * h <= max_tiles), key=lambda g: g[0] * g[1]
    )
    scales = (np.array(grids) * side / np.stack([size[1], size[0]])).min(-1, keepdims=True)
    if np.all(scales < 1):
        return grids[int(np.argmax(scales))]
    return grids[int(np.argmin(np.where(scales < 1.0, 10e9, scales)))]


class Cohere2VisionTorchProcessor(TorchImageProcessor):
    """Cohere2VisionImageProcessor (Command A Vision): with crop_to_patches, each image resized
    (bicubic, distorting) onto its columns x rows canvas of S x S tiles, cut row-major, then
    with more than one tile the whole image resized to S x S last; without, the image resized
    to S x S. Normalized in float32. Out: pixel_values [tiles, 3, S, S], num_patches."""

    name = "Cohere2VisionImageProcessor"
    defaults: ClassVar[dict[str, Any]] = {
        "do_resize": True,
        "size": {"height": 512, "width": 512},
        "resample": 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": _CLIP_MEAN,
        "image_std": _CLIP_STD,
        "do_convert_rgb": True,
        "crop_to_patches": True,
        "min_patches": 1,
        "max_patches": 12,
    }
    valid_kwargs = _Cohere2Kwargs

    def check(self, s: dict[str, Any]) -> None:
        super().check(s)
        square_size(s, self.name)
        if not s["do_resize"] and not s["crop_to_patches"]:
            raise ValueError(f"{self.name}'s do_resize=False without crop_to_patches: unsized")

    def preprocess(self, images: list[torch.Tensor], s: dict[str, Any]) -> dict[str, Any]:
        side = square_size(s, self.name)
        out, counts = [], []
        for x in images:
            if s["crop_to_patches"]:
                cols, rows = cohere2_grid(tuple(x.shape[-2:]), side, int(s["max_patches"]))
                canvas = resize(x, (rows * side, cols * side), s["resample"])
                grid = canvas.view(3, rows, side, cols, side).permute(1, 3, 0, 2, 4)
                views = list(grid.reshape(rows * cols, 3, side, side).unbind(0))
                if len(views) > 1:
                    views.append(resize(x, (side, side), s["resample"]))
            else:
                views = [x]
            if s["do_resize"]:  # (tiles are S x S already: as they are)
                views = [resize(v, (side, side), s["resample"]) for v in views]
            out += [normalize(v, s) for v in views]
            counts.append(len(views))
        return {"pixel_values": torch.stack(out), "num_patches": torch.tensor(counts)}
