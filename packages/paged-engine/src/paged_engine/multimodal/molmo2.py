"""Molmo2's prompts (Molmo2ForConditionalGeneration): the tokens an image writes and where its
`ImageInput` sits (`Molmo2Layout`); the pixels and pooling windows are molmo2_processor.py's,
the tower and adapter molmo2_encoder.py's, the text decoder models/molmo2.py's.

    image (H, W) -> Molmo2ImageProcessor's rule (as transformers runs it):
        crop S = the tower's side (vision_config.image_size), patch p, cp = S / p patches a side,
        margins (l, r) patches, window = cp - l - r patches
        tiling (th, tw): select_tiling over th * tw <= max_crops of (H - (l + r) p,
            W - (l + r) p) in windows of window * p pixels (the smallest scale-up, else the
            largest scale-down; float32 as transformers computes it)
        canvas th * window * p + (l + r) p by tw * ...: resize (bilinear, no antialias, in
            float32, rounded back to uint8), normalized, cut into th x tw crops of S x S
            whose neighbours overlap by l + r patches
        the global view: the image resized to S x S, first; crops after it
        each view -> patches [cp * cp, p * p * 3] (row-major patches, each (row, col, channel))
    pooling windows (image_token_pooling): the canvas' patch grid with each crop's overlapped
        margins dropped (patch indices into the views' patches), padded with -1 to ph x pw
        windows (half the padding before), windows row-major -> [rows * cols, ph * pw]; the
        global view's cp x cp grid the same way first
    prompt (Molmo2Processor): each <|image|> becomes
        <low_res_im_start> (<im_patch> x rw [<im_col>]) x rh <im_end>      the global view
        <im_start> (<im_patch> x cols [<im_col>]) x rows <im_end>           the crops
        (processor_config.json's use_single_crop_start_token, use_single_crop_col_tokens,
        image_use_col_tokens choose the bracketed parts)

One `ImageInput` spans the whole segment: the encoder gives a row for every token of it (the
token's own embedding, plus the pooled feature on <im_patch>: transformers adds the features
to the placeholders' embeddings), so the image's tokens are one span, and transformers' mask
lets them see each other both ways at prefill (mm_token_type_ids): the image is
`bidirectional`. That mask puts every image of a prompt in one group, so an image's tokens also
see a later image's across the text between them, which a key end cannot say: a prompt holds at
most one run of images: one image, or images side by side (`<|image|><|image|>`, no text
between), which take one `ImageInput` together (their views and geometries concatenated); text
between two images is refused by name (max_crops past 1024: kwargs_budget.py's count knobs).
Videos are refused (by name, as for any model without a video processor): Molmo2Processor
counts every frame's <frame_start> / <im_patch> / <frame_end> as image tokens, so they all
attend both ways across the "0.5 " timestamp text between frames (the rule above); vLLM runs
them causally, which neither transformers nor these images do. image_size carries the
geometries (`Geometry`) the worker rebuilds the pooling windows and the segment from.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import astuple
from pathlib import Path
from typing import Any

import torch

from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import (
    Layout,
    Loaded,
    Run,
    Size,
    digest,
    replace_tokens,
    token_ids,
)
from paged_engine.multimodal.molmo2_processor import Geometry, Molmo2TorchProcessor, geometries
from paged_engine.multimodal.torch_processors import saved_settings

MARKER, PATCH, COL = "<|image|>", "<im_patch>", "<im_col>"
START, LOW_START, END = "<im_start>", "<low_res_im_start>", "<im_end>"
_PROCESSOR_FLAGS = {  # Molmo2Processor's defaults (None: image_use_col_tokens's value)
    "image_use_col_tokens": True,
    "use_single_crop_col_tokens": None,
    "use_single_crop_start_token": True,
}


def processor_flags(path: Path) -> dict[str, Any]:
    """Molmo2Processor's token flags, from processor_config.json over its defaults."""
    saved: dict[str, Any] = {}
    file = Path(path) / "processor_config.json"
    if file.is_file():
        saved = json.loads(file.read_text())
    return {k: saved.get(k, v) for k, v in _PROCESSOR_FLAGS.items()}


class Molmo2Layout(Layout):
    """Molmo2: each <|image|> becomes the global view's and the crops' grids of <im_patch>
    (molmo2's module doc), one `ImageInput` over the whole segment, `bidirectional`; pixels
    [views, cp * cp, p * p * 3], image_size a `Geometry`."""

    takes_embeds = False

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        self.config = config
        self.placeholder = placeholder  # <im_patch> (config.image_patch_id)
        self.fixed = None
        self.start, self.end = int(config.image_start_token_id), int(config.image_end_token_id)
        self.low_start = int(config.low_res_image_start_token_id)
        names = (MARKER, PATCH, COL, START, LOW_START, END)
        ids = dict(zip(names, token_ids(tokenizer, *names), strict=True))
        if ids[PATCH] != placeholder or (ids[START], ids[END]) != (self.start, self.end):
            raise ValueError(
                "the tokenizer's <im_patch> / <im_start> / <im_end> ids differ from the config's "
                "image_patch_id / image_start_token_id / image_end_token_id"
            )
        self.image_token, self.col = ids[MARKER], ids[COL]
        # Molmo2Processor starts each prompt with bos_token (else eos_token) where it has none
        bos = getattr(tokenizer, "bos_token_id", None)
        self.bos = int(bos if bos is not None else tokenizer.eos_token_id)
        flags = processor_flags(_path(config))
        high_col = bool(flags["image_use_col_tokens"])
        low_col = flags["use_single_crop_col_tokens"]
        self.high_col = self.col if high_col else -1
        self.low_col = self.col if (high_col if low_col is None else bool(low_col)) else -1
        self.first = self.low_start if flags["use_single_crop_start_token"] else self.start
        s = {**Molmo2TorchProcessor.defaults, **saved_settings(_path(config))}
        margins, pool = [int(m) for m in s["overlap_margins"]], [int(v) for v in s["pooling_size"]]
        self.saved = (*margins, *pool)  # tried first when matching the processor's output
        vision = config.vision_config
        self.patch_dim = int(vision.num_channels) * int(vision.patch_size) ** 2

    def _tokens(self, size: Size) -> list[int]:
        return [
            t for g in geometries(size) for t in g.segment(self.placeholder, self.start, self.end)
        ]

    def length(self, size: Size) -> int:
        return len(self._tokens(size))

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        found = geometries(size)
        cp = found[0].crop_patches
        if any(g.crop_patches != cp for g in found):
            raise ValueError(f"multi_modal_data['image']: image_size {size} mixes crop sizes")
        return (sum(g.views for g in found), cp * cp, self.patch_dim)

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image])
        pixels = out["pixel_values"].float()
        views = int(out["image_num_crops"][0])
        cp = int(self.config.vision_config.image_size[0]) // int(
            self.config.vision_config.patch_size
        )
        if tuple(pixels.shape) != (views, cp * cp, self.patch_dim):
            raise ValueError(
                f"multi_modal_data['image']: the image processor gave pixel values of shape "
                f"{tuple(pixels.shape)}, not ({views}, {cp * cp}, {self.patch_dim}): check "
                "preprocessor_config.json"
            )
        g = self._match(out, views, cp)
        return pixels, astuple(g)

    def _match(self, out: Any, views: int, cp: int) -> Geometry:
        """The geometry whose grids and pooling windows are the processor's output (its margins
        and pooling size read from the hf settings, the tiling from the crop count)."""
        grid = [int(v) for v in out["image_grids"][0]]
        pooling = out["image_token_pooling"]
        for th in range(1, views):
            if (views - 1) % th:
                continue
            for left, right, ph, pw in [self.saved, *_candidates(pooling.shape[1], cp)]:
                tw, tokens = (views - 1) // th, (self.first, self.low_col, self.high_col)
                g = Geometry(th, tw, cp, left, right, ph, pw, *tokens)
                (rh, rw), (rows, cols) = g.grids()  # cheap: the windows only where these fit
                if [rh, rw, rows, cols] == grid and torch.equal(g.pooling(), pooling.long()):
                    return g
        raise ValueError(
            "multi_modal_data['image']: the image processor's crops and pooling windows are "
            "not Molmo2's (check preprocessor_config.json and mm_processor_kwargs)"
        )

    def segment(self, loaded: Loaded) -> list[int]:
        return self._tokens(loaded[1])

    def place(self, loaded: Loaded, at: int, segment: list[int]) -> list[ImageInput]:
        pixels, size = loaded
        n = len(segment)
        return [ImageInput(pixels, at, n, digest(pixels, size), size, bidirectional=True)]

    def span(self, m: ImageInput) -> list[int]:
        return self._tokens(m.image_size)

    def fits(self, m: ImageInput) -> bool:
        return m.bidirectional and super().fits(m)

    @property
    def marker(self) -> int:
        return self.image_token

    def splice(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        """Each <|image|> -> its image's segment, the bos token first where the prompt has
        none (Molmo2Processor's); ValueError naming multi_modal_data unless there is one
        <|image|> per image and no <im_patch> of the prompt's own."""
        at = [i for i, t in enumerate(ids) if t == self.image_token]
        if self.placeholder in ids:
            raise ValueError(
                f"multi_modal_data['image']: the prompt holds {PATCH} tokens of its own (token id "
                f"{self.placeholder}) but not the whole segments of its images: write one "
                f"{MARKER} per image"
            )
        if len(at) != len(segments):
            raise ValueError(
                f"multi_modal_data['image'] has {len(segments)} image(s) but the prompt has "
                f"{len(at)} {MARKER} placeholder(s) (token id {self.image_token}): put one per "
                "image where it belongs"
            )
        out, starts = replace_tokens(ids, at, segments)
        if out[:1] != [self.bos]:
            out, starts = [self.bos, *out], [i + 1 for i in starts]
        return out, starts

    def finish(self, ids: list[int], images: tuple[ImageInput, ...]) -> tuple[ImageInput, ...]:
        """Images whose segments touch as one `ImageInput` (one run that attends both ways);
        ValueError where text lies between two (see the module doc)."""
        if len(images) < 2:
            return images
        if any(a.end != b.offset for a, b in itertools.pairwise(images)):
            raise ValueError(
                f"multi_modal_data['image'] has {len(images)} images with text between them: "
                "Molmo2 runs one image a prompt, or images side by side (<|image|><|image|>): "
                "transformers' mask lets every image's tokens see every other image's, across "
                "the text between them, which paged's attention does not express"
            )
        pixels = torch.cat([m.pixel_values for m in images])  # type: ignore[misc]
        size = tuple(v for m in images for v in m.image_size)  # type: ignore[union-attr]
        length = sum(m.length for m in images)
        at = images[0].offset
        return (ImageInput(pixels, at, length, digest(pixels, size), size, bidirectional=True),)


def _path(config: Any) -> Path:
    return Path(getattr(config, "_name_or_path", "") or ".")


def _candidates(window: int, cp: int) -> list[tuple[int, int, int, int]]:
    """(left, right, pool_h, pool_w) margins and pooling windows of `window` patches a crop of
    cp x cp patches may have (the processor's settings, found from its output)."""
    pools = [(a, window // a) for a in range(1, window + 1) if window % a == 0]
    margins = [(a, b) for a in range(cp) for b in range(cp) if a + b < cp]
    return [(a, b, h, w) for h, w in pools for a, b in margins]
