"""Slice layouts: an image as a thumbnail and a grid of slices at their own sizes, each view its
own run and `ImageInput`, marker tokens around them spliced as tokens (layouts.py has the base).

    MiniCPMVLayout        MiniCPM-V 4.6: <image_id>k</image_id>, the thumbnail in <image>,
                          slices in <slice>, rows joined by "\n"
    MiniCPMVCanvasLayout  MiniCPM-V 4.7: the same, canvas M-RoPE positions
    Lfm2VlLayout          LFM2-VL: <|img_row_R_col_C|> before each tile, <|img_thumbnail|>
"""

from __future__ import annotations

from typing import Any

import torch

from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import (
    Layout,
    Loaded,
    Run,
    Size,
    _shape_error,
    digest,
    run_starts,
    token_ids,
)


class MiniCPMVLayout(Layout):
    """MiniCPM-V 4.6: views [3, p, h * w * p] (the thumbnail, then rows x cols slices), each
    its own run; the k-th image token becomes MiniCPMV4_6Processor's <image_id>k</image_id>
    and markers around the runs (minicpmv.image_segment; all special, so spliced as tokens).
    Loaded: the packed views and (rows, cols, h0, w0, h1, w1, ...); a view's size (h, w)."""

    takes_embeds = False

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        from paged_engine.multimodal import minicpmv

        minicpmv.check_config(config)
        self.config = config
        self.placeholder = placeholder
        self.tokenizer = tokenizer
        self.fixed = None
        self.patch = int(config.vision_config.patch_size)
        names = {k: getattr(tokenizer, k, None) or v for k, v in minicpmv.MARKERS.items()}
        self.ids = dict(zip(names, token_ids(tokenizer, *names.values()), strict=True))
        self.newline = tokenizer.encode("\n", add_special_tokens=False)
        self.use_id: bool | None = None  # the image processor's use_image_id, read at load

    def length(self, size: Size) -> int:
        from paged_engine.multimodal.minicpmv import view_tokens

        if size is None or len(size) not in (2, 3):  # 3: a 4.7 thumbnail's (h, w, tail)
            raise ValueError(f"multi_modal_data['image']: image_size {size} is not (h, w)")
        return view_tokens(self.config, size[0], size[1])

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        assert size is not None and len(size) in (2, 3)
        return (3, self.patch, size[0] * size[1] * self.patch)

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image])
        pixels, grids = out["pixel_values"][0].float(), out["target_sizes"].tolist()
        rows, cols = (int(v) for v in out["grids"][0])
        views = 1 + rows * cols
        width = sum(h * w for h, w in grids) * self.patch
        if len(grids) != views or tuple(pixels.shape) != (3, self.patch, width):
            raise _shape_error(pixels, f"(3, {self.patch}, {width}) ({views} views)")
        for h, w in grids:
            self.length((h, w))
        return pixels, (rows, cols, *(int(x) for hw in grids for x in hw))

    def _views(self, loaded: Loaded) -> list[tuple[int, int]]:
        size = loaded[1]
        assert size is not None
        return [(size[i], size[i + 1]) for i in range(2, len(size), 2)]

    def segment(self, loaded: Loaded) -> list[int]:
        from paged_engine.multimodal.minicpmv import image_segment

        rows, cols = loaded[1][:2]  # type: ignore[index]
        runs = [self.length(v) for v in self._views(loaded)]
        return image_segment(runs, rows, cols, self.placeholder, self.ids, self.newline)

    def place(self, loaded: Loaded, at: int, segment: list[int]) -> list[ImageInput]:
        out, column = [], 0
        for (h, w), start in zip(
            self._views(loaded), run_starts(segment, self.placeholder), strict=True
        ):
            view = loaded[0][..., column : column + h * w * self.patch].contiguous()
            column += h * w * self.patch
            n = self.length((h, w))
            out.append(ImageInput(view, at + start, n, digest(view, (h, w)), (h, w)))
        return out

    def splice(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        """Each lone image token -> <image_id>k</image_id> (with use_image_id) + segment."""
        if self.use_id is None:  # the checkpoint's image processor's (the processor's default)
            from transformers import AutoImageProcessor

            hf = AutoImageProcessor.from_pretrained(self.config._name_or_path)
            self.use_id = bool(getattr(hf, "use_image_id", True))
        heads = [
            [
                self.ids["image_id_start_token"],
                *self.tokenizer.encode(str(k), add_special_tokens=False),
                self.ids["image_id_end_token"],
            ]
            if self.use_id
            else []
            for k in range(len(segments))
        ]
        out, starts = super().splice(ids, [h + s for h, s in zip(heads, segments, strict=True)])
        return out, [at + len(h) for at, h in zip(starts, heads, strict=True)]


class MiniCPMVCanvasLayout(MiniCPMVLayout):
    """MiniCPM-V 4.7: 4.6's views and prompt, and canvas M-RoPE positions for the decoder
    (minicpmv.canvas_positions). Those depend on the marker tokens right after an image (a
    frame's end runs on over them), so a thumbnail's size is (h, w, tail): the markers after
    its image's last closing one, counted by `splice`. A segment starts with -1 (no token),
    so the processor never takes a prompt as expanded already and `splice` sees every one."""

    mrope = True

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        super().__init__(config, placeholder, tokenizer)
        fields = ("slice_start_id", "slice_end_id", "image_start_id", "image_end_id")
        marks = [getattr(config, f, None) for f in (*fields, "newline_id")]
        missing = [f for f, v in zip((*fields, "newline_id"), marks, strict=True) if v is None]
        if missing:
            raise ValueError(f"{missing[0]} is not set: MiniCPM-V 4.7's images need it")
        self.marks = tuple(int(v) for v in marks)  # type: ignore[arg-type]
        self._tails: dict[int, int] = {}  # id(segment) -> its tail, from splice to place

    def segment(self, loaded: Loaded) -> list[int]:
        return [-1, *super().segment(loaded)]

    def splice(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        from paged_engine.multimodal.minicpmv import find_segments

        real = [s[1:] for s in segments]
        found = find_segments(ids, real, self.placeholder)
        out, starts = (ids, found) if found is not None else super().splice(ids, real)
        for segment, body, at in zip(segments, real, starts, strict=True):
            end = tail = at + len(body)
            while tail < len(out) and out[tail] in self.marks:
                tail += 1
            self._tails[id(segment)] = tail - end
        return out, starts

    def place(self, loaded: Loaded, at: int, segment: list[int]) -> list[ImageInput]:
        import dataclasses

        views = super().place(loaded, at, segment[1:])
        thumb = views[0]
        assert thumb.image_size is not None
        size = (*thumb.image_size, self._tails.pop(id(segment)))
        return [dataclasses.replace(thumb, image_size=size), *views[1:]]

    def positions(self, num_tokens: int, images: tuple[ImageInput, ...]) -> Any:
        """The canvas table over the prompt's ids as far as the views fix them: the crops,
        their markers, newlines between slice rows, each frame's tail; text elsewhere."""
        from paged_engine.multimodal.minicpmv import canvas_positions, merge_factor
        from paged_engine.multimodal.mrope import MropePositions

        slice_start, slice_end, image_start, image_end, newline = self.marks
        ids = [-1] * num_tokens
        tail_at, tail = 0, 0
        prev: ImageInput | None = None
        for m in images:
            assert m.image_size is not None
            if len(m.image_size) == 3:  # a thumbnail opens a frame: the last one's tail first
                ids[tail_at : tail_at + tail] = [newline] * tail
                ids[m.offset - 1], ids[m.end], tail = image_start, image_end, m.image_size[2]
            else:
                ids[m.offset - 1], ids[m.end] = slice_start, slice_end
                if prev is not None and len(prev.image_size or ()) == 2:
                    ids[prev.end + 1 : m.offset - 1] = [newline] * (m.offset - 2 - prev.end)
            ids[m.offset : m.end] = [self.placeholder] * m.length
            tail_at, prev = m.end + 1, m
        ids[tail_at : tail_at + tail] = [newline] * tail
        grids = [m.image_size[:2] for m in images if m.image_size is not None]
        merge = merge_factor(self.config)
        table = canvas_positions(ids, self.placeholder, grids, self.marks, merge)
        first = images[0].offset - 1 if images else num_tokens
        return MropePositions(table, first, int(table.max()) + 1 - num_tokens)


class Lfm2VlLayout(Layout):
    """LFM2-VL: views (tiles row-major then the thumbnail, or the one resized image) as patches
    [h * w, 3 * p * p], each its own run of (h / f) * (w / f) <image>; a user's <image> becomes
    Lfm2VlProcessor's special tokens around them (lfm2_vl.py; all special, so spliced as
    tokens). Loaded: the views' patches concatenated, size (rows, cols, h_1, w_1, ...); a
    view's image_size its grid (h, w)."""

    takes_embeds = False

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        from paged_engine.multimodal import lfm2_vl

        self.config = config
        self.placeholder = placeholder
        self.tokenizer = tokenizer
        self.fixed = None
        self.factor = int(config.downsample_factor)
        channels = int(getattr(config.vision_config, "num_channels", 3))
        self.patch_dim = channels * lfm2_vl.patch_size(config) ** 2
        self.bounds = token_ids(tokenizer, lfm2_vl.START, lfm2_vl.END, lfm2_vl.THUMBNAIL)
        self.settings: dict[str, Any] | None = None  # the saved processor settings, read once

    def check_kwargs(self, kwargs: dict[str, Any]) -> None:
        """A request's mm_processor_kwargs refused by name before any pixel is made
        (lfm2_vl_processor.check_kwargs: pixel and tile bounds, the model's patch sizes)."""
        from paged_engine.multimodal import lfm2_vl_processor as lp
        from paged_engine.multimodal.torch_processors import saved_settings

        if kwargs and self.settings is None:
            path = getattr(self.config, "name_or_path", "") or "."
            self.settings = {**lp.Lfm2VlTorchProcessor.defaults, **saved_settings(path)}
        lp.check_kwargs(kwargs, self.settings or {}, self.config)

    def length(self, size: Size) -> int:
        f = self.factor
        if size is None or len(size) != 2 or min(size) <= 0 or size[0] % f or size[1] % f:
            raise ValueError(
                f"multi_modal_data['image']: image_size {size} is not a patch grid of "
                f"{f} x {f} blocks"
            )
        return size[0] * size[1] // f**2

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        assert size is not None and len(size) == 2
        return (size[0] * size[1], self.patch_dim)

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        from paged_engine.multimodal.lfm2_vl import load_image

        views, grids, (rows, cols) = load_image(run, image)
        tiles = rows * cols if rows * cols > 1 else 0
        if len(views) not in (tiles + 1, max(tiles, 1)):
            raise ValueError(f"the image processor gave {len(views)} views for {rows} x {cols}")
        for view, grid in zip(views, grids, strict=True):
            self.length(grid)
            if tuple(view.shape) != self.pixel_shape(grid):
                raise _shape_error(view, self.pixel_shape(grid))
        return torch.cat(views), (rows, cols, *(x for g in grids for x in g))

    def _grids(self, size: Size) -> list[tuple[int, int]]:
        assert size is not None
        return list(zip(size[2::2], size[3::2], strict=True))

    def segment(self, loaded: Loaded) -> list[int]:
        from paged_engine.multimodal.lfm2_vl import tile_token

        rows, cols = loaded[1][:2]  # type: ignore[index]
        grids = self._grids(loaded[1])
        start, end, thumbnail = self.bounds
        runs = [[self.placeholder] * self.length(g) for g in grids]
        if rows * cols <= 1:
            return [start, *runs[0], end]
        names = [tile_token(r + 1, c + 1) for r in range(rows) for c in range(cols)]
        out = [start]
        for tid, run in zip(token_ids(self.tokenizer, *names), runs, strict=False):
            out += [tid, *run]
        if len(runs) > rows * cols:
            out += [thumbnail, *runs[-1]]
        return [*out, end]

    def place(self, loaded: Loaded, at: int, segment: list[int]) -> list[ImageInput]:
        patches, size = loaded
        grids = self._grids(size)
        views = patches.split([h * w for h, w in grids])
        starts = run_starts(segment, self.placeholder)
        return [
            ImageInput(v, at + s, self.length(g), digest(v, g), g)
            for v, g, s in zip(views, grids, starts, strict=True)
        ]
