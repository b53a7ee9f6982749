"""DeepSeek-OCR (v1)'s host side (`DeepseekOCRForCausalLM`, the Hub's remote code; vLLM's
transformers_utils/processors/deepseek_ocr.py and deepseek_ocr.py's prompt update): the
image processor, tiling and placeholder runs. The tower: deepseek_ocr_v1_encoder.py; the
decoder: DeepSeek-OCR-2's (models/deepseek_ocr2_text.py, text_wrappers.py's row); the config:
models/deepseek_ocr_v1_config.py.

    modes (mm_processor_kwargs base_size, image_size, crop_mode; DeepSeek-OCR's presets):
        tiny 512 / 512 / False, small 640 / 640 / False, base 1024 / 1024 / False,
        large 1280 / 1280 / False, gundam 1024 / 640 / True (vLLM's, the default)
    crops: an image wider or taller than 640 pixels (either mode's threshold: vLLM's), with
        crop_mode, is resized (PIL bicubic) to (wt R, ht R) for the (wt, ht) of 2..6 tiles
        whose aspect ratio is closest (ties: the later one when the image covers over half
        its area) and cut into wt x ht crops of R = image_size, row-major
    without crop_mode and image_size <= 640: the image first resized to R x R
    global view: the image padded (ImageOps.pad: resized bicubic to fit, centered) to B x B
        = base_size on the mean's colour; every view / 255, then (x - mean) / std
    run of placeholders: nb (nb + 1) + 1 with nb = ceil(B / 16 / 4), plus
        (ht nr)(wt nr + 1) with nr = ceil(R / 16 / 4) when there are crops
    prompt: each "<image>" token of the prompt replaced by its image's run (vLLM's)
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import torch

from paged_engine.multimodal.layouts import Layout, Loaded, Run, Size, _shape_error

BASE_SIZE, IMAGE_SIZE, CROP_MODE = 1024, 640, True  # vLLM's (the gundam mode)
MIN_CROPS, MAX_CROPS = 2, 6
CROP_THRESHOLD = 640  # vLLM's: an image this small on both sides is not cropped
_SIDES = (512, 640, 1024, 1280)  # the presets' sizes; any multiple of 64 up to 1280 is taken
_MEAN = (0.5, 0.5, 0.5)


class _Kwargs(TypedDict, total=False):
    base_size: int
    image_size: int
    crop_mode: bool


def _check_side(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 64 <= value <= 1280:
        raise ValueError(
            f"mm_processor_kwargs['{name}'] must be an int in [64, 1280], got {value!r}"
        )
    if value % 64:
        raise ValueError(f"mm_processor_kwargs['{name}'] must be a multiple of 64, got {value}")
    return value


def tile_ratios() -> list[tuple[int, int]]:
    """(wt, ht) of MIN_CROPS..MAX_CROPS tiles, by tile count (vLLM's order)."""
    pairs = {
        (i, j)
        for i in range(1, MAX_CROPS + 1)
        for j in range(1, MAX_CROPS + 1)
        if MIN_CROPS <= i * j <= MAX_CROPS
    }
    return sorted(pairs, key=lambda r: r[0] * r[1])


def count_tiles(width: int, height: int, crop: int) -> tuple[int, int]:
    """(wt, ht): the closest aspect ratio, a tie going to the later one when the image covers
    more than half of its area at `crop` pixels a tile."""
    aspect, best, best_diff = width / height, (1, 1), float("inf")
    for wt, ht in tile_ratios():
        diff = abs(aspect - wt / ht)
        if diff < best_diff:
            best, best_diff = (wt, ht), diff
        elif diff == best_diff and width * height > 0.5 * crop * crop * wt * ht:
            best = (wt, ht)
    return best


def image_tokens(wt: int, ht: int, base: int, crop: int) -> int:
    nb, nr = math.ceil(base // 16 / 4), math.ceil(crop // 16 / 4)
    local = (ht * nr) * (wt * nr + 1) if wt * ht > 1 else 0
    return nb * (nb + 1) + 1 + local


class DeepseekOCRImageProcessor:
    """The remote processor's image steps (see the module), in PIL and torch."""

    valid_kwargs = _Kwargs

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        self.mean, self.std = mean, std

    def _tensor(self, image: Any) -> torch.Tensor:  # [3, H, W]
        x = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1)
        mean = torch.tensor(self.mean).view(3, 1, 1)
        return (x.float() / 255 - mean) / torch.tensor(self.std).view(3, 1, 1)

    def one(self, image: Any, base: int, crop: int, crop_mode: bool) -> tuple[torch.Tensor, Size]:
        from PIL import Image, ImageOps

        w, h = image.size
        if min(w, h) < 1:  # the release's ImageOps.pad would answer a blank canvas
            raise ValueError(f"multi_modal_data['image']: a {w} x {h} image has no pixels")
        wt = ht = 1
        views = []
        if crop_mode and (w > CROP_THRESHOLD or h > CROP_THRESHOLD):
            wt, ht = count_tiles(w, h, crop)
            big = image.resize((wt * crop, ht * crop), Image.Resampling.BICUBIC)
            for i in range(wt * ht):
                c, r = i % wt, i // wt
                views.append(big.crop((c * crop, r * crop, (c + 1) * crop, (r + 1) * crop)))
        if crop <= 640 and not crop_mode:
            image = image.resize((crop, crop), Image.Resampling.BICUBIC)
        fill = tuple(int(m * 255) for m in self.mean)
        whole = ImageOps.pad(image, (base, base), color=fill)
        parts = [self._tensor(v).flatten() for v in [whole, *views]]
        return torch.cat(parts), (wt, ht, base, crop)

    def __call__(
        self,
        images: list[Any],
        return_tensors: str = "pt",
        base_size: int = BASE_SIZE,
        image_size: int = IMAGE_SIZE,
        crop_mode: bool = CROP_MODE,
    ) -> dict[str, list]:
        base, crop = _check_side("base_size", base_size), _check_side("image_size", image_size)
        if not isinstance(crop_mode, bool):
            raise ValueError(f"mm_processor_kwargs['crop_mode'] must be a bool, got {crop_mode!r}")
        done = [self.one(image, base, crop, crop_mode) for image in images]
        return {"pixel_values": [p for p, _ in done], "image_sizes": [s for _, s in done]}


class DeepseekOCRLayout(Layout):
    """Each "<image>" token -> a run of image_tokens(wt, ht, B, R) placeholders; flat pixels
    [3 B B + wt ht 3 R R]; `image_size` (wt, ht, B, R)."""

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        self.config = config
        self.placeholder = placeholder
        self.fixed = None
        self.mean, self.std = _MEAN, _MEAN
        vocab = tokenizer.get_vocab() if tokenizer is not None else {}
        if "<image>" in vocab and vocab["<image>"] != placeholder:
            arch = (getattr(config, "architectures", None) or ["DeepseekOCRForCausalLM"])[0]
            raise ValueError(
                f"{arch}: the tokenizer's <image> is id {vocab['<image>']}, "
                f"config image_token_id is {placeholder}: they must agree"
            )

    def read_saved(self, path: Path) -> None:
        """processor_config.json's image_mean / image_std (the release's: 0.5)."""
        for name in ("processor_config.json", "preprocessor_config.json"):
            file = Path(path) / name
            if file.is_file():
                saved = json.loads(file.read_text())
                self.mean = tuple(saved.get("image_mean", self.mean))
                self.std = tuple(saved.get("image_std", self.std))
                return

    def image_processor(self) -> DeepseekOCRImageProcessor:
        return DeepseekOCRImageProcessor(self.mean, self.std)

    def check_kwargs(self, kwargs: dict[str, Any]) -> None:
        for name in ("base_size", "image_size"):
            if name in kwargs:
                _check_side(name, kwargs[name])
        if "crop_mode" in kwargs and not isinstance(kwargs["crop_mode"], bool):
            raise ValueError(
                f"mm_processor_kwargs['crop_mode'] must be a bool, got {kwargs['crop_mode']!r}"
            )

    def _size(self, size: Size) -> tuple[int, int, int, int]:
        if size is None or len(size) != 4:
            raise ValueError(f"multi_modal_data['image']: image_size {size} is not (wt, ht, B, R)")
        wt, ht, base, crop = (int(s) for s in size)
        if wt < 1 or ht < 1 or (wt * ht > 1 and not MIN_CROPS <= wt * ht <= MAX_CROPS):
            raise ValueError(f"multi_modal_data['image']: {wt} x {ht} tiles is not a tiling")
        return wt, ht, _check_side("base_size", base), _check_side("image_size", crop)

    def length(self, size: Size) -> int:
        return image_tokens(*self._size(size))

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        wt, ht, base, crop = self._size(size)
        crops = wt * ht if wt * ht > 1 else 0
        return (3 * base * base + crops * 3 * crop * crop,)

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image])
        size = tuple(out["image_sizes"][0])
        pixels = out["pixel_values"][0].float().contiguous()
        if tuple(pixels.shape) != self.pixel_shape(size):
            raise _shape_error(pixels, self.pixel_shape(size))
        return pixels, size
