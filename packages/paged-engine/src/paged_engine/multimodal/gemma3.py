"""Gemma 3's image path (Gemma3ForConditionalGeneration: gemma-3-4b / 12b / 27b -it).

    image -> the checkpoint's image processor: resized to S x S (896), pixels [3, S, S]
        -> SigLIP tower (every layer, post_layernorm): (S / patch)^2 patch rows
        -> multi_modal_projector: the patch grid average-pooled to a side x side grid
           (side^2 = mm_tokens_per_image, 256), RMSNorm with (1 + weight) (mm_soft_emb_norm,
           vision eps), times mm_input_projection_weight [vision hidden, text hidden]
        -> mm_tokens_per_image rows, not scaled by the text embedding's sqrt(hidden)
    prompt: each <start_of_image> a user writes becomes, as HF's processor does it on the text,
        "\\n\\n<start_of_image>" + <image_soft_token> x 256 + "<end_of_image>\\n\\n"
    attention: an image's soft tokens see each other both ways at prefill (the text stays
        causal), so the image is `ImageInput.bidirectional` (worker/key_ends.py)

Pan-and-scan (mm_processor_kwargs do_pan_and_scan, off by default): the processor also cuts a
long image into crops; each view (the image, then its crops) is its own run of placeholders,
HF's text around them (multimodal/layouts_gemma.py Gemma3Layout).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.norm import GemmaRMSNorm
from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.vision_transformer import FinalNormTower

ARCH = "Gemma3ForConditionalGeneration"


def image_tokens(config: Any) -> int:
    """Placeholders (= feature rows) of one image; ValueError when the pooling cannot give them."""
    vision = config.vision_config
    patches = int(vision.image_size) // int(vision.patch_size)
    tokens = int(getattr(config, "mm_tokens_per_image", 256))
    side = round(tokens**0.5)
    if side * side != tokens or side <= 0 or patches % side:
        raise ValueError(
            f"mm_tokens_per_image={tokens} must be a square whose side divides the tower's "
            f"{patches} patches a side"
        )
    return tokens


class Projector(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        vision = config.vision_config
        self.patches = int(vision.image_size) // int(vision.patch_size)
        self.kernel = self.patches // round(image_tokens(config) ** 0.5)
        width = int(vision.hidden_size)
        self.mm_input_projection_weight = nn.Parameter(
            torch.empty(width, int(config.text_config.hidden_size))
        )
        self.mm_soft_emb_norm = GemmaRMSNorm(width, float(vision.layer_norm_eps))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, patches^2, Dv] -> [N, tokens, Dt]
        n, _, width = x.shape
        grid = x.transpose(1, 2).reshape(n, width, self.patches, self.patches)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)


class _VisionTower(nn.Module):  # the checkpoint's `vision_tower.vision_model` nesting
    def __init__(self, vision_config: Any) -> None:
        super().__init__()
        self.vision_model = FinalNormTower(vision_config)


class Gemma3ImageEncoder(nn.Module):
    """Images -> rows of the text model's input embedding (one row per placeholder)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.vision_tower = _VisionTower(config.vision_config)
        self.multi_modal_projector = Projector(config)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, 3, S, S] -> [N, tokens, D]
        return self.multi_modal_projector(self.vision_tower.vision_model.last(pixels))

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        weight = self.multi_modal_projector.mm_input_projection_weight
        pixels = torch.stack([m.pixel_values for m in images])  # type: ignore[misc]
        return list(self(pixels.to(weight.device, weight.dtype)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `[model.]vision_tower[.vision_model].*` and
        `[model.]multi_modal_projector.*` tensors (the tower's pooling head, unused, and any
        other name are passed over); ValueError naming a missing or unexpected one."""

        tower = "vision_tower.vision_model."

        def ours(name: str) -> str | None:
            name = name.removeprefix("model.")
            if name.startswith("vision_tower.") and not name.startswith(tower):
                name = tower + name.removeprefix("vision_tower.")  # transformers 5's saves
            if name.startswith(tower + "head."):
                return None
            return name if name.startswith((tower, "multi_modal_projector.")) else None

        picked = ((n, t) for n, t in ((ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self, picked)
