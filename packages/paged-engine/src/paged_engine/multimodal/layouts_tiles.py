"""Tile layouts: an image cut into fixed-size tiles (or views), each tile its own run and
`ImageInput`, the checkpoint's processor's tokens or text around them (layouts.py has the base).

    TileLayout      Idefics3 / SmolVLM: HF's row / column text around each tile's run
    CohereTiles     Command A Vision: <|START_OF_IMG|>, (run, <|IMG_LINE_BREAK|>) per tile
    AyaLayout       Aya Vision: CohereTiles' tiles, HF's text spliced into the decoded prompt
    Idefics2Layout  Idefics2: <fake_token_around_image> around each view's run (text spliced)
    Llama4Layout    Llama 4: tiles with separator tokens, the whole image's run (tokens spliced)
"""

from __future__ import annotations

from typing import Any

import torch

from paged_engine.multimodal import idefics3
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import (
    Layout,
    Loaded,
    Run,
    Size,
    _shape_error,
    _side,
    digest,
    replace_tokens,
    run_starts,
    token_ids,
)


class TileLayout(Layout):
    """Idefics3 / SmolVLM: tiles [3, S, S] (rows x cols, then the whole image), each its own
    run, HF's row / column text around them (tokenized by the model's tokenizer)."""

    takes_embeds = False

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        if tokenizer is None:
            raise ValueError("the tokenizer is needed for Idefics3's image prompts")
        self.config = config
        self.placeholder = placeholder
        self.tokenizer = tokenizer
        self.fixed = None
        self.tile = idefics3.tile_tokens(config)

    def length(self, size: Size) -> int:
        return self.tile

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([[image]], return_row_col_info=True)
        rows, cols = int(out["rows"][0][0]), int(out["cols"][0][0])
        pixels = out["pixel_values"][0].float()
        views = rows * cols + 1 if rows or cols else 1
        side = _side(self.config)
        if tuple(pixels.shape) != (views, 3, side, side):
            raise _shape_error(pixels, f"{(views, 3, side, side)} ({rows} x {cols} tiles + 1)")
        return pixels, (rows, cols)

    def segment(self, loaded: Loaded) -> list[int]:
        rows, cols = loaded[1]  # type: ignore[misc]
        text = idefics3.image_prompt(rows, cols, self.tile)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def place(self, loaded: Loaded, at: int, segment: list[int]) -> list[ImageInput]:
        tiles = loaded[0].unbind(0)
        starts = [at + i for i in run_starts(segment, self.placeholder)]
        if len(starts) != len(tiles):  # the tokenizer did not keep <image> whole
            raise ValueError(
                f"an image's prompt holds {len(starts)} image runs for {len(tiles)} tiles: "
                "check the tokenizer's image tokens"
            )
        return [
            ImageInput(p, s, self.tile, digest(p, None)) for p, s in zip(tiles, starts, strict=True)
        ]


class CohereTiles(TileLayout):
    """Command A Vision: tiles [3, S, S] (the processor's crops, the whole image last when
    more than one), <|START_OF_IMG|> (run, <|IMG_LINE_BREAK|>) x tiles <|END_OF_IMG|>."""

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        from paged_engine.multimodal import aya_vision as aya

        self.config = config
        self.placeholder = placeholder
        self.tokenizer = tokenizer
        self.fixed = None
        self.tile = aya.tile_tokens(config)
        self.bounds = token_ids(tokenizer, aya.START, aya.END, aya.LINE_BREAK)

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        tiles = run([image], crop_to_patches=True)["pixel_values"].float()
        side = _side(self.config)
        if tiles.dim() != 4 or tuple(tiles.shape[1:]) != (3, side, side) or not len(tiles):
            raise _shape_error(tiles, f"[tiles, 3, {side}, {side}]")
        return tiles, (tiles.shape[0],)

    def segment(self, loaded: Loaded) -> list[int]:
        start, end, brk = self.bounds
        tiles = loaded[1][0]  # type: ignore[index]
        return [start, *([self.placeholder] * self.tile + [brk]) * tiles, end]


class AyaLayout(CohereTiles):
    """Aya Vision: each "<image>" of the prompt's text (a token or not) becomes
    AyaVisionProcessor's text (aya_vision.aya_prompt), spliced into the decoded prompt and
    tokenized again, as HF does on the text. A segment lies between special tokens
    (<|START_OF_IMG|> ... <|END_OF_IMG|>), so its tokens are the same wherever it lands."""

    def segment(self, loaded: Loaded) -> list[int]:
        from paged_engine.multimodal.aya_vision import aya_prompt

        text = aya_prompt(loaded[1][0], self.tile)  # type: ignore[index]
        return self.tokenizer.encode(text, add_special_tokens=False)

    @property
    def marker(self) -> int:
        from paged_engine.multimodal.aya_vision import MARKER

        return self.tokenizer.get_vocab().get(MARKER, -1)

    def splice(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        from paged_engine.multimodal.aya_vision import MARKER

        tok, tid = self.tokenizer, self.placeholder

        def text(part: list[int]) -> str:
            return tok.decode(part, skip_special_tokens=False, clean_up_tokenization_spaces=False)

        pieces = text(ids).split(MARKER)
        if len(pieces) != len(segments) + 1 or tid in ids:
            raise ValueError(
                f"multi_modal_data['image'] has {len(segments)} image(s) but the prompt has "
                f"{len(pieces) - 1} {MARKER} placeholder(s) of its own: put one per image "
                "where it belongs"
            )
        joined = [p for piece, s in zip(pieces, segments) for p in (piece, text(s))]
        out = tok.encode("".join([*joined, pieces[-1]]), add_special_tokens=False)
        starts, at = [], 0
        for segment in segments:  # in order, each where its first token begins it
            while at < len(out) and out[at : at + len(segment)] != segment:
                at += 1
            if at >= len(out):
                raise ValueError("the tokenizer did not keep Aya Vision's image tokens whole")
            starts.append(at)
            at += len(segment)
        if out.count(tid) != sum(s.count(tid) for s in segments):
            raise ValueError("the prompt's text holds image tokens of its own")
        return out, starts


class Idefics2Layout(Layout):
    """Idefics2: views [3, h, w] (the crops, then the whole image, with do_image_splitting),
    each its own run of n <image>; a user's <image> becomes Idefics2Processor's text
    (idefics2.prompt_text), run on the decoded prompt and tokenized again. Loaded: the
    processor's padded views and each view's (h, w), flattened; a view's image_size (h, w)."""

    takes_embeds = False

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        from paged_engine.multimodal import idefics2

        self.config = config
        self.placeholder = placeholder
        self.tokenizer = tokenizer
        self.fixed = None  # the user's <image> is the placeholder: never a plain run
        self.n = idefics2.image_tokens(config)
        self.fake = token_ids(tokenizer, idefics2.FAKE)[0]

    def length(self, size: Size) -> int:
        return self.n

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        if size is None or len(size) != 2 or min(size) <= 0:
            raise ValueError(f"multi_modal_data['image']: image_size {size} is not its (h, w)")
        return (3, size[0], size[1])

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([[image]])
        views = out["pixel_values"][0].float()
        if views.dim() != 4 or views.shape[1] != 3:
            raise _shape_error(views, "[views, 3, H, W]")
        masks = out.get("pixel_attention_mask")  # none with do_pad off: views unpadded
        masks = torch.ones(views.shape[0], *views.shape[2:]) if masks is None else masks[0]
        if tuple(masks.shape) != (views.shape[0], *views.shape[2:]):
            raise _shape_error(masks, f"{(views.shape[0], *views.shape[2:])} (the mask)")
        sizes = [(int(m[:, 0].sum()), int(m[0].sum())) for m in masks]  # padding: bottom, right
        return views, tuple(x for hw in sizes for x in hw)

    def segment(self, loaded: Loaded) -> list[int]:
        views = loaded[0].shape[0]
        return [self.fake, *([self.placeholder] * self.n + [self.fake]) * views]

    def place(self, loaded: Loaded, at: int, segment: list[int]) -> list[ImageInput]:
        views, sizes = loaded
        assert sizes is not None
        out = []
        for i, start in enumerate(run_starts(segment, self.placeholder)):
            h, w = sizes[2 * i], sizes[2 * i + 1]
            view = views[i, :, :h, :w].contiguous()
            out.append(ImageInput(view, at + start, self.n, digest(view, (h, w)), (h, w)))
        return out

    def splice(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        """The decoded prompt with Idefics2Processor's replacement, tokenized again; a
        segment starts at the <fake_token_around_image> before its first run (one a
        neighbouring image's may share)."""
        from paged_engine.multimodal.idefics2 import IMAGE, prompt_text

        tok, tid = self.tokenizer, self.placeholder
        text = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        marks = text.count(IMAGE)
        if marks != len(segments) or ids.count(tid) != len(segments):
            raise ValueError(
                f"multi_modal_data['image'] has {len(segments)} image(s) but the prompt has "
                f"{marks} {IMAGE} placeholder(s): put one per image where it belongs"
            )
        views = [s.count(tid) // self.n for s in segments]
        out = tok.encode(prompt_text(text, marks, views, self.n), add_special_tokens=False)
        runs = run_starts(out, tid)
        if len(runs) != sum(views) or any(out[r - 1] != self.fake for r in runs):
            raise ValueError("the tokenizer did not keep Idefics2's image tokens whole")
        firsts = [sum(views[:i]) for i in range(len(views))]
        return out, [runs[k] - 1 for k in firsts]


class Llama4Layout(TileLayout):
    """Llama 4: tiles [3, S, S] (rows x cols, then the whole image when more than one), each
    its own run of <|patch|>; a user's <|image|> becomes Llama4Processor's special tokens
    around them (llama4.image_tokens: no text merges across them, so tokens are spliced);
    size = (rows, cols)."""

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        from paged_engine.multimodal import llama4

        self.config = config
        self.placeholder = placeholder
        self.tokenizer = tokenizer
        self.fixed = None
        self.tile = llama4.tile_tokens(config)
        names = (llama4.START, llama4.END, llama4.IMAGE, llama4.TILE_X, llama4.TILE_Y)
        self.ids = dict(zip(names, token_ids(tokenizer, *names), strict=True))
        if placeholder in self.ids.values():
            raise ValueError(f"image_token_index={placeholder} must be <|patch|>'s id")

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image])
        rows, cols = (int(v) for v in out["aspect_ratios"][0])
        pixels = out["pixel_values"].float()
        views = rows * cols + 1 if rows * cols > 1 else 1
        side = _side(self.config)
        if tuple(pixels.shape) != (views, 3, side, side):
            raise _shape_error(pixels, f"{(views, 3, side, side)} ({rows} x {cols} tiles)")
        return pixels, (rows, cols)

    def segment(self, loaded: Loaded) -> list[int]:
        from paged_engine.multimodal.llama4 import image_tokens

        rows, cols = loaded[1]  # type: ignore[misc]
        return image_tokens(rows, cols, self.tile, self.placeholder, self.ids)

    @property
    def marker(self) -> int:
        from paged_engine.multimodal.llama4 import IMAGE

        return self.ids[IMAGE]

    def splice(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        """Each <|image|> replaced by its image's tokens; ValueError unless there is one per
        image and the prompt holds no <|patch|> of its own."""
        mark = self.marker
        marks = [i for i, t in enumerate(ids) if t == mark]
        if len(marks) != len(segments) or self.placeholder in ids:
            raise ValueError(
                f"multi_modal_data['image'] has {len(segments)} image(s) but the prompt has "
                f"{len(marks)} <|image|> token(s) (id {mark}) and "
                f"{ids.count(self.placeholder)} <|patch|> of its own: put one <|image|> per "
                "image where it belongs"
            )
        return replace_tokens(ids, marks, segments)
