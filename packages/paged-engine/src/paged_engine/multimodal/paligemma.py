"""PaliGemma / PaliGemma 2's image path (PaliGemmaForConditionalGeneration; Gemma 1 / Gemma 2 text).

    image -> the checkpoint's SigLIP image processor: resized to S x S, pixels [3, S, S]
        -> SigLIP tower (every layer, post_layernorm): (S / patch)^2 patch rows
        -> multi_modal_projector.linear [vision hidden -> projection_dim] (with bias)
        -> (S / patch)^2 rows, spliced after the text embedding's sqrt(hidden) scale and so
           unscaled (transformers 5: the scale lives in the embedding, and no 1 / sqrt(hidden)
           divides the features; older releases did both, which cancels)
    prompt: HF's PaliGemmaProcessor writes "<image>" x (n * images) + "<bos>" + prompt + "\\n"
        (the host side: multimodal/paligemma_layout.py)
    attention: the whole prompt (images, bos, text and its "\\n": HF's token_type_ids 0) is a
        prefix whose tokens see each other both ways at prefill, generated tokens are causal
        (`ImageInput.prefix_end`, worker/key_ends.py); the prefix runs in one step
    text model: Gemma / Gemma 2 (models/text_wrappers.py). HF's PaliGemma counts positions
        from 1; RoPE scores depend on position differences only, so the shift changes nothing

Refused by name (multimodal/paligemma_layout.py): text-only prompts, image tokens after the
text, image embeddings, and for PaliGemma 2 a prompt longer than its sliding window.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.vision_transformer import FinalNormTower

ARCH = "PaliGemmaForConditionalGeneration"


def image_tokens(config: Any) -> int:
    """Placeholders (= feature rows) of one image: the tower's patches."""
    vision = config.vision_config
    return (int(vision.image_size) // int(vision.patch_size)) ** 2


class Projector(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        width = int(config.vision_config.hidden_size)
        out = int(getattr(config, "projection_dim", None) or config.text_config.hidden_size)
        if out != int(config.text_config.hidden_size):
            raise ValueError(
                f"projection_dim={out} must equal text_config.hidden_size="
                f"{config.text_config.hidden_size}"
            )
        self.linear = nn.Linear(width, out, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, P, Dv] -> [N, P, Dt]
        return self.linear(x)


class _VisionTower(nn.Module):  # the checkpoint's `vision_tower.vision_model` nesting
    def __init__(self, vision_config: Any) -> None:
        super().__init__()
        self.vision_model = FinalNormTower(vision_config)


class PaliGemmaImageEncoder(nn.Module):
    """Images -> rows of the text model's input embedding (one row per placeholder)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.vision_tower = _VisionTower(config.vision_config)
        self.multi_modal_projector = Projector(config)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, 3, S, S] -> [N, P, D]
        return self.multi_modal_projector(self.vision_tower.vision_model.last(pixels))

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        weight = self.multi_modal_projector.linear.weight
        pixels = torch.stack([m.pixel_values for m in images])  # type: ignore[misc]
        return list(self(pixels.to(weight.device, weight.dtype)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `[model.]vision_tower[.vision_model].*` and
        `[model.]multi_modal_projector.*` tensors (a pooling head and any other name passed
        over); ValueError naming a missing or unexpected one."""
        tower = "vision_tower.vision_model."

        def ours(name: str) -> str | None:
            name = name.removeprefix("model.")
            if name.startswith("vision_tower.") and not name.startswith(tower):
                name = tower + name.removeprefix("vision_tower.")
            if name.startswith(tower + "head."):
                return None
            return name if name.startswith((tower, "multi_modal_projector.")) else None

        picked = ((n, t) for n, t in ((ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self, picked)
