"""LightOnOCR's image path (LightOnOcrForConditionalGeneration: a Pixtral tower, Mistral 3's
patch-merger projector, a Qwen3 decoder).

    image -> the checkpoint's Pixtral image processor: resized to fit longest_edge, sides
        rounded up to its patch_size -> pixels [3, H, W] (cropped to image_sizes)
        -> multimodal/pixtral.py's PixtralVisionTower, every layer (last_hidden_state)
        -> h x w patch grid, cropped to (h // m * m) x (w // m * m) (HF's unfold drops an odd
           last row / column; the tower still attended over it)
        -> vision_projection: RMSNorm(text rms_norm_eps) -> pixtral's patch merger
           -> linear_1 -> GELU (exact) -> linear_2, all bias-free
        -> per image [(h // m) * (w // m), text hidden_size], merged grid row-major
    prompt: LightOnOcrProcessor replaces each image token by a plain run of (H // u) * (W // u)
        image tokens, u = patch_size * spatial_merge_size: no [IMG_BREAK] / [IMG_END] lines as
        Mistral 3 has (its tokenizer names break / end tokens; the processor never writes them)
    text model: Qwen3 (models/text_wrappers.py)

vLLM serves it the same way (its lightonocr.py: Mistral 3's model, break / end tokens removed).
Weights: `[model.]vision_encoder.*` (HF's PixtralVisionModel names) and
`[model.]vision_projection.*`. Refused by name: a vision tower that is not Pixtral's, a
spatial_merge_size that is not a positive int, images smaller than one merged patch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.layers.norm import RMSNorm
from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import Layout, Loaded, Run, Size
from paged_engine.multimodal.pixtral import PixtralVisionTower, _PatchMerger, _positive_int

ARCH = "LightOnOcrForConditionalGeneration"
_OURS = ("vision_encoder.", "vision_projection.")


def merge_size(config: Any) -> int:
    return _positive_int(config, "spatial_merge_size", "")


def _check_tower(config: Any) -> None:
    kind = getattr(getattr(config, "vision_config", None), "model_type", None)
    if kind != "pixtral":
        raise ValueError(f"vision_config.model_type={kind!r} is not supported: 'pixtral'")


class LightOnOcrLayout(Layout):
    """A plain run of one image token per merged patch; pixels [3, H, W], size (H, W)."""

    takes_embeds = True  # features: a run of their rows

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        _check_tower(config)
        self.config = config
        self.placeholder = placeholder
        self.fixed = None
        self.patch = _positive_int(config.vision_config, "patch_size", "vision_config.")
        self.unit = self.patch * merge_size(config)

    def length(self, size: Size) -> int:
        if size is None or len(size) != 2 or min(size) < self.unit:
            raise ValueError(f"multi_modal_data['image']: image_size {size} is not its (h, w)")
        return (size[0] // self.unit) * (size[1] // self.unit)

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        assert size is not None and len(size) == 2
        return (3, size[0], size[1])

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image])  # the saved patch_size, as LightOnOcrProcessor passes none
        h, w = (int(v) for v in out["image_sizes"][0])
        if not (h % self.patch or w % self.patch) and min(h, w) < self.unit:  # 1 x 1, 1 x 300
            raise ValueError(
                f"multi_modal_data['image']: the image is too small or too thin: resized to "
                f"{h} x {w}, its sides must be at least one merged patch ({self.unit} pixels) "
                "to give it an image token"
            )
        if h % self.patch or w % self.patch:
            raise ValueError(
                f"multi_modal_data['image']: the image processor gave a {h} x {w} image: sides "
                f"must be multiples of patch_size {self.patch} (check the processor's patch_size)"
            )
        return out["pixel_values"][0][:, :h, :w].float().contiguous(), (h, w)


class _Projector(nn.Module):
    """vision_projection: Mistral 3's projector with GELU and no biases."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vision = _positive_int(config.vision_config, "hidden_size", "vision_config.")
        text = _positive_int(config.text_config, "hidden_size", "text_config.")
        self.norm = RMSNorm(vision, float(config.text_config.rms_norm_eps))
        self.patch_merger = _PatchMerger(vision, merge_size(config))
        self.linear_1 = nn.Linear(vision, text, bias=False)
        self.act = get_act_fn("gelu")
        self.linear_2 = nn.Linear(text, text, bias=False)

    def forward(self, x: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """x: [T, d] packed grids (multiples of m) -> [T / m**2, text hidden]."""
        return self.linear_2(self.act(self.linear_1(self.patch_merger(self.norm(x), grids))))


class LightOnOcrImageEncoder(nn.Module):
    """Images -> rows of the text model's input embedding (one row per placeholder)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        _check_tower(config)
        vision = config.vision_config
        self.merge = merge_size(config)
        layers = _positive_int(vision, "num_hidden_layers", "vision_config.")
        self.vision_encoder = PixtralVisionTower(vision, layers)
        self.vision_projection = _Projector(config)
        self.depth = layers

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Each image's rows [(h // m) * (w // m), text hidden] (pixels [3, H, W], sides
        multiples of the patch size: an h x w patch grid)."""
        if not images:
            return []
        pixels = [m.pixel_values for m in images]
        p, m = self.vision_encoder.patch_size, self.merge
        for x in pixels:
            if x is None or x.dim() != 3 or x.shape[1] % p or x.shape[2] % p:
                shape = None if x is None else tuple(x.shape)
                raise ValueError(f"pixel_values {shape}: expected [3, H, W] in {p}-pixel patches")
        (states,), grids = self.vision_encoder(pixels, [self.depth])
        kept, merged = [], []
        for part, (h, w) in zip(states.split([h * w for h, w in grids]), grids, strict=True):
            hm, wm = h // m * m, w // m * m  # HF's unfold drops an odd last row / column
            kept.append(part.view(h, w, -1)[:hm, :wm].reshape(hm * wm, -1))
            merged.append((hm, wm))
        out = self.vision_projection(torch.cat(kept), merged)
        return list(out.split([(h // m) * (w // m) for h, w in merged]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `[model.]vision_encoder.*` and `[model.]vision_projection.*` tensors
        (any other name passed over); ValueError naming a missing or unexpected one."""

        def ours(name: str) -> str | None:
            name = name.removeprefix("model.")
            if name.startswith("vision_encoder.patch_positional_embedding."):
                return None  # a rotary buffer some saves carry: recomputed here
            return name if name.startswith(_OURS) else None

        picked = ((n, t) for n, t in ((ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self, picked)
