"""Kimi-VL's images (`KimiVLForConditionalGeneration`, the Hub's remote code: its
image_processing_kimi_vl.py, modeling_kimi_vl.py; vLLM's kimi_vl.py / moonvit.py). The config
is read as transformers' Kimi_K25Config (models/kimi_vl_config.py) and the tower and projector
are Kimi K2.5's (multimodal/kimi_k25.py, moonvit.py: the same maths for a still image) under
Kimi-VL's weight names; the decoder is DeepSeek-V3's (models/text_wrappers.py's row).

    image -> RGB; where (W // p) * (H // p) > in_token_limit: scale = sqrt(in_token_limit /
        ((W // p) * (H // p))), resized (PIL bicubic) to int(W * scale) x int(H * scale)
    -> padded right / bottom with black to multiples of merge * p (pad_input)
    -> / 255, (x - mean) / std -> patches [h * w, 3, p, p] row-major; grid (1, h, w)
    -> MoonViT -> 2 x 2 blocks -> projector -> h * w / 4 rows
    prompt: <|media_pad|> (media_placeholder_token_id) -> a run of h * w / 4 of it (vLLM's
        PromptReplacement); chat placeholder "<|media_start|>image<|media_content|>
        <|media_pad|><|media_end|>" (vLLM's get_placeholder_str; multimodal/chat_format.py)

Weights: `vision_tower.{patch_embed, encoder.blocks.N, encoder.final_layernorm}.*` (the Hub's
MoonViT names, which moonvit.py reads), `multi_modal_projector.{pre_norm, linear_1,
linear_2}.*` -> kimi_k25.py's `mm_projector.{pre_norm, in_proj, out_proj}.*`.
preprocessor_config.json: patch_size, in_token_limit, merge_kernel_size, pad_input,
image_mean, image_std. Refused by name: pad_input false (the remote processor then crops to
patch multiples, which the 2 x 2 merge does not take; vLLM counts padded images), a patch_size
or merge_kernel_size unlike the tower's, an image of 512 patches or more a side (the remote
processor's "Exceed pos emb"), any mm_processor_kwargs (the remote processor takes none).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import torch

from paged_engine.multimodal.kimi_k25 import KimiImageEncoder, merge_size
from paged_engine.multimodal.layouts_single_run import KimiLayout

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # the remote class's defaults
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_MOST_SIDE = 512  # patches a side the remote rope table holds
_PROJECTOR = {"linear_1.": "in_proj.", "linear_2.": "out_proj.", "pre_norm.": "pre_norm."}


def rescaled_size(width: int, height: int, patch: int, limit: int) -> tuple[int, int]:
    """An image's (width, height) after the remote processor's rescale (before padding)."""
    patches = (width // patch) * (height // patch)
    if patches > limit:
        scale = math.sqrt(limit / patches)
        width, height = int(width * scale), int(height * scale)
    return width, height


class _Kwargs(TypedDict, total=False):
    """The remote processor's call takes no settings."""


class KimiVLImageProcessor:
    """The remote KimiVLImageProcessor's steps (see the module) in PIL and torch: images ->
    pixel_values [sum of h * w, 3, p, p] float32, image_grid_thw [images, 3] of (1, h, w)."""

    valid_kwargs = _Kwargs

    def __init__(self, saved: dict[str, Any], config: Any) -> None:
        self.patch = int(saved.get("patch_size", 14))
        self.limit = int(saved.get("in_token_limit", 4096))
        self.merge = merge_size(config)
        kernel = list(saved.get("merge_kernel_size") or (self.merge, self.merge))
        if self.patch != int(config.vision_config.patch_size) or kernel != [self.merge] * 2:
            raise ValueError(
                f"preprocessor_config.json patch_size={self.patch} / merge_kernel_size={kernel} "
                f"differ from vision_config's ({config.vision_config.patch_size}, "
                f"{config.vision_config.merge_kernel_size})"
            )
        if not saved.get("pad_input", False):  # (the remote class's default: False)
            raise ValueError(
                f"preprocessor_config.json pad_input={saved.get('pad_input', False)} is not "
                "supported: the remote processor then crops to patch multiples, which the merge "
                "blocks do not take (the releases pad)"
            )
        if self.limit < 1:
            raise ValueError(f"preprocessor_config.json in_token_limit={self.limit}: above 0")
        self.mean = torch.tensor(saved.get("image_mean", _CLIP_MEAN), dtype=torch.float32)
        self.std = torch.tensor(saved.get("image_std", _CLIP_STD), dtype=torch.float32)

    def one(self, image: Any) -> tuple[torch.Tensor, tuple[int, int, int]]:
        from PIL import Image

        image = image.convert("RGB")
        width, height = rescaled_size(*image.size, self.patch, self.limit)
        if (width, height) != image.size:
            image = image.resize((width, height), Image.Resampling.BICUBIC)
        unit = self.merge * self.patch
        padded = (-(-width // unit) * unit, -(-height // unit) * unit)
        h, w = padded[1] // self.patch, padded[0] // self.patch
        if max(h, w) >= _MOST_SIDE:
            raise ValueError(
                f"an image of {h} x {w} patches: under {_MOST_SIDE} a side (the remote "
                "processor's position limit)"
            )
        x = torch.zeros(3, padded[1], padded[0])
        x[:, :height, :width] = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(
            2, 0, 1
        )
        x = (x / 255 - self.mean[:, None, None]) / self.std[:, None, None]
        p = self.patch
        patches = x.view(3, h, p, w, p).permute(1, 3, 0, 2, 4).reshape(-1, 3, p, p)
        return patches, (1, h, w)

    def __call__(self, images: list[Any], return_tensors: str = "pt") -> dict[str, torch.Tensor]:
        done = [self.one(image) for image in images]
        return {
            "pixel_values": torch.cat([p for p, _ in done]),
            "image_grid_thw": torch.tensor([g for _, g in done]),
        }


class KimiVLLayout(KimiLayout):
    """Kimi K2.5's runs of <|media_pad|>, the image processor built from
    preprocessor_config.json (no remote code runs)."""

    saved: dict[str, Any] | None = None

    def read_saved(self, path: Path) -> None:
        file = Path(path) / "preprocessor_config.json"
        self.saved = json.loads(file.read_text()) if file.is_file() else {}

    def image_processor(self) -> KimiVLImageProcessor:
        return KimiVLImageProcessor(self.saved or {}, self.config)


class KimiVLImageEncoder(KimiImageEncoder):
    """Kimi K2.5's tower and projector loading Kimi-VL's names."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `vision_tower.*` and `multi_modal_projector.*` tensors (others
        pass over); ValueError naming a missing or unexpected one."""

        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith("multi_modal_projector."):
                    rest = name.removeprefix("multi_modal_projector.")
                    old = next((o for o in _PROJECTOR if rest.startswith(o)), None)
                    if old is None:
                        raise ValueError(f"{name}: not a weight of Kimi-VL's projector")
                    name = "mm_projector." + _PROJECTOR[old] + rest.removeprefix(old)
                yield name, tensor

        return super().load_weights(renamed())
