"""Qwen2-VL / Qwen2.5-VL's image path: variable-size images, and M-RoPE positions.

    image -> the checkpoint's image processor: resized to multiples of patch * merge pixels,
        cut into t x h x w patches (t = 1 for an image), pixel rows [t*h*w, 3 * tp * p * p]
    -> the vision encoder ("visual", multimodal/qwen2_vl_vision.py): the patches, each
        merge x merge block of them merged into one row -> [t*h*w / merge^2, text hidden]
    prompt: <|vision_start|> <|image_pad|> x (t*h*w / merge^2) <|vision_end|>

M-RoPE (layers/rotary.py MRotaryEmbedding): every prompt token has a (temporal, height, width)
position. Text runs on from the position after the last one, the same in all three rows; an
image's rows are its start position plus each feature's (t, h, w) index in the merged grid, and
the text after it starts at that start + max(h, w) / merge. A token generated at sequence
position p has rope position p + delta in all rows (delta = the prompt's largest position + 1
- its length, <= 0). `MropePositions` (multimodal/mrope.py) holds a prompt's table; the
runner reads rope positions from it (worker/rope_positions.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.mrope import MropePositions, mrope_positions
from paged_engine.multimodal.qwen2_vl_vision import QwenVisionEncoder

__all__ = ["ARCHS", "MropePositions", "QwenImageEncoder", "mrope_positions"]

ARCHS = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
TARSIER2 = "Tarsier2ForConditionalGeneration"  # Qwen2-VL's images, LLaVA's weight names
# the same host side (grids, placeholders, M-RoPE, interleaved), their own tower and deepstack
QWEN3_ARCHS = (
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",  # Qwen3-VL's tower without deepstack, a hybrid decoder
    "Qwen3_5MoeForConditionalGeneration",
    "CohereCompassForConditionalGeneration",  # Qwen3-VL's tower into a Cohere decoder
)
# the text rope is M-RoPE per layer type, always interleaved (models/cohere_compass.py)
PER_TYPE_MROPE = ("CohereCompassForConditionalGeneration",)


def check_config(config) -> None:
    """ValueError naming the field where the checkpoint's images could not run as HF runs them:
    the text rope must be M-RoPE (contiguous sections over half the rotary dims)."""
    from paged_engine.layers.rotary import mrope_section, rope_config

    if any(a in PER_TYPE_MROPE for a in config.architectures):
        if merge_size(config) < 1:
            raise ValueError("vision_config.spatial_merge_size must be at least 1")
        return
    text = config.text_config
    found = mrope_section(text)
    section = None if found is None else found[0]
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    partial = rope_config(text)[2]  # transformers 5 keeps it in rope_parameters
    # interleaved sections (Qwen3-VL, Qwen3.5): transformers reads any sum
    covers = found is not None and (found[1] or sum(found[0]) * 2 == int(head_dim * partial))
    if not covers:
        raise ValueError(
            f"text_config.rope_parameters mrope_section={section} must be three sizes summing "
            f"to half the rotary dims ({int(head_dim * partial) // 2}) for "
            f"{config.architectures[0]}'s images"
        )
    if merge_size(config) < 1:
        raise ValueError("vision_config.spatial_merge_size must be at least 1")


def merge_size(config) -> int:
    return int(config.vision_config.spatial_merge_size)


def patch_dim(config) -> int:
    """Width of a pixel row: channels x temporal patch x patch x patch."""
    v = config.vision_config
    channels = getattr(v, "in_channels", None) or getattr(v, "in_chans", 3)
    return int(channels) * int(v.temporal_patch_size) * int(v.patch_size) ** 2


def tokens(config, grid: tuple[int, ...]) -> int:
    t, h, w = grid
    return t * h * w // merge_size(config) ** 2


class QwenImageEncoder(nn.Module):
    """Images -> rows of the text model's input embedding, one per placeholder."""

    # where the checkpoint keeps the tower other than `visual.` (Tarsier2: LLaVA's
    # `vision_tower.`, models/tarsier2_config.py)
    tower_prefix: str | None = None

    def __init__(self, config) -> None:
        super().__init__()
        self.visual = QwenVisionEncoder(config.vision_config)
        if TARSIER2 in config.architectures:
            self.tower_prefix = "vision_tower."

    def _tower(self, images: Sequence[ImageInput]) -> Any:
        """The tower on the images' patch rows, concatenated, with their grids."""
        param = next(self.visual.parameters())
        pixels = torch.cat([m.pixel_values for m in images]).to(param.device, param.dtype)
        grids = [tuple(int(x) for x in m.image_size) for m in images]  # type: ignore[union-attr]
        return self.visual(pixels, grids)

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        return list(self._tower(images).split([m.length for m in images]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        prefix = self.tower_prefix
        if prefix is not None:
            weights = ((_renamed(n, prefix), t) for n, t in weights)
        return self.visual.load_weights(weights)


def _renamed(name: str, prefix: str) -> str:
    """`prefix` + rest -> `visual.` + rest (any other name as it is)."""
    return "visual." + name.removeprefix(prefix) if name.startswith(prefix) else name


class Qwen3ImageEncoder(QwenImageEncoder):
    """Qwen3-VL: images -> [rows, 1 + k, D] per image: the input rows, then one row per
    deepstack layer (the decoder adds row j + 1 to the stream after its layer j); Qwen3.5:
    [rows, D]."""

    def __init__(self, config) -> None:
        nn.Module.__init__(self)
        from paged_engine.multimodal.qwen3_vl_vision import Qwen3VisionEncoder

        self.visual = Qwen3VisionEncoder(config.vision_config)
        self.num_deepstack = self.visual.num_deepstack

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        rows, deep = self._tower(images)
        if deep:  # [rows, 1 + k, D]: the ImageEmbedder splits the deepstack rows off
            rows = torch.stack([rows, *deep], dim=1)
        return list(rows.split([m.length for m in images]))


def build_encoder(config) -> QwenImageEncoder:
    """Qwen3-VL's tower (and deepstack) for its checkpoints, Qwen2-VL's for the others."""
    if any(a in QWEN3_ARCHS for a in config.architectures):
        return Qwen3ImageEncoder(config)
    return QwenImageEncoder(config)
