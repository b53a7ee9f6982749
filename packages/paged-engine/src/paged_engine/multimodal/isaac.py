"""Isaac's host side (IsaacForConditionalGeneration, remote code; config: models/isaac_config.py):
its image processor, where an image's run goes in the prompt and the prompt's M-RoPE positions.
The tower and projector: multimodal/isaac_encoder.py.

    image -> RGB, its size fitted (the remote's get_image_size_for_max_num_patches): each side
        rounded up to a multiple of u = patch * pixel_shuffle_scale; if that grid has fewer than
        vision_min_num_patches patches the image is scaled up, if more than
        vision_max_num_patches scaled down, by the scale a bisection (to 1e-5) finds: the
        smallest reaching the minimum or the largest within the maximum, each side
        ceil(scale * side / u) * u (at least u)
        -> F.interpolate(bilinear, align_corners=False) of the uint8 image (rounded to uint8, as
        the remote resizes it), * (1 / 255), (x - 0.5) / 0.5 -> patches [h * w, p * p * 3]
        (row-major, each (row, col, channel)), grid (1, h, w)
    prompt (the remote's and vLLM's processor): the text split at each config.vision_token
        ("<image>", text), the pieces tokenized apart, an image's run of <|image_pad|> x
        (h * w / s^2) between them (s = pixel_shuffle_scale)

Positions (the remote's compute_mrope_pos_tensor and IsaacRotaryEmbedding): a running time t
over the prompt's events; a text token takes (t, t, t) and advances t by one, an image's merged
grid token (r, c) takes (t, r, c) (row and column from 0, not offset), and the image advances t
by one. Generated tokens continue at max + 1 on every row (the remote's rope_deltas). vLLM's
get_mrope_input_positions starts the text after an image at t + 1 as well, except text between
two images, which it starts at the image's largest index + 1; the remote's t + 1 is served here.

Refused by name: an image over the remote's 60-megapixel bound, any mm_processor_kwargs (the
settings are the config's), a tokenizer whose <|image_pad|> is not config.image_token_id, image
embeddings (the run's positions follow the pixel grid), and a prompt whose images and
vision_token markers differ in number or that holds <|image_pad|> of its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from paged_engine.models.isaac_config import IMAGE_PAD
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import (
    Layout,
    Loaded,
    Run,
    Size,
    _shape_error,
    splice_at_text,
    token_ids,
)
from paged_engine.multimodal.mrope import MropePositions

MAX_PIXELS = 60_000_000  # the remote's bound on an image's pixels
_EPS = 1e-5  # the bisection's tolerance on the scale


def _fitted_side(scale: float, side: int, unit: int) -> int:
    return max(unit, math.ceil(scale * side / unit) * unit)


def fitted_size(
    height: int, width: int, patch: int, unit: int, most: int, least: int | None
) -> tuple[int, int]:
    """(height, width) in pixels the remote resizes an image to: multiples of `unit` whose
    patch grid holds at most `most` patches, at least `least` (see the module)."""

    def patches(scale: float) -> float:
        return _fitted_side(scale, height, unit) * _fitted_side(scale, width, unit) / patch**2

    def size(scale: float) -> tuple[int, int]:
        return _fitted_side(scale, height, unit), _fitted_side(scale, width, unit)

    if least is not None and patches(1.0) < least:
        low, high = 1.0, 100.0  # high: the smallest scale seen to reach `least`
        while high - low >= _EPS:
            mid = (low + high) / 2
            low, high = (low, mid) if patches(mid) >= least else (mid, high)
        return size(high)
    if patches(1.0) <= most:
        return size(1.0)
    low, high = _EPS / 10, 1.0  # low: the largest scale seen to stay within `most`
    while high - low >= _EPS:
        mid = (low + high) / 2
        low, high = (mid, high) if patches(mid) <= most else (low, mid)
    return size(low)


class IsaacImageProcessor:
    """The remote's image steps (see the module) in torch, called as transformers' processors
    are: images -> {"pixel_values": [h * w, 3 * p * p], "image_grid_thw": [[1, h, w]]} per
    image, concatenated."""

    def __init__(self, config: Any) -> None:
        self.patch = int(config.vision_config.patch_size)
        self.shuffle = int(config.pixel_shuffle_scale)
        self.most = int(config.vision_max_num_patches)
        least = config.vision_min_num_patches
        self.least = None if least is None else int(least)

    def one(self, image: Any) -> tuple[torch.Tensor, tuple[int, int, int]]:
        if image.width * image.height > MAX_PIXELS:
            raise ValueError(
                f"image of {image.width} x {image.height} pixels is over Isaac's {MAX_PIXELS}"
            )
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        # uint8 [1, 3, H, W] in channels-last strides, resized in uint8 (rounded) as the remote
        x = torch.from_numpy(np.array(rgb))[None].permute(0, 3, 1, 2)
        p, unit = self.patch, self.patch * self.shuffle
        height, width = fitted_size(image.height, image.width, p, unit, self.most, self.least)
        x = F.interpolate(x, size=(height, width), mode="bilinear", align_corners=False)
        x = (x[0].permute(1, 2, 0).float() * (1 / 255) - 0.5) / 0.5  # [H, W, 3]
        h, w = height // p, width // p
        x = x.reshape(h, p, w, p, 3).permute(0, 2, 1, 3, 4)  # [h, w, p, p, 3]
        return x.reshape(h * w, p * p * 3), (1, h, w)

    def __call__(self, images: list[Any], return_tensors: str = "pt", **kw: Any) -> Any:
        out = [self.one(image) for image in images]
        return {
            "pixel_values": torch.cat([x for x, _ in out]),
            "image_grid_thw": torch.tensor([g for _, g in out]),
        }


def positions(num_tokens: int, images: Sequence[ImageInput], shuffle: int) -> MropePositions:
    """The prompt's three-row table (see the module), images in prompt order."""
    table = np.empty((3, num_tokens), dtype=np.int64)
    t, last = 0, 0  # the next time index; the prompt index up to which the table is written
    for m in images:
        assert m.image_size is not None and len(m.image_size) == 3
        rows, cols = m.image_size[1] // shuffle, m.image_size[2] // shuffle
        if rows * cols != m.length:
            raise ValueError(f"an image's grid {m.image_size} does not give its {m.length} rows")
        table[:, last : m.offset] = np.arange(t, t + m.offset - last)
        t += m.offset - last
        row, col = np.divmod(np.arange(rows * cols), cols)
        table[:, m.offset : m.end] = np.stack([np.full_like(row, t), row, col])
        t, last = t + 1, m.end
    table[:, last:] = np.arange(t, t + num_tokens - last)
    first = images[0].offset if images else num_tokens
    delta = int(table.max()) + 1 - num_tokens if num_tokens else 0
    return MropePositions(table, first, delta)


class IsaacLayout(Layout):
    """Each vision_token of the text -> a run of <|image_pad|> by the shuffled grid; M-RoPE
    positions by this module's rule."""

    mrope = True
    takes_embeds = False

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        self.config = config
        self.placeholder = placeholder  # <|image_pad|>: config.image_token_id
        self.tokenizer = tokenizer
        self.fixed = None
        self.shuffle = int(config.pixel_shuffle_scale)
        self.text_marker = str(config.vision_token)
        if tokenizer is not None and token_ids(tokenizer, IMAGE_PAD)[0] != placeholder:
            raise ValueError(
                f"the tokenizer's {IMAGE_PAD} is id {token_ids(tokenizer, IMAGE_PAD)[0]}, not "
                f"config image_token_id {placeholder}"
            )

    def image_processor(self) -> IsaacImageProcessor:
        return IsaacImageProcessor(self.config)

    def check_kwargs(self, kwargs: dict[str, Any]) -> None:
        if kwargs:
            raise ValueError(
                f"mm_processor_kwargs {sorted(kwargs)} are not supported for Isaac (its image "
                "settings are the config's)"
            )

    def length(self, size: Size) -> int:
        s = self.shuffle
        if size is None or len(size) != 3 or size[0] != 1 or min(size) <= 0:
            raise ValueError(f"multi_modal_data['image']: image_size {size} is not (1, h, w)")
        if size[1] % s or size[2] % s:
            raise ValueError(
                f"multi_modal_data['image']: image_size {size}: h and w must be multiples of "
                f"pixel_shuffle_scale {s}"
            )
        return size[1] * size[2] // s**2

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        assert size is not None and len(size) == 3
        v = self.config.vision_config
        return (size[1] * size[2], int(v.num_channels) * int(v.patch_size) ** 2)

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image])
        grid = tuple(int(v) for v in out["image_grid_thw"][0])
        pixels = out["pixel_values"].float()
        if tuple(pixels.shape) != self.pixel_shape(grid):
            raise _shape_error(pixels, self.pixel_shape(grid))
        return pixels, grid

    def segment(self, loaded: Loaded) -> list[int]:  # (not Layout's: the prompt is spliced)
        return [self.placeholder] * self.length(loaded[1])

    @property
    def marker(self) -> int:
        tok = self.tokenizer
        return -1 if tok is None else tok.get_vocab().get(self.text_marker, -1)

    def splice(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        """The prompt's text split at each vision_token, the pieces tokenized apart and the
        segments put between them; ValueError naming multi_modal_data unless there is one
        marker per image and no <|image_pad|> of the text's own."""
        tok = self.tokenizer
        if tok is None:
            raise ValueError("the tokenizer is needed to place Isaac's images")
        if self.placeholder in ids:
            raise ValueError(
                f"multi_modal_data['image']: the prompt holds {IMAGE_PAD} tokens of its own "
                "outside its images' runs"
            )
        return splice_at_text(tok, ids, segments, self.text_marker)

    def positions(self, num_tokens: int, images: tuple[ImageInput, ...]) -> Any:
        return positions(num_tokens, images, self.shuffle)
