"""Keye-VL's host side and encoder (`KeyeForConditionalGeneration`, remote code:
Kwai-Keye/Keye-VL-8B-Preview; `KeyeVL1_5ForConditionalGeneration`: Keye-VL-1.5; config
models/keye_config.py), as the remote processing_keye.py / image_processing_keye.py and vLLM's
keye.py / keye_vl1_5.py run them.

    image -> the remote SiglipImageProcessor (preprocessor_config.json: min_pixels, max_pixels,
        patch_size, merge_size, temporal_patch_size 1, mean / std), which is transformers'
        PaddleOCRVLImageProcessorPil step for step: smart_resize to multiples of patch * merge
        between min / max pixels (bicubic), rescale, normalize, h x w patches row-major
        -> pixel rows [h*w, C*p*p]
    -> multimodal/paddleocr_vl.py's encoder: Keye's tower (`visual.vision_model.`) and projector
        (`mlp_AR.`) are PaddleOCR-VL's under the Hub's names; Keye-VL-1.5's projector
        (KeyeImageEncoder) normalizes each merged row [4 * width] (LayerNorm eps 1e-5) after
        the 2 x 2 merge instead of each patch before it, then the same linear, GELU, linear
    prompt: <|vision_start|><|image_pad|><|vision_end|>, the lone <|image_pad|> repeated once
        per merged patch (h*w / 4); Qwen2-VL's M-RoPE table (one temporal patch an image)

The processors differ only where the remote fails: an image so narrow that smart_resize's
shrink would floor a side to 0 (transformers keeps one merged patch).

Refused by name: a preprocessor_config.json patch_size unlike vision_config.patch_size,
merge_size unlike vision_config.spatial_merge_size, temporal_patch_size other than 1. Videos
are refused by the input processor (multi_modal_data['video']), Keye-VL-1.5's (slow / fast
frames, one temporal patch each) too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from paged_engine.multimodal.paddleocr_vl import (
    _PROJECTOR_EPS,
    PaddleOCRImageEncoder,
    PaddleOCRLayout,
    _Projector,
)
from paged_engine.multimodal.torch_processors import saved_settings
from paged_engine.multimodal.vision_transformer import pixel_shuffle

VL1_5 = "KeyeVL1_5ForConditionalGeneration"

# the remote SiglipImageProcessor's defaults where preprocessor_config.json says nothing
_DEFAULTS: dict[str, Any] = {
    "do_resize": True,
    "resample": 3,  # bicubic
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],  # OPENAI_CLIP_MEAN
    "image_std": [0.26862954, 0.26130258, 0.27577711],  # OPENAI_CLIP_STD
    "do_convert_rgb": True,
    "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 1280,
}


class KeyeLayout(PaddleOCRLayout):
    """PaddleOCR-VL's runs, pixel rows and M-RoPE table; the image processor built from the
    release's preprocessor_config.json (its class is remote code)."""

    saved: dict[str, Any] | None = None

    def read_saved(self, path: Path) -> None:
        self.saved = saved_settings(path)

    def image_processor(self) -> Any:
        from transformers import PaddleOCRVLImageProcessorPil

        saved = self.saved or {}
        v = self.config.vision_config
        want = {
            "patch_size": int(v.patch_size),
            "merge_size": int(v.spatial_merge_size),
            "temporal_patch_size": 1,
        }
        for name, value in want.items():
            found = saved.get(name, value)
            if found != value:
                raise ValueError(
                    f"preprocessor_config.json {name}={found!r} is not supported for "
                    f"{self.config.architectures[0]}: {value} (the tower's)"
                )
        settings = {k: saved.get(k, default) for k, default in _DEFAULTS.items()}
        return PaddleOCRVLImageProcessorPil(**settings, **want)


class _MergedRowProjector(_Projector):
    """Keye-VL-1.5's `mlp_AR`: the 2 x 2 merge first, then pre_norm over each merged row
    [m*m*D] (its weight m*m*D wide), linear_1, GELU, linear_2 as PaddleOCR-VL's."""

    def __init__(self, dim: int, text_dim: int, merge: int) -> None:
        super().__init__(dim, text_dim, merge)
        self.pre_norm = nn.LayerNorm(dim * merge * merge, eps=_PROJECTOR_EPS)

    def forward(self, x: torch.Tensor, h: int) -> torch.Tensor:
        """x [h*w, D] (row-major patches) -> [(h/m) * (w/m), text_dim]."""
        blocks = pixel_shuffle(x[None], self.merge, rows=h)[0]
        return self.linear_2(self.act(self.linear_1(self.pre_norm(blocks))))


class KeyeImageEncoder(PaddleOCRImageEncoder):
    """PaddleOCR-VL's encoder; Keye-VL-1.5 (by architectures) with the merged-row projector."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        if VL1_5 in (getattr(config, "architectures", None) or []):
            dim = int(config.vision_config.hidden_size)
            text = int(config.text_config.hidden_size)
            self.projector = _MergedRowProjector(dim, text, self.merge)
