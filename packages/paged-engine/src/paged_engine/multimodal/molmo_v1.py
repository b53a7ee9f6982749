"""Molmo v1's prompts (`MolmoForCausalLM`, remote code: Molmo-7B-D / 72B / 7B-O-0924; vLLM's
molmo.py): the tokens an image writes and where its `ImageInput` sits (`MolmoV1Layout`). The
pixels, tiling and pooling windows are molmo_v1_processor.py's, the tower and adapter
molmo_v1_encoder.py's, the decoder models/molmo_v1.py's, the config models/molmo_v1_config.py's.

    prompt (the release's MolmoProcessor.process, as vLLM feeds it): the images go at the
        prompt's start, each image's segment (molmo_v1_processor's tokens) one after the
        other right after the first token, the bos token (bos_token_id or eos_token_id, as
        the release: Qwen2's tokenizer has no bos) put first where the prompt has none; the
        text is the prompt's as given (the release's chat form is
        " User: {text} Assistant:", which vLLM writes for a prompt not already in it:
        write it so)
    one `ImageInput` a segment (every token's row: its own embedding, plus the pooled feature
        on <im_patch>: the release adds the features to the placeholders' embeddings),
        attended causally as the release does; image_size a molmo_v1_processor.Geometry

A prompt holding <im_patch> tokens of its own is refused by name; mm_processor_kwargs are
refused (the release's crops are preprocessor_config.json's), as are settings the pooling
does not take (odd overlap margins, a crop size that is not the tower's).
"""

from __future__ import annotations

from dataclasses import astuple
from pathlib import Path
from typing import Any

from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import Layout, Loaded, Run, Size, digest, token_ids
from paged_engine.multimodal.molmo_v1_processor import (
    DEFAULTS,
    MOST_CROPS,
    Geometry,
    MolmoV1ImageProcessor,
    saved_settings,
)

PATCH, START, END, COL = "<im_patch>", "<im_start>", "<im_end>", "<im_col>"
_CONFIG_IDS = (
    "image_patch_token_id",
    "image_start_token_id",
    "image_end_token_id",
    "image_col_token_id",
)


class MolmoV1Layout(Layout):
    """Images at the prompt's start, each a segment of molmo_v1_processor's tokens; pixels
    [views, 3, S, S], image_size a `Geometry`."""

    takes_embeds = False

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        self.config = config
        self.placeholder = placeholder  # <im_patch>
        self.fixed = None
        ids = token_ids(tokenizer, PATCH, START, END, COL)
        want = tuple(int(i) for i in config.image_tokens)
        if ids != want:
            raise ValueError(
                f"MolmoForCausalLM: the tokenizer's {PATCH} / {START} / {END} / {COL} ids {ids} "
                f"differ from the config's {want} (config.json {' / '.join(_CONFIG_IDS)})"
            )
        self.ids = ids
        # the release's `bos_token_id or eos_token_id` (an id 0 counts as none)
        self.bos = int(getattr(tokenizer, "bos_token_id", None) or tokenizer.eos_token_id)
        self.settings = dict(DEFAULTS)  # read_saved's, checked there

    def read_saved(self, path: Path) -> None:
        """preprocessor_config.json's crops and normalization over the release's defaults."""
        self.settings = saved_settings(path)
        self._check_settings()

    def _check_settings(self) -> None:
        s, vision = self.settings, self.config.vision_config
        side = [int(v) for v in s["base_image_input_size"]]
        if side != [int(vision.image_size)] * 2 or int(s["image_patch_size"]) != int(
            vision.patch_size
        ):
            raise ValueError(
                f"MolmoForCausalLM: preprocessor_config.json base_image_input_size={side} / "
                f"image_patch_size={s['image_patch_size']} are not the tower's "
                f"{vision.image_size} / {vision.patch_size}"
            )
        margins = [int(m) for m in s["overlap_margins"]]
        cp = int(vision.image_size) // int(vision.patch_size)
        if len(margins) != 2 or any(m < 0 or m % 2 for m in margins) or sum(margins) >= cp:
            raise ValueError(
                f"MolmoForCausalLM: preprocessor_config.json overlap_margins={margins} must be "
                f"two even patch counts under {cp} together (2 x 2 pooling)"
            )
        if not 1 <= int(s["max_crops"]) <= MOST_CROPS:
            raise ValueError(
                f"MolmoForCausalLM: preprocessor_config.json max_crops={s['max_crops']} must "
                f"lie in [1, {MOST_CROPS}]"
            )

    def image_processor(self) -> MolmoV1ImageProcessor:
        return MolmoV1ImageProcessor(self.settings)

    def check_kwargs(self, kwargs: dict[str, Any]) -> None:
        if kwargs:
            raise ValueError(
                f"mm_processor_kwargs {sorted(kwargs)} are not supported for MolmoForCausalLM "
                "(its crops are preprocessor_config.json's)"
            )

    def geometry(self, size: Size) -> Geometry:
        if size is None or len(size) != 8:
            raise ValueError(
                f"multi_modal_data['image']: image_size {size} is not a Molmo geometry"
            )
        g = Geometry(*(int(v) for v in size))
        vision = self.config.vision_config
        cp = int(vision.image_size) // int(vision.patch_size)
        fits = (g.cp, g.p) == (cp, int(vision.patch_size)) and g.height > 0 and g.width > 0
        tiles = g.th >= 1 and g.tw >= 1 and g.th * g.tw <= int(self.settings["max_crops"])
        margins = g.left >= 0 and g.right >= 0 and g.left % 2 == 0 == g.right % 2
        if not (fits and tiles and margins and g.window >= 2):
            raise ValueError(
                f"multi_modal_data['image']: image_size {size} is not a tiling of this model's "
                "crops (see preprocessor_config.json)"
            )
        return g

    def length(self, size: Size) -> int:
        return len(self.geometry(size).tokens(*self.ids))

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        g = self.geometry(size)
        return (g.views, 3, g.cp * g.p, g.cp * g.p)

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image])
        pixels, size = out["pixel_values"][0].float(), astuple(out["geometries"][0])
        if tuple(pixels.shape) != self.pixel_shape(size):
            raise ValueError(
                f"multi_modal_data['image']: the image processor gave pixel values of shape "
                f"{tuple(pixels.shape)}, not {self.pixel_shape(size)}"
            )
        return pixels, size

    def segment(self, loaded: Loaded) -> list[int]:
        return self.geometry(loaded[1]).tokens(*self.ids)

    def place(self, loaded: Loaded, at: int, segment: list[int]) -> list[ImageInput]:
        pixels, size = loaded
        return [ImageInput(pixels, at, len(segment), digest(pixels, size), size)]

    def span(self, m: ImageInput) -> list[int]:
        return self.geometry(m.image_size).tokens(*self.ids)

    def splice(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        """The segments one after the other after the bos token (put first where the prompt
        has none); ValueError naming multi_modal_data where the prompt holds <im_patch>."""
        if self.placeholder in ids:
            raise ValueError(
                f"multi_modal_data['image']: the prompt holds {PATCH} tokens of its own (token "
                f"id {self.placeholder}): Molmo puts its images at the prompt's start itself"
            )
        rest = ids[1:] if ids[:1] == [self.bos] else ids
        out, starts = [self.bos], []
        for s in segments:
            starts.append(len(out))
            out += s
        return out + rest, starts
