"""A prompt's M-RoPE positions (Qwen2-VL / 2.5-VL with images; the rule: multimodal/qwen2_vl.py).

    prompt:  text ... | image run (t x h x w merged features) | text ...
    rows:    p, p, p  | start + (t_i, h_i, w_i)                | start + max(h, w) + k, all rows

A video's temporal index t_i is floor(i * t_step) (multimodal/qwen_video.py).

Plain data with numpy only: it is built on the host and travels to every rank with its sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from paged_engine.multimodal.inputs import ImageInput


@dataclass(frozen=True, eq=False)
class MropePositions:
    """A prompt's M-RoPE positions (plain data: it travels to every rank with its sequence)."""

    table: np.ndarray  # [3, prompt length] int64
    first: int  # the first image placeholder: positions before it are the 1-D ones
    delta: int  # a token after the prompt at position p: rope position p + delta, all rows

    @property
    def num_prompt(self) -> int:
        return self.table.shape[1]


def mrope_positions(num_tokens: int, images: Sequence[ImageInput], merge: int) -> MropePositions:
    """The table of a prompt of `num_tokens` tokens whose images (in prompt order, each with
    its patch grid (t, h, w) as `image_size`) sit at their placeholder runs."""
    table = np.empty((3, num_tokens), dtype=np.int64)
    pos = 0  # the next text position
    last = 0  # the prompt index up to which the table is written
    for m in images:
        assert m.image_size is not None and len(m.image_size) == 3
        t, h, w = m.image_size[0], m.image_size[1] // merge, m.image_size[2] // merge
        if t * h * w != m.length:
            raise ValueError(f"an image's grid {m.image_size} does not give its {m.length} rows")
        table[:, last : m.offset] = np.arange(pos, pos + m.offset - last)
        pos += m.offset - last
        # (float32, as transformers scales a video's temporal index before flooring it)
        temporal = (np.arange(t, dtype=np.float32) * np.float32(m.t_step)).astype(np.int64)
        grid = np.stack(np.meshgrid(temporal, np.arange(h), np.arange(w), indexing="ij"))
        table[:, m.offset : m.end] = grid.reshape(3, -1) + pos
        pos += max(h, w)
        last = m.end
    table[:, last:] = np.arange(pos, pos + num_tokens - last)
    first = images[0].offset if images else num_tokens
    delta = int(table.max()) + 1 - num_tokens if num_tokens else 0
    return MropePositions(table, first, delta)
