"""How each wrapper's images enter its prompt (the host side of an image; processor.py runs it).

    layout          an image's <image> token becomes                       ImageInputs
    RunLayout       a run of placeholders: LLaVA 1.5 (fixed), LLaVA-NeXT   one per image
                    (by size), Qwen-VL (by patch grid; M-RoPE positions),
                    EXAONE 4.5 (Exaone45Layout: by patch grid, 1-D positions)
    TileLayout      HF's text around one run per tile (Idefics3, SmolVLM)  one per tile
    LineLayout      lines of [IMG], [IMG_BREAK] between, [IMG_END] last     one per image, its
                    (Pixtral, Mistral 3)                                    breaks skipped
    BoundedLayout   <img>, one run for all tiles, </img> (InternVL)         one per image
    Gemma3Layout    a user's <start_of_image> becomes HF's text around a    one per image,
                    run (Gemma 3; spliced as text, then tokenized)          bidirectional
    Gemma4Layout    <|image>, a run by the patch grid, <image|> (Gemma 4)   one per image,
                    (Gemma4UnifiedLayout: a token per (k p)-pixel patch)    bidirectional
    CohereTiles     <|START_OF_IMG|>, a run and <|IMG_LINE_BREAK|> per     one per tile
                    tile, <|END_OF_IMG|> (Command A Vision)
    AyaLayout       "<image>" in the text becomes HF's: TILE_i before each  one per tile
                    tile's run (Aya Vision; spliced as text, tokenized)
    Idefics2Layout  HF's <fake_token_around_image> around each view's run  one per view
                    (Idefics2; spliced as text, tokenized)
    Llama4Layout    <|image_start|>, a run per tile, separators between,   one per tile
                    <|image|> before the whole image's run,
                    <|image_end|> (Llama 4; tokens spliced)
    KimiLayout      a run of <|media_pad|> by the merged patch grid (Kimi   one per image
                    K2.5; its processor in torch where HF's needs torchvision)
    MiniCPMVLayout  <image_id>k</image_id>, the thumbnail's run in <image>  one per view
                    ... </image>, slice runs in <slice> ... </slice> (rows
                    joined by "\n"; MiniCPM-V 4.6; tokens spliced)
    MiniCPMVCanvasLayout  MiniCPM-V 4.7: the same, canvas M-RoPE positions     one per view
    HunyuanLayout   a run by the merged grid, a break per row, begin / end  one per image
                    (HunyuanOCR; multi-axis rope positions)
    Lfm2VlLayout    <|image_start|>, a run per tile after its               one per view
                    <|img_row_R_col_C|>, <|img_thumbnail|> and the
                    thumbnail's run, <|image_end|> (LFM2-VL; tokens spliced)
    Ovis2_5Layout   image_start, a run by the merged grid, image_end;       one per image
                    the whole segment takes the image's rows (Ovis 2.5;     (with its bounds)
                    tokens spliced)

`load` runs the checkpoint's image processor on one image of a prompt holding `count`
(`run(images, **extra)`: the processor with the request's kwargs, errors as ValueErrors
naming multi_modal_data) and gives its pixel values and size; `segment` the tokens that
replace the image's token; `place` the `ImageInput`s of that segment, given where it starts
in the prompt; `splice` puts the segments where the prompt's image tokens are. `span` is what
a placed image's
positions must hold (images processed ahead are checked against it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch

from paged_engine.multimodal import idefics3, qwen2_vl, qwen_omni
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.llava import tokens_per_image
from paged_engine.multimodal.llava_next import AnyRes

Size = tuple[int, ...] | None
Loaded = tuple[torch.Tensor, Size]  # an image's pixel values and its size (layout-specific)
Run = Callable[..., Any]  # run(images, **extra) -> the image processor's output


def digest(values: torch.Tensor, size: Size) -> str:
    """SHA-256 of the values' bytes, dtype, shape and the image's size (128 bits of it; SHA-256
    runs ~2.5x faster than blake2b on CPUs with SHA instructions)."""
    data = values.detach().cpu().contiguous().view(torch.uint8).numpy()
    h = hashlib.sha256(data)  # (read in place: the array's buffer, no copy)
    h.update(repr((size, values.dtype, tuple(values.shape))).encode())
    return h.hexdigest()[:32]


def token_ids(tokenizer: Any, *tokens: str) -> tuple[int, ...]:
    """The ids of special tokens the tokenizer must hold (ValueError naming the missing)."""
    if tokenizer is None:
        raise ValueError(f"the tokenizer is needed for the image tokens {tokens}")
    vocab = tokenizer.get_vocab()
    missing = [t for t in tokens if t not in vocab]
    if missing:
        raise ValueError(f"the tokenizer has no {missing[0]} token, which images need")
    return tuple(vocab[t] for t in tokens)


def run_starts(ids: list[int], placeholder: int) -> list[int]:
    """Where each run of `placeholder` tokens starts in `ids`."""
    return [
        i for i, t in enumerate(ids) if t == placeholder and (i == 0 or ids[i - 1] != placeholder)
    ]


def replace_tokens(
    ids: list[int], at: list[int], segments: list[list[int]]
) -> tuple[list[int], list[int]]:
    """(`ids` with the token at each index of `at` (ascending) replaced by its segment, where
    each segment starts in them)."""
    out: list[int] = []
    starts: list[int] = []
    last = 0
    for i, segment in zip(at, segments, strict=True):
        out += ids[last:i]
        starts.append(len(out))
        out += segment
        last = i + 1
    return out + ids[last:], starts


def expand_runs(
    ids: list[int], token: int, lengths: list[int], what: str
) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """Each lone `token` -> a run of its item's length (a run already that long stays): (the
    ids, each run's start in them, (where in `ids`, tokens added) of each run); ValueError
    unless there is one placeholder or run per item."""
    runs: list[tuple[int, int]] = []  # (start, length)
    for i, t in enumerate(ids):
        if t != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    if len(runs) != len(lengths) or any(
        length not in (1, n) for (_, length), n in zip(runs, lengths)
    ):
        found = ", ".join(str(length) for _, length in runs) or "none"
        want = ", ".join(str(n) for n in lengths)
        raise ValueError(
            f"multi_modal_data['{what}'] has {len(lengths)} {what}(s) but the prompt has "
            f"{len(runs)} {what} placeholder(s) (token id {token}; runs of {found} tokens): put "
            f"one {what} token per {what} where it belongs (or runs of {want})"
        )
    out: list[int] = []
    starts: list[int] = []
    last = 0
    for (start, length), n in zip(runs, lengths):
        out += ids[last:start]
        starts.append(len(out))
        out += [token] * n
        last = start + length
    added = [(start, n - length) for (start, length), n in zip(runs, lengths)]
    return out + ids[last:], starts, added


def _side(config: Any) -> int:
    size = config.vision_config.image_size
    return int(size[0] if isinstance(size, (list, tuple)) else size)


def _shape_error(got: torch.Tensor, want: Any) -> ValueError:
    return ValueError(
        f"the image processor gave pixel values of shape {tuple(got.shape)}, not {want}: check "
        "preprocessor_config.json"
    )


class Layout:
    """LLaVA 1.5: every image a run of `tokens_per_image` placeholders, pixels [3, S, S]."""

    takes_embeds = True  # vLLM's image features input (a run of the features' rows)
    mrope = False  # the decoder's positions follow the images (Qwen-VL)
    by_count = False  # an image's pixels depend on how many the prompt holds (OneVision)
    bidirectional = False  # an image's tokens attend to each other both ways (Gemma 3)

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        self.config = config
        self.placeholder = placeholder
        self.fixed: int | None = tokens_per_image(config)  # None: each image's own length

    def length(self, size: Size) -> int:
        assert self.fixed is not None
        return self.fixed

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        return (3, _side(self.config), _side(self.config))

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        pixels = run([image])["pixel_values"][0].float()
        if tuple(pixels.shape) != self.pixel_shape(None):
            raise _shape_error(pixels, self.pixel_shape(None))
        return pixels, None

    def segment(self, loaded: Loaded) -> list[int]:
        return [self.placeholder] * self.length(loaded[1])

    def place(self, loaded: Loaded, at: int, segment: list[int]) -> list[ImageInput]:
        pixels, size = loaded
        return [ImageInput(pixels, at, self.length(size), digest(pixels, size), size)]

    @property
    def marker(self) -> int:
        """The token a prompt writes for an image (before `splice`)."""
        return self.placeholder

    def features_segment(self, rows: int) -> tuple[list[int], int]:
        """(the tokens an image given as `rows` feature rows becomes, where its run starts in
        them), for layouts that take features (`takes_embeds`)."""
        return [self.placeholder] * rows, 0

    def splice(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        """(each lone image token replaced by its image's segment, where the segments start);
        ValueError naming multi_modal_data unless there is one such token per image."""
        tid = self.placeholder
        lone = [i for i, t in enumerate(ids) if t == tid]
        runs = run_starts(ids, tid)
        if len(lone) != len(segments) or len(runs) != len(lone):
            raise ValueError(
                f"multi_modal_data['image'] has {len(segments)} image(s) but the prompt has "
                f"{len(runs)} image placeholder(s) (token id {tid}): put one image token per "
                "image where it belongs"
            )
        return replace_tokens(ids, lone, segments)

    def span(self, m: ImageInput) -> list[int]:
        return [self.placeholder] * m.length

    def fits(self, m: ImageInput) -> bool:
        """Whether a processed image's pixels and run are what this model reads for its size."""
        try:
            length, shape = self.length(m.image_size), self.pixel_shape(m.image_size)
        except (AssertionError, TypeError, ValueError, IndexError):
            return False
        pixels = m.pixel_values
        return pixels is not None and m.length == length and tuple(pixels.shape) == shape

    def positions(self, num_tokens: int, images: tuple[ImageInput, ...]) -> Any:
        return None


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


class QwenLayout(Layout):
    """Qwen2-VL / 2.5-VL / 3-VL / 3.5: patch rows [t*h*w, 3 * tp * p * p], a run of one
    placeholder per merged patch; the prompt's M-RoPE positions (multimodal/mrope.py)."""

    mrope = True

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        qwen2_vl.check_config(config)
        self.config = config
        self.placeholder = placeholder
        self.fixed = None

    def length(self, size: Size) -> int:
        if size is None or len(size) != 3 or min(size) <= 0:
            raise ValueError(
                f"multi_modal_data['image']: image_size {size} is not a patch grid (t, h, w)"
            )
        return qwen2_vl.tokens(self.config, size)

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        assert size is not None and len(size) == 3
        return (size[0] * size[1] * size[2], qwen2_vl.patch_dim(self.config))

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image])
        t, h, w = (int(v) for v in out["image_grid_thw"][0])
        pixels = out["pixel_values"].float()
        if tuple(pixels.shape) != self.pixel_shape((t, h, w)):
            raise _shape_error(pixels, self.pixel_shape((t, h, w)))
        return pixels, (t, h, w)

    def positions(self, num_tokens: int, images: tuple[ImageInput, ...]) -> Any:
        return qwen2_vl.mrope_positions(num_tokens, images, qwen2_vl.merge_size(self.config))


class OmniLayout(QwenLayout):
    """The Qwen2.5-Omni / Qwen3-Omni thinkers: Qwen2-VL's runs and M-RoPE table, their rotary
    checked (multimodal/qwen_omni.py)."""

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        qwen_omni.check_config(config)
        super().__init__(config, placeholder, tokenizer)

    def length(self, size: Size) -> int:
        if size is not None and len(size) == 3 and size[0] != 1:  # (image_embeds' own grids)
            raise ValueError(
                f"multi_modal_data['image']: image_size {size}: an image of "
                f"{self.config.architectures[0]} is one temporal patch (t = 1)"
            )
        return super().length(size)


class Exaone45Layout(QwenLayout):
    """EXAONE 4.5: Qwen2-VL's patch rows and runs; its decoder rotates by plain 1-D sequence
    positions (Exaone4_5_Model: arange), so no M-RoPE table (multimodal/exaone4_5.py)."""

    mrope = False

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        if qwen2_vl.merge_size(config) < 1:
            raise ValueError("vision_config.spatial_merge_size must be at least 1")
        self.config = config
        self.placeholder = placeholder
        self.fixed = None

    def positions(self, num_tokens: int, images: tuple[ImageInput, ...]) -> Any:
        return None


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
        return len(self._lines(size))

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

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        assert size is not None
        return (size[0], 3, _side(self.config), _side(self.config))

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image], crop_to_patches=True)  # what InternVLProcessor asks for
        tiles = out["pixel_values"].float()
        if tiles.dim() != 4 or tuple(tiles.shape) != self.pixel_shape((tiles.shape[0],)):
            side = _side(self.config)
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


def _split_tokens() -> ValueError:
    return ValueError(
        "the tokenizer did not keep Gemma 3's image tokens whole (<start_of_image>, "
        "<image_soft_token>, <end_of_image> must be special tokens)"
    )


class Gemma3Layout(Layout):
    """Gemma 3: pixels [1 + crops, 3, S, S] (the image, then its pan-and-scan crops when the
    processor makes any); a user's <start_of_image> (boi) becomes, as text (HF's processor
    replaces it in the string, so newlines merge with their neighbours'), one run
    "\n\n<start_of_image>" + <image_soft_token> x n + "<end_of_image>\n\n" per view (with
    crops, HF's "Here is the original image ... and here are some crops ..." around them).
    Each view is one `ImageInput` whose tokens attend to each other both ways. Between a
    segment's first <start_of_image> and its end everything sits between special tokens, so
    its tokens from there to its last <end_of_image> are the same wherever the segment lands."""

    takes_embeds = False
    bidirectional = True

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        from paged_engine.multimodal.gemma3 import image_tokens

        if tokenizer is None:
            raise ValueError("the tokenizer is needed for Gemma 3's image prompts")
        self.config = config
        self.placeholder = placeholder
        self.tokenizer = tokenizer
        self.fixed = image_tokens(config)
        self.boi = int(config.boi_token_index)
        self.eoi = int(config.eoi_token_index)
        boi, soft, eoi = tokenizer.convert_ids_to_tokens([self.boi, placeholder, self.eoi])
        self.view_text = f"\n\n{boi}{soft * self.fixed}{eoi}\n\n"

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image])
        crops = int(out["num_crops"][0]) if "num_crops" in out else 0
        views = out["pixel_values"].float()
        side = _side(self.config)
        if tuple(views.shape) != (1 + crops, 3, side, side):
            raise _shape_error(views, f"[{1 + crops}, 3, {side}, {side}] ({crops} crops)")
        return views, (crops,)

    def _text(self, crops: int) -> str:
        if not crops:
            return self.view_text
        return (  # Gemma3Processor's wording
            f"Here is the original image {self.view_text} and here are some crops to help you "
            "see better " + " ".join([self.view_text] * crops)
        )

    def segment(self, loaded: Loaded) -> list[int]:
        crops = loaded[1][0] if loaded[1] else 0  # type: ignore[index]
        return self.tokenizer.encode(self._text(crops), add_special_tokens=False)

    def place(self, loaded: Loaded, at: int, segment: list[int]) -> list[ImageInput]:
        views = loaded[0]
        runs = run_starts(segment, self.placeholder)
        if len(runs) != views.shape[0]:
            raise _split_tokens()
        n = self.length(None)
        return [
            ImageInput(v, at + r, n, digest(v, None), bidirectional=True)
            for v, r in zip(views.unbind(0), runs, strict=True)
        ]

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        return (3, _side(self.config), _side(self.config))  # one view

    def fits(self, m: ImageInput) -> bool:
        return m.bidirectional and super().fits(m)

    @property
    def marker(self) -> int:
        return self.boi

    def splice(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        """Each <start_of_image> not followed by its run replaced in the prompt's text (decoded
        with its special tokens, then tokenized again: HF's ids for a text prompt). A segment's
        start is placed by its first <start_of_image>."""
        boi, tid = self.boi, self.placeholder
        marks = [i for i, t in enumerate(ids) if t == boi and ids[i + 1 : i + 2] != [tid]]
        if len(marks) != len(segments) or tid in ids:
            raise ValueError(
                f"multi_modal_data['image'] has {len(segments)} image(s) but the prompt has "
                f"{len(marks)} <start_of_image> token(s) (id {boi}) of its own: put one per "
                "image where it belongs"
            )
        tok = self.tokenizer

        def text(part: list[int]) -> str:
            return tok.decode(part, skip_special_tokens=False, clean_up_tokenization_spaces=False)

        pieces, last = [], 0
        for i, segment in zip(marks, segments, strict=True):
            pieces += [text(ids[last:i]), text(segment)]
            last = i + 1
        pieces.append(text(ids[last:]))
        out = tok.encode("".join(pieces), add_special_tokens=False)
        runs = run_starts(out, tid)
        starts, k = [], 0
        for segment in segments:  # its first run in `out`, less where it sits in the segment
            first = segment.index(boi)
            tail = segment[first : len(segment) - segment[::-1].index(self.eoi)]
            at = runs[k] - 1 if k < len(runs) else -1
            if at < 0 or out[at : at + len(tail)] != tail:
                raise _split_tokens()
            starts.append(at - first)
            k += len(run_starts(segment, tid))
        if k != len(runs):
            raise ValueError("the prompt's text holds image tokens of its own")
        return out, starts


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


class HunyuanLayout(QwenLayout):
    """HunyuanOCR: patch rows [h * w, C * p * p] (row-major), size the grid (1, h, w); a run
    of (h/m) * (w/m + 1) + 2 placeholders (a break per merged row, the begin / end rows) and
    multi-axis rope positions (multimodal/hunyuan_vl.py)."""

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        self.config = config
        self.placeholder = placeholder
        self.fixed = None

    def length(self, size: Size) -> int:
        from paged_engine.multimodal import hunyuan_vl

        if size is None or len(size) != 3 or size[0] != 1 or min(size) <= 0:
            raise ValueError(f"multi_modal_data['image']: image_size {size} is not (1, h, w)")
        return hunyuan_vl.tokens(self.config, size)

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        assert size is not None and len(size) == 3
        v = self.config.vision_config
        return (size[1] * size[2], int(v.num_channels) * int(v.patch_size) ** 2)

    def positions(self, num_tokens: int, images: tuple[ImageInput, ...]) -> Any:
        from paged_engine.multimodal import hunyuan_vl

        return hunyuan_vl.positions(num_tokens, images, hunyuan_vl.merge_size(self.config))


class Gemma4Layout(Layout):
    """Gemma 4: an image's patches [h * w, 3 * p * p] (the processor's aspect-kept resize to an
    h x w patch grid, its padding rows dropped), size (h, w); its <|image|> becomes <|image> +
    <|image|> x (h * w / k^2) + <image|> (HF's processor replaces the token in the text; all
    three are special, so this is the same on the ids). With use_bidirectional_attention
    "vision" its `ImageInput` is `bidirectional`, so one step must hold the run; runs differ by
    image, so the layout's own flag (the engine's start-time check of one fixed run against
    max_num_batched_tokens) stays off and a longer run is refused when its request comes in
    (engine/input_processor.py)."""

    takes_embeds = False

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        from paged_engine.multimodal import gemma4

        gemma4.check_config(config)
        self.config = config
        self.placeholder = placeholder
        self.bounds = (int(config.boi_token_id), int(config.eoi_token_id))
        self.two_way = gemma4.bidirectional(config)  # the ImageInputs' `bidirectional`
        self.fixed = None

    def length(self, size: Size) -> int:
        from paged_engine.multimodal import gemma4

        if size is None or len(size) != 2 or min(size) <= 0:
            raise ValueError(f"multi_modal_data['image']: image_size {size} is not a patch grid")
        return gemma4.image_tokens(self.config, size)

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        from paged_engine.multimodal import gemma4

        assert size is not None and len(size) == 2
        return (size[0] * size[1], gemma4.patch_dim(self.config))

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image])
        where = out["image_position_ids"][0]  # [max patches, 2] (column, row); -1: padding
        real = int((where >= 0).all(-1).sum())
        w, h = (int(v) + 1 for v in where[:real].amax(0))
        pixels = out["pixel_values"][0][:real].float()
        if real != h * w or tuple(pixels.shape) != self.pixel_shape((h, w)):
            raise _shape_error(pixels, self.pixel_shape((h, w)))
        n = self.length((h, w))
        if n != int(out["num_soft_tokens_per_image"][0]):
            raise ValueError(
                f"the image processor's pooling_kernel_size gives other soft tokens than the "
                f"tower's {n}: check preprocessor_config.json"
            )
        return pixels.contiguous(), (h, w)

    def segment(self, loaded: Loaded) -> list[int]:
        start, end = self.bounds
        return [start, *([self.placeholder] * self.length(loaded[1])), end]

    def place(self, loaded: Loaded, at: int, segment: list[int]) -> list[ImageInput]:
        pixels, size = loaded
        n = self.length(size)
        return [
            ImageInput(pixels, at + 1, n, digest(pixels, size), size, bidirectional=self.two_way)
        ]

    def fits(self, m: ImageInput) -> bool:
        return m.bidirectional == self.two_way and super().fits(m)


class Gemma4UnifiedLayout(Gemma4Layout):
    """Gemma 4 Unified: Gemma 4's prompt and two-way runs, one soft token per model patch of
    (k p)^2 pixels: patches [h * w, 3 (k p)^2], size (h, w) in model patches, h * w tokens
    (multimodal/gemma4_unified.py)."""

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        from paged_engine.multimodal import gemma4, gemma4_unified

        gemma4_unified.check_config(config)
        self.config = config
        self.placeholder = placeholder
        self.bounds = (int(config.boi_token_id), int(config.eoi_token_id))
        self.two_way = gemma4.bidirectional(config)
        self.fixed = None

    def length(self, size: Size) -> int:
        from paged_engine.multimodal import gemma4_unified

        if size is None or len(size) != 2 or min(size) <= 0:
            raise ValueError(f"multi_modal_data['image']: image_size {size} is not a patch grid")
        return gemma4_unified.image_tokens(self.config, size)

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        from paged_engine.multimodal import gemma4_unified

        assert size is not None and len(size) == 2
        return (size[0] * size[1], gemma4_unified.patch_dim(self.config))


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
        self.local = lfm2_vl.local_processor(config)  # None: transformers' processor runs

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

        views, grids, (rows, cols) = load_image(self.local, run, image)
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


class Ovis2_5Layout(QwenLayout):
    """Ovis 2.5: Qwen2-VL's patch rows, each image token becoming image_start, a run of
    image tokens by the merged grid and image_end (Ovis2_5Processor; tokens spliced). The
    placed image spans all three: the start and end tokens take the encoder's indicator rows
    (multimodal/ovis2_5.py); 1-D positions."""

    mrope = False
    takes_embeds = False

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        from paged_engine.multimodal import ovis2_5

        ovis2_5.check_config(config)
        self.config = config
        self.placeholder = placeholder
        self.fixed = None
        self.bounds = (int(config.image_start_token_id), int(config.image_end_token_id))

    def length(self, size: Size) -> int:
        from paged_engine.multimodal import ovis2_5

        if size is None or len(size) != 3 or size[0] != 1 or min(size) <= 0:
            raise ValueError(
                f"multi_modal_data['image']: image_size {size} is not a patch grid (1, h, w)"
            )
        return ovis2_5.tokens(self.config, size) + 2

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        from paged_engine.multimodal import ovis2_5

        assert size is not None and len(size) == 3
        return (size[0] * size[1] * size[2], ovis2_5.patch_dim(self.config))

    def segment(self, loaded: Loaded) -> list[int]:
        start, end = self.bounds
        return [start, *[self.placeholder] * (self.length(loaded[1]) - 2), end]

    def span(self, m: ImageInput) -> list[int]:
        return self.segment((m.pixel_values, m.image_size))  # type: ignore[arg-type]

    def positions(self, num_tokens: int, images: tuple[ImageInput, ...]) -> Any:
        return None


LAYOUTS: dict[str, type[Layout]] = {
    "llava": Layout,
    "llava_next": AnyResLayout,
    "qwen2_vl": QwenLayout,
    "glm4v": QwenLayout,  # GLM-4.1V / 4.5V / 4.6V: Qwen2-VL's runs and M-RoPE table
    "qwen_omni": OmniLayout,
    "glm_ocr": QwenLayout,  # GLM-OCR: GLM-4.1V's host side
    "hunyuan_vl": HunyuanLayout,  # HunyuanOCR
    "idefics3": TileLayout,
    "pixtral": LineLayout,
    "internvl": BoundedLayout,
    "gemma3": Gemma3Layout,
    "gemma4": Gemma4Layout,
    "gemma4_unified": Gemma4UnifiedLayout,  # Gemma 4 Unified: one token per model patch
    "aya_vision": AyaLayout,
    "cohere2_vision": CohereTiles,
    "idefics2": Idefics2Layout,
    "llama4": Llama4Layout,
    "kimi_k25": KimiLayout,
    "lfm2_vl": Lfm2VlLayout,
    "ovis2_5": Ovis2_5Layout,
    "exaone4_5": Exaone45Layout,  # EXAONE 4.5: Qwen2-VL's runs, 1-D positions
    "minicpmv": MiniCPMVLayout,
    "minicpmv_canvas": MiniCPMVCanvasLayout,
}
