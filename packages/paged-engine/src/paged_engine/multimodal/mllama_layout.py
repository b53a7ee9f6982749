"""Llama 3.2 Vision's prompts on the host (multimodal/mllama.py is the tower, models/mllama.py
the decoder that cross-attends to it).

    a prompt:   ... <|image|> [<|image|> ...] text     one token an image, as MllamaProcessor
                                                       leaves it (nothing is expanded)
    an image:   MllamaImageProcessor -> pixels [max_num_tiles, 3, S, S], its real tiles and
                aspect ratio id (`host_image`)

Each image's `ImageInput` spans every decoder position [0, text_config.max_position_embeddings)
rather than its token: a text row before the first image reads the image rows too (HF's fully
masked rows, models/mllama.py) and every later row reads them, so the image's hash keys every
prefix-cache block of the prompt and the image reaches the worker with every sequence that
holds it (new, forked, resumed). `image_size` is (real tiles, aspect ratio id, the position of
the prompt's first <|image|>).

Refused by name (ValueError naming multi_modal_data): a count of <|image|> tokens other than the
images', <|image|> tokens that are not one run (MllamaProcessor's mask lets each text span read
only the images of the run of <|image|> tokens just before it, not an earlier run's: for
`<|image|> a <|image|> b`, "b" reads image 1 alone, a middle range of the slot, while a slot is
read by prefixes, models/mllama.py), image embeddings.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import Layout, Loaded, Run, digest
from paged_engine.multimodal.mllama import host_image


class MllamaLayout(Layout):
    takes_embeds = False

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        self.config = config
        self.placeholder = placeholder
        self.fixed = None  # (nothing is expanded: an image keeps its one token)
        vision = config.vision_config
        self.tiles, self.side = int(vision.max_num_tiles), int(vision.image_size)
        self.span_len = int(config.text_config.max_position_embeddings)
        # aspect ratio id -> its real tiles (id 0: padding, no real image)
        ratios = vision.supported_aspect_ratios
        self.ratio_tiles = {i + 1: int(h) * int(w) for i, (h, w) in enumerate(ratios)}

    def check_kwargs(self, kwargs: dict[str, Any]) -> None:
        """mm_processor_kwargs that would change the tiles the tower reads (their count and
        side) refused before any pixel is made (max_image_tiles=10**9 would allocate them)."""
        tiles = kwargs.get("max_image_tiles", self.tiles)
        if isinstance(tiles, bool) or tiles != self.tiles:
            raise ValueError(
                f"mm_processor_kwargs['max_image_tiles'] must be {self.tiles} "
                f"(vision_config.max_num_tiles), got {tiles!r}"
            )
        size = kwargs.get("size")
        if size is not None and size != {"height": self.side, "width": self.side}:
            raise ValueError(
                f"mm_processor_kwargs['size'] must be {{'height': {self.side}, 'width': "
                f"{self.side}}} (vision_config.image_size), got {size!r}"
            )

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        pixels, size = host_image(run([image]), self.tiles, self.side)
        return pixels, size

    def segment(self, loaded: Loaded) -> list[int]:  # (not Layout's: no run to expand)
        return [self.placeholder]

    def place(self, loaded: Loaded, at: int, segment: list[int]) -> list[ImageInput]:
        pixels, size = loaded
        assert size is not None
        return [ImageInput(pixels, at, 1, digest(pixels, size), (*size, at))]

    def finish(self, ids: list[int], images: tuple[ImageInput, ...]) -> tuple[ImageInput, ...]:
        """The images spanning every position, each with the first image's position."""
        at = [i for i, t in enumerate(ids) if t == self.placeholder]
        if len(at) != len(images):
            raise ValueError(
                f"multi_modal_data['image'] has {len(images)} image(s) but the prompt has "
                f"{len(at)} <|image|> token(s) (id {self.placeholder}): put one per image"
            )
        if at != list(range(at[0], at[0] + len(at))):
            raise ValueError(
                "multi_modal_data['image']: a prompt's <|image|> tokens must be one run "
                "(<|image|><|image|>...); text between images is not supported for "
                f"{self.config.architectures[0]}"
            )
        return tuple(
            dataclasses.replace(
                m, offset=0, length=self.span_len, image_size=(*m.image_size[:2], at[0])
            )  # type: ignore[index]
            for m in images
        )

    def placed(
        self, ids: list[int], images: list[ImageInput]
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """Images processed ahead (`finish`ed): each fits and the prompt holds their run."""
        ok = all(self.fits(m) for m in images)
        finished = self.finish(ids, tuple(images)) if ok else ()
        if not ok or [m.image_size for m in finished] != [m.image_size for m in images]:
            raise ValueError(
                "multi_modal_data['image']: these processed images do not fit this prompt and "
                "model (their placeholder runs or pixel shapes differ)"
            )
        return ids, tuple(images)

    def fits(self, m: ImageInput) -> bool:
        pixels, size = m.pixel_values, m.image_size
        return (
            pixels is not None
            and tuple(pixels.shape) == (self.tiles, 3, self.side, self.side)
            and m.offset == 0
            and m.length == self.span_len
            and size is not None
            and len(size) == 3
            and 1 <= size[0] <= self.tiles
            and self.ratio_tiles.get(size[1]) == size[0]  # (an id past the table: IndexError)
        )
