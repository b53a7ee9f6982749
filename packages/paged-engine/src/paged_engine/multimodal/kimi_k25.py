"""Kimi K2.5 / K2.6's image path (Kimi_K25ForConditionalGeneration): the processor's rule, the
MoonViT tower (multimodal/moonvit.py) and the projector into the DeepSeek-V3 decoder.

    image -> RGB uint8 -> resized (NaViT rule below; bicubic with antialias on the uint8 image,
        as torchvision resizes it on the CPU) -> zero-padded right / bottom to multiples of
        merge * patch pixels -> (x / 255 - mean) / std -> patches [h * w, 3, p, p] row-major
    -> MoonViT -> [h * w / m^2, m^2, D] (m x m blocks of patches)
    -> mm_projector: pre_norm (LayerNorm over D, per patch) -> the block's m^2 patches
        concatenated -> in_proj -> GELU (erf) -> out_proj -> [h * w / m^2, text hidden]
    prompt: <|media_pad|> x (h * w / m^2)   (HF's processor repeats the token in the text; the
        chat template writes <|media_begin|>image<|media_content|><|media_pad|><|media_end|>)

NaViT resize (transformers' navit_resize): patches per side n_h = max(1, H // p) (likewise w),
scale = min(1, sqrt(max_patches / (n_h * n_w)), side * p / H, side * p / W) with side =
size["max_height"]; the new size int(H * scale), int(W * scale) (at least 1, at most side * p),
then padded up to multiples of m * p. Never upscaled. The decoder is plain DeepSeek-V3 (1-D
rope), so an image is a run of placeholders and nothing more.

The image processor: transformers' Kimi_K25ImageProcessor when it imports (it needs
torchvision); else `KimiImageProcessor` here (through multimodal/torch_processors.py's table),
the same steps in torch alone, from the checkpoint's preprocessor_config.json (or
processor_config.json's image_processor); both honour mm_processor_kwargs. Videos are
multimodal/kimi_k25_video.py's (chunks of frames the tower pools in time). Refused by name:
without torchvision a resample other
than nearest / bilinear / bicubic, a non-square size, pos_emb_width != pos_emb_height,
patch_size or merge_size unlike the tower's, projection_hidden_size unlike the tower's width.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.moonvit import MoonVisionTower
from paged_engine.multimodal.torch_processors import (
    ProcessorKwargs,
    TorchImageProcessor,
    normalize,
    resize,
)

ARCH = "Kimi_K25ForConditionalGeneration"
_DEFAULTS = {  # Kimi_K25ImageProcessor's class attributes
    "do_resize": True,
    "resample": 3,  # PILImageResampling.BICUBIC
    "size": {"max_height": 512, "max_width": 512},
    "max_patches": 16384,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "do_convert_rgb": True,
    "patch_size": 14,
    "merge_size": 2,
}


def merge_size(config: Any) -> int:
    """m: the merge kernel's side (square kernels only: the processor has one merge_size)."""
    kernel = list(getattr(config.vision_config, "merge_kernel_size", (2, 2)))
    if len(kernel) != 2 or kernel[0] != kernel[1] or not isinstance(kernel[0], int):
        raise ValueError(
            f"vision_config.merge_kernel_size={kernel!r} is not supported: a square kernel "
            "(the image processor pads to one merge_size)"
        )
    return int(kernel[0])


def tokens(config: Any, grid: tuple[int, ...]) -> int:
    t, h, w = grid
    return t * h * w // merge_size(config) ** 2


def navit_size(
    height: int, width: int, patch: int, merge: int, max_patches: int, side: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized h, w), (padded h, w)) of an image, by transformers' navit_resize."""
    patches_h = max(1.0, height // patch)
    patches_w = max(1.0, width // patch)
    scale = min(
        1.0,
        math.sqrt(max_patches / (patches_h * patches_w)),
        side * patch / height,
        side * patch / width,
    )
    new_h = min(max(1, int(height * scale)), side * patch)
    new_w = min(max(1, int(width * scale)), side * patch)
    unit = merge * patch
    return (new_h, new_w), (-(-new_h // unit) * unit, -(-new_w // unit) * unit)


class _KimiKwargs(ProcessorKwargs, total=False):
    size: dict[str, int]
    max_patches: int
    patch_size: int
    merge_size: int


class KimiImageProcessor(TorchImageProcessor):
    """Kimi_K25ImageProcessor's steps in torch alone (no torchvision): images -> pixel_values
    [sum of h * w, 3, p, p] float32 (each image's patches row-major), image_grid_thw
    [images, 3] of (1, h, w)."""

    name = "Kimi_K25ImageProcessor"
    defaults: ClassVar[dict[str, Any]] = _DEFAULTS
    valid_kwargs = _KimiKwargs

    def check(self, s: dict[str, Any]) -> None:
        super().check(s)
        size = s["size"]
        if size.get("max_height") is None or size.get("max_height") != size.get("max_width"):
            raise ValueError(f"preprocessor_config.json size={size}: equal max_height, max_width")
        config = self.config
        if config is not None and (
            s["patch_size"] != config.vision_config.patch_size
            or s["merge_size"] != merge_size(config)
        ):
            raise ValueError(
                f"preprocessor_config.json patch_size={s['patch_size']} / merge_size="
                f"{s['merge_size']} differ from vision_config's "
                f"({config.vision_config.patch_size}, {merge_size(config)})"
            )

    def preprocess(self, images: list[torch.Tensor], s: dict[str, Any]) -> dict[str, Any]:
        p, merge = int(s["patch_size"]), int(s["merge_size"])
        out, grids = [], []
        for x in images:
            if s["do_resize"]:
                h, w = x.shape[-2:]
                side = int(s["size"]["max_height"])
                (nh, nw), (ph, pw) = navit_size(h, w, p, merge, int(s["max_patches"]), side)
                x = resize(x, (nh, nw), s["resample"])
                x = F.pad(x, (0, pw - nw, 0, ph - nh))
            x = normalize(x, s).float()
            c, h, w = x.shape
            patches = x.view(c, h // p, p, w // p, p).permute(1, 3, 0, 2, 4)
            out.append(patches.reshape(-1, c, p, p))
            grids.append((1, h // p, w // p))
        return {"pixel_values": torch.cat(out), "image_grid_thw": torch.tensor(grids)}


class _Projector(nn.Module):  # HF's Kimi_K25MultimodalProjection
    def __init__(self, config: Any) -> None:
        super().__init__()
        v = config.vision_config
        dim = int(v.hidden_size)
        norm = getattr(config, "projection_hidden_size", dim)
        if norm != dim:
            raise ValueError(
                f"projection_hidden_size={norm} is not supported: vision_config.hidden_size "
                f"({dim}; HF's pre_norm runs on the tower's rows)"
            )
        wide = dim * merge_size(config) ** 2
        self.pre_norm = nn.LayerNorm(dim, eps=float(config.projection_layer_norm_eps))
        self.in_proj = nn.Linear(wide, wide)
        self.act = nn.GELU()
        self.out_proj = nn.Linear(wide, int(config.text_config.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, m^2, D] -> [M, text hidden]
        x = self.pre_norm(x).reshape(x.shape[0], -1)
        return self.out_proj(self.act(self.in_proj(x)))


def _ours(name: str) -> str | None:
    """A checkpoint name of the tower or projector, in this module's names (else None)."""
    name = name.removeprefix("model.")
    if name.startswith("vision_tower."):
        return name
    if name.startswith("mm_projector."):
        for old, new in (("proj.0.", "in_proj."), ("proj.2.", "out_proj.")):
            name = name.replace(f"mm_projector.{old}", f"mm_projector.{new}")
        return name
    return None


class KimiImageEncoder(nn.Module):
    """Images -> rows of the text model's input embedding, one per placeholder."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        merge_size(config)  # a square kernel (ValueError naming merge_kernel_size)
        self.vision_tower = MoonVisionTower(config.vision_config)
        self.mm_projector = _Projector(config)

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        if not images:
            return []
        weight = self.mm_projector.in_proj.weight
        pixels = torch.cat([m.pixel_values for m in images]).to(weight.device, weight.dtype)
        grids = [tuple(int(x) for x in m.image_size) for m in images]  # type: ignore[union-attr]
        rows = self.mm_projector(self.vision_tower(pixels, grids))  # type: ignore[arg-type]
        return list(rows.split([m.length for m in images]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `[model.]vision_tower.*` and `[model.]mm_projector.*` tensors (HF's
        names or the Hub's originals; any other name is passed over); ValueError naming a
        missing or unexpected one."""
        tower = self.vision_tower

        def convert(name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
            if not name.startswith("vision_tower."):
                return ((name, tensor),)
            inner = name.removeprefix("vision_tower.")
            return ((f"vision_tower.{n}", t) for n, t in tower.hf_names(inner, tensor))

        picked = ((n, t) for n, t in ((_ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self, picked, convert=convert)


def load_image(run: Any, image: Any) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One image's (pixel values [h * w, 3, p, p], grid (1, h, w)) by the checkpoint's image
    processor (transformers', or ours where it needs the missing torchvision)."""
    out = run([image])
    t, h, w = (int(v) for v in out["image_grid_thw"][0])
    return out["pixel_values"].float(), (t, h, w)
