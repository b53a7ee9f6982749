"""DeepSeek-VL2's host side (`DeepseekVLV2ForCausalLM`, the Hub's remote code; vLLM's
transformers_utils/processors/deepseek_vl2.py and deepseek_vl2.py's prompt update): the image
processor, tiling and placeholder runs. The tower and rows: deepseek_vl2_encoder.py; the
config: models/deepseek_vl2_config.py.

    tiles: with at most 2 images in the prompt (vLLM's `cropping`), the candidate resolution
        (width, height) that keeps most of the image's pixels once it is scaled to fit
        (ties: the one wasting least), else one S x S tile; S = the first candidate's width
    global view: the image padded (ImageOps.pad: resized bicubic to fit, centered) to S x S on
        the mean's colour; local views: the image padded alike to the chosen (W, H) and cut
        into wt x ht = W / S x H / S tiles, row-major; every view / 255, then (x - mean) / std
    run of placeholders: h (h + 1) + 1 + (ht h)(wt h + 1), h = ceil(S / patch / downsample)
    prompt: each "<image>" token of the prompt replaced by its image's run (vLLM's)
"""

from __future__ import annotations

import math
from typing import Any, TypedDict

import torch

from paged_engine.multimodal.deepseek_ocr_v1 import DeepseekOCRImageProcessor, DeepseekOCRLayout
from paged_engine.multimodal.layouts import Loaded, Run, Size, _shape_error

MOST_CROPPED = 2  # vLLM's: a prompt of more images gives each one tile


class _Kwargs(TypedDict, total=False):
    pass  # the release's processor takes none per request


def best_resolution(width: int, height: int, candidates: list[tuple[int, int]]) -> tuple[int, int]:
    """The candidate (W, H) keeping most of the image's pixels once scaled to fit in it (ties:
    the one wasting least; the first of equals), as the release's select_best_resolution."""
    best, kept_most, waste_least = candidates[0], -1, float("inf")
    for w, h in candidates:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        waste = w * h - kept
        if kept > kept_most or (kept == kept_most and waste < waste_least):
            best, kept_most, waste_least = (w, h), kept, waste
    return best


def image_tokens(wt: int, ht: int, side: int, patch: int, ratio: int) -> int:
    h = math.ceil(side // patch / ratio)
    return h * (h + 1) + 1 + (ht * h) * (wt * h + 1)


class DeepseekVL2ImageProcessor(DeepseekOCRImageProcessor):
    """The release processor's image steps (see the module), in PIL and torch."""

    valid_kwargs = _Kwargs

    def __init__(self, mean: tuple, std: tuple, candidates: list[tuple[int, int]]) -> None:
        super().__init__(mean, std)
        self.candidates = candidates
        self.side = candidates[0][0]

    def one(self, image: Any, cropping: bool) -> tuple[torch.Tensor, Size]:  # type: ignore[override]
        from PIL import ImageOps

        s = self.side
        w, h = best_resolution(*image.size, self.candidates) if cropping else (s, s)
        fill = tuple(int(m * 255) for m in self.mean)
        views = [ImageOps.pad(image, (s, s), color=fill)]
        local = ImageOps.pad(image, (w, h), color=fill)
        views += [local.crop((x, y, x + s, y + s)) for y in range(0, h, s) for x in range(0, w, s)]
        return torch.cat([self._tensor(v).flatten() for v in views]), (w // s, h // s)

    def __call__(  # type: ignore[override]
        self, images: list[Any], return_tensors: str = "pt", cropping: bool = True
    ) -> dict[str, list]:
        done = [self.one(image, cropping) for image in images]
        return {"pixel_values": [p for p, _ in done], "image_sizes": [s for _, s in done]}


class DeepseekVL2Layout(DeepseekOCRLayout):
    """Each "<image>" token -> a run of image_tokens(wt, ht, ...) placeholders; flat pixels
    [(1 + wt ht) 3 S S] (the global view, then the tiles); `image_size` (wt, ht)."""

    by_count = True  # tiled only with at most MOST_CROPPED images in the prompt

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        super().__init__(config, placeholder, tokenizer)
        self.candidates = [tuple(c) for c in config.candidate_resolutions]
        self.side = int(config.vision_config.image_size)
        self.patch = int(config.vision_config.patch_size)
        self.ratio = int(config.downsample_ratio)
        self.most = max(w * h for w, h in self.candidates) // self.side**2

    def image_processor(self) -> DeepseekVL2ImageProcessor:  # type: ignore[override]
        return DeepseekVL2ImageProcessor(self.mean, self.std, self.candidates)

    def check_kwargs(self, kwargs: dict[str, Any]) -> None:
        return None  # the processor's valid_kwargs (none) name what is refused

    def _size(self, size: Size) -> tuple[int, int]:  # type: ignore[override]
        if size is None or len(size) != 2:
            raise ValueError(f"multi_modal_data['image']: image_size {size} is not (wt, ht)")
        wt, ht = (int(s) for s in size)
        if wt < 1 or ht < 1 or wt * ht > self.most:
            raise ValueError(f"multi_modal_data['image']: {wt} x {ht} tiles is not a tiling")
        return wt, ht

    def length(self, size: Size) -> int:
        wt, ht = self._size(size)
        return image_tokens(wt, ht, self.side, self.patch, self.ratio)

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        wt, ht = self._size(size)
        return ((1 + wt * ht) * 3 * self.side**2,)

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image], cropping=count <= MOST_CROPPED)
        size = tuple(out["image_sizes"][0])
        pixels = out["pixel_values"][0].float().contiguous()
        if tuple(pixels.shape) != self.pixel_shape(size):
            raise _shape_error(pixels, self.pixel_shape(size))
        return pixels, size
