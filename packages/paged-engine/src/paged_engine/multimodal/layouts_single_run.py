"""Layouts that give an image one run and one `ImageInput` whose length and pixels its size
fixes, outside the Qwen and Gemma families (layouts.py has the base: LLaVA 1.5's fixed run).

    AnyResLayout   LLaVA-NeXT / OneVision: views of the image, a run by its (h, w)
    LineLayout     Pixtral / Mistral 3: lines of [IMG], [IMG_BREAK] between, [IMG_END] last
    BoundedLayout  InternVL: <img>, one run for all tiles, </img>
    KimiLayout     Kimi K2.5: a run of <|media_pad|> by the merged patch grid
"""

from __future__ import annotations

from typing import Any, ClassVar

from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import (
    Layout,
    Loaded,
    Run,
    Size,
    _shape_error,
    _side,
    digest,
    token_ids,
)
from paged_engine.multimodal.llava_next import AnyRes


class AnyResLayout(Layout):
    """LLaVA-NeXT / OneVision: views [1 + rows * cols, 3, S, S], a run by the image's (h, w).
    OneVision gives each image of a prompt with several one padded view, size None: its
    base rows and a newline."""

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        super().__init__(config, placeholder, tokenizer)
        self.anyres = AnyRes.from_config(config)
        self.fixed = None
        self.by_count = self.anyres.max_views is not None

    def length(self, size: Size) -> int:
        if size is None and self.by_count:
            return self.anyres.base_tokens + 1
        if size is None or len(size) != 2 or min(size) <= 0:
            raise ValueError(f"multi_modal_data['image']: image_size {size} is not its (h, w)")
        return self.anyres.tokens((size[0], size[1]))

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        side = _side(self.config)
        if size is None:
            return (1, 3, side, side)
        assert len(size) == 2
        return (self.anyres.views((size[0], size[1])), 3, side, side)

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        if self.by_count and count > 1:  # HF's processor: one padded view when several
            out = run([[image, image]])
            view = out["pixel_values"][0][:1].float()
            if tuple(view.shape) != self.pixel_shape(None):
                raise _shape_error(view, self.pixel_shape(None))
            return view, None
        out = run([image])
        h, w = (int(v) for v in out["image_sizes"][0])
        views = out["pixel_values"][0][: self.anyres.views((h, w))].float()
        if tuple(views.shape) != self.pixel_shape((h, w)):
            raise _shape_error(views, self.pixel_shape((h, w)))
        return views, (h, w)


class LineLayout(Layout):
    """Pixtral / Mistral 3: pixels [3, H, W] (sides in units u = patch x merge), h / u lines
    of w / u [IMG], each line ended by [IMG_BREAK], the last by [IMG_END]."""

    takes_embeds = False

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        from paged_engine.multimodal import pixtral

        self.config = config
        self.placeholder = placeholder
        self.fixed = None
        self.unit = pixtral.patch_size(config) * pixtral.merge_size(config)
        self.breaks = token_ids(tokenizer, "[IMG_BREAK]", "[IMG_END]")

    def _lines(self, size: Size) -> list[int]:
        assert size is not None and len(size) == 2
        lines, cols = size[0] // self.unit, size[1] // self.unit
        brk, end = self.breaks
        span = ([self.placeholder] * cols + [brk]) * lines
        span[-1] = end
        return span

    def length(self, size: Size) -> int:
        # counted, not listed: a processed-ahead image_size of 10**6 x 10**6 is refused by
        # fits(), not by a terabyte list
        assert size is not None and len(size) == 2
        lines, cols = size[0] // self.unit, size[1] // self.unit
        if lines < 1 or cols < 1:
            raise ValueError(f"image_size {size} holds no {self.unit}-pixel line")
        return lines * (cols + 1)

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        assert size is not None
        return (3, size[0], size[1])

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image], patch_size={"height": self.unit, "width": self.unit})
        h, w = (int(v) for v in out["image_sizes"][0])
        if h % self.unit or w % self.unit or min(h, w) < self.unit:
            raise ValueError(
                f"the image processor gave a {h} x {w} image, not multiples of {self.unit}"
            )
        return out["pixel_values"][0][:, :h, :w].float().contiguous(), (h, w)

    def segment(self, loaded: Loaded) -> list[int]:
        return self._lines(loaded[1])

    def place(self, loaded: Loaded, at: int, segment: list[int]) -> list[ImageInput]:
        pixels, size = loaded
        assert size is not None
        n, cols = len(segment), size[1] // self.unit
        return [ImageInput(pixels, at, n, digest(pixels, size), size, break_every=cols + 1)]

    def span(self, m: ImageInput) -> list[int]:
        return self._lines(m.image_size)

    def fits(self, m: ImageInput) -> bool:
        size = m.image_size
        return (
            size is not None
            and len(size) == 2
            and super().fits(m)
            and m.break_every == size[1] // self.unit + 1
        )


class BoundedLayout(Layout):
    """InternVL: tiles [n, 3, S, S] (a grid and, for more than one, a thumbnail), one run of
    `tile_rows` per tile between <img> and </img>; size = (n,). Features (vLLM's
    image_embeds) take a run of their rows between the same bounds."""

    # the image processor's call arguments (InternVLProcessor's tiling)
    run_kwargs: ClassVar[dict[str, Any]] = {"crop_to_patches": True}

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        from paged_engine.multimodal import internvl

        self.config = config
        self.placeholder = placeholder
        self.fixed = None
        self.tile_rows = internvl.patch_tokens(config)
        self.bounds = token_ids(
            tokenizer,
            getattr(tokenizer, "start_image_token", None) or "<img>",
            getattr(tokenizer, "end_image_token", None) or "</img>",
        )

    def length(self, size: Size) -> int:
        if size is None or len(size) != 1 or size[0] <= 0:
            raise ValueError(f"multi_modal_data['image']: image_size {size} is not (tiles,)")
        return size[0] * self.tile_rows

    def _tile_side(self) -> int:
        return _side(self.config)

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        assert size is not None
        return (size[0], 3, self._tile_side(), self._tile_side())

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        tiles = run([image], **self.run_kwargs)["pixel_values"].float()
        if tiles.dim() != 4 or tuple(tiles.shape) != self.pixel_shape((tiles.shape[0],)):
            side = self._tile_side()
            raise _shape_error(tiles, f"[tiles, 3, {side}, {side}]")
        return tiles, (tiles.shape[0],)

    def segment(self, loaded: Loaded) -> list[int]:
        start, end = self.bounds
        return [start, *([self.placeholder] * self.length(loaded[1])), end]

    def place(self, loaded: Loaded, at: int, segment: list[int]) -> list[ImageInput]:
        return super().place(loaded, at + 1, segment)  # after <img>

    def features_segment(self, rows: int) -> tuple[list[int], int]:
        start, end = self.bounds
        return [start, *([self.placeholder] * rows), end], 1


class KimiLayout(Layout):
    """Kimi K2.5: patches [h * w, 3, p, p] (row-major), a run of one <|media_pad|> per m x m
    block of them (multimodal/kimi_k25.py); size = the grid (1, h, w). 1-D positions."""

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        from paged_engine.multimodal import kimi_k25

        self.config = config
        self.placeholder = placeholder
        self.fixed = None
        self.patch = int(config.vision_config.patch_size)
        self.merge = kimi_k25.merge_size(config)

    def length(self, size: Size) -> int:
        if size is None or len(size) != 3 or size[0] != 1 or min(size) <= 0:
            raise ValueError(f"multi_modal_data['image']: image_size {size} is not (1, h, w)")
        if size[1] % self.merge or size[2] % self.merge:
            raise ValueError(f"multi_modal_data['image']: grid {size} is not in merge blocks")
        return size[1] * size[2] // self.merge**2

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        assert size is not None and len(size) == 3
        return (size[1] * size[2], 3, self.patch, self.patch)

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        from paged_engine.multimodal.kimi_k25 import load_image

        pixels, grid = load_image(run, image)
        if tuple(pixels.shape) != self.pixel_shape(grid):
            raise _shape_error(pixels, self.pixel_shape(grid))
        return pixels, grid
