"""`ImageInput`: one image of a prompt, as plain data (picklable: it travels to every rank).

    prompt token ids:  ... <image> x length ...
                           ^ offset
    the model's input embedding at positions [offset, offset + length) is the image's feature
    rows (the vision encoder's output, one row per placeholder), not the placeholder token's.

    Pixtral / Mistral 3 (`break_every` = w + 1): the span is h lines of w placeholders and one
    line-break token ([IMG_BREAK], the last one [IMG_END]); the break tokens keep their own
    embedding and feature row r * w + c goes to span position r * (w + 1) + c.

Gemma 3 (`bidirectional`): each placeholder also sees the image's later placeholders, as HF's
mask lets it at prefill; the scheduler keeps each such image within one step.

`token_rows` (vLLM's prompt_embeds, engine/prompt_embeds.py): the span is a block of a prompt
given as embeddings, each row standing for the token embedding lookup's output (a model's own
scaling, position embeddings or projection still follow), not for features put after it.

`mm_hash` identifies the pixels: the prefix cache keys a block that covers any placeholder of
an image by the image's hash too, so two prompts with the same text and other images share no
KV (core/block_manager.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True, slots=True, eq=False)
class ImageInput:
    # float32, preprocessed for the vision encoder: [3, H, W] (LLaVA), [views, 3, H, W]
    # (LLaVA-NeXT: the base view and the tiles) or [patches, 3 * tp * p * p] (Qwen2-VL); None
    # where the client gave the features themselves (`embeds`)
    pixel_values: torch.Tensor | None
    offset: int  # first placeholder position in the prompt
    length: int  # placeholders = feature rows
    mm_hash: str  # SHA-256 of the pixel values or embeddings (and image_size), 32 hex digits
    # LLaVA-NeXT: (h, w) as loaded; Qwen2-VL: the patch grid (t, h, w); else None
    image_size: tuple[int, ...] | None = None
    embeds: torch.Tensor | None = None  # [length, text hidden]: vLLM's image_embeds input
    break_every: int = 0  # 0: every span position takes a feature row; else see the module
    # Gemma 3: the span's tokens attend to each other (all of it, both ways) at prefill, so a
    # step never ends inside it (core/token_plan.py whole_images) and its rows see its end
    bidirectional: bool = False
    # PaliGemma: positions [0, prefix_end) (every image and the prompt text) attend to each other
    # both ways at prefill, as one span that a step never ends inside; 0: no such prefix
    prefix_end: int = 0
    token_rows: bool = False  # prompt_embeds rows (see the module)
    # a Qwen video's M-RoPE temporal step: frame group k has temporal index floor(k * t_step)
    # (Qwen2.5-VL: tokens_per_second * seconds per group; 1 for Qwen2-VL and images)
    t_step: float = 1.0
    # "image", "video" or "audio": which encoder reads `pixel_values` (an audio item's are its
    # features, e.g. a log-mel spectrogram [mels, frames]; multimodal/audio.py)
    modality: str = "image"

    @property
    def num_features(self) -> int:
        """Feature rows the image has: its span less its line-break tokens."""
        return self.length - self.length // self.break_every if self.break_every else self.length

    def feature_rows(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """(span offsets in [lo, hi) that take a feature row, those rows' indices)."""
        rel = np.arange(lo, hi)
        if not self.break_every:
            return rel, rel
        line, col = np.divmod(rel, self.break_every)
        keep = col != self.break_every - 1
        return rel[keep], (line * (self.break_every - 1) + col)[keep]

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def two_way(self) -> tuple[int, int] | None:
        """The positions [start, end) whose tokens see each other both ways at prefill (the
        prompt's prefix, or the image itself when `bidirectional`), or None."""
        if self.prefix_end:
            return (0, self.prefix_end)
        return (self.offset, self.end) if self.bidirectional else None

    def overlaps(self, start: int, end: int) -> bool:
        """Whether positions [start, end) include one of its placeholders."""
        return self.offset < end and start < self.end


def is_embeds_prompt(mm_inputs: tuple) -> bool:
    """Whether a prompt came as prompt_embeds (its first input is a block of rows)."""
    return bool(mm_inputs) and mm_inputs[0].token_rows


def shift_offsets(items: tuple | list, added: list[tuple[int, int]]) -> list[ImageInput]:
    """`items` moved by the tokens a later expansion added before them (`added`: (where in the
    prompt before it, tokens added) of each run it expanded)."""
    return [
        dataclasses.replace(m, offset=m.offset + sum(n for at, n in added if at < m.offset))
        for m in items
    ]


def block_mm_keys(images: tuple[ImageInput, ...], start: int, end: int) -> tuple[str, ...]:
    """Hashes of the images with a placeholder in positions [start, end), in prompt order."""
    return tuple(m.mm_hash for m in images if m.overlaps(start, end))


def check_decodes(image: Any, where: str) -> None:
    """Decode a lazily opened PIL image now (Image.open reads only its header), so that a
    truncated or corrupt file is a ValueError naming `where` rather than an OSError from deep
    in a processor."""
    try:
        image.load()
    except (OSError, ValueError, SyntaxError) as e:  # PIL's decoders raise all three
        raise ValueError(f"{where}: not an image Pillow can decode: {e}") from None


def to_rgb(image: Any) -> Any:
    """A PIL image in RGB, a transparent one (alpha band or palette transparency) over white,
    as transformers' `convert_to_rgb` and vLLM's media loader composite it."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")
