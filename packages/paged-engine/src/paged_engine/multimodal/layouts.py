"""How each wrapper's images enter its prompt (the host side of an image; processor.py runs it):
the `Layout` base (LLaVA 1.5) and the helpers every layout shares. The families live in
layouts_qwen.py, layouts_gemma.py, layouts_tiles.py, layouts_slices.py, layouts_single_run.py
and paligemma_layout.py; layout_table.py maps each model kind to its layout.

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
    Ovis2Layout     "<image>" text -> <IMG_START>, a run per tile (the      one per image
                    thumbnail first), <IMG_GRID> / <IMG_COL> / <IMG_ROW>,   (its whole
                    <IMG_END> (Ovis2; spliced as text, tokenized;           segment)
                    ovis2_layout.py)

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

from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.llava import tokens_per_image

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
    ids: list[int], at: list[int], segments: list[list[int]], width: int = 1
) -> tuple[list[int], list[int]]:
    """(`ids` with the `width` tokens from each index of `at` (ascending, not overlapping)
    replaced by its segment, where each segment starts in them)."""
    out: list[int] = []
    starts: list[int] = []
    last = 0
    for i, segment in zip(at, segments, strict=True):
        out += ids[last:i]
        starts.append(len(out))
        out += segment
        last = i + width
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


def splice_at_text(
    tokenizer: Any, ids: list[int], segments: list[list[int]], marker: str, aside: str = ""
) -> tuple[list[int], list[int]]:
    """The prompt decoded, its text split at each `marker`, the pieces tokenized apart and the
    segments put between them (vLLM's processors that splice text): (the ids, each segment's
    start in them); ValueError naming multi_modal_data unless there is one marker per image
    (`aside`: a family's own words, after the marker in the message)."""
    text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    pieces = text.split(marker)
    if len(pieces) != len(segments) + 1:
        raise ValueError(
            f"multi_modal_data['image'] has {len(segments)} image(s) but the prompt has "
            f"{len(pieces) - 1} image placeholder(s) ({marker}{aside}): put one per image "
            "where it belongs"
        )
    out: list[int] = tokenizer.encode(pieces[0], add_special_tokens=False)
    starts = []
    for segment, piece in zip(segments, pieces[1:], strict=True):
        starts.append(len(out))
        out += segment + tokenizer.encode(piece, add_special_tokens=False)
    return out, starts


def _side(config: Any) -> int:
    size = config.vision_config.image_size
    return int(size[0] if isinstance(size, (list, tuple)) else size)


def _shape_error(got: torch.Tensor, want: Any) -> ValueError:
    return ValueError(
        f"multi_modal_data['image']: the image processor gave pixel values of shape "
        f"{tuple(got.shape)}, not {want}: check preprocessor_config.json and mm_processor_kwargs"
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
