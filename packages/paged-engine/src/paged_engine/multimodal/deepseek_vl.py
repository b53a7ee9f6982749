"""DeepSeek-VL's image path (DeepseekVLForConditionalGeneration: SigLIP, an MLP aligner, Llama).

    image -> the checkpoint's DeepseekVL image processor: longest side resized to S, padded to
        S x S with the mean colour -> pixels [3, S, S]
        -> SigLIP tower (every layer, post_layernorm: transformers' last_hidden_state; the
           pooling head unused) -> (S / patch)^2 rows
        -> aligner: linear1 -> GELU (exact) -> linear2, with biases
        -> (S / patch)^2 rows of text hidden_size
    prompt: DeepseekVLProcessor replaces each image token (`<image_placeholder>` on the Hub)
        by a run of num_image_tokens of it (576 = (384 / 16)^2 for the released checkpoints:
        HF's model needs it to equal the tower's patches, so the tower decides here)
    text model: Llama (models/text_wrappers.py)

Weights: `[model.]vision_model.[vision_model.]*` (transformers 5 saves the tower's names
without SiglipVisionModel's inner `vision_model`, older saves with it) and `[model.]aligner.*`.
Refused by name: a tower other than SigLIP's (vision_config.model_type); mm_processor_kwargs
size other than the tower's side, min_size past it (`check_kwargs`). DeepSeek-VL's hybrid
form (a SAM high-resolution tower beside SigLIP) builds on this file: deepseek_vl_hybrid.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import Layout
from paged_engine.multimodal.vision_transformer import FinalNormTower

ARCH = "DeepseekVLForConditionalGeneration"
_TOWER = "vision_model."


def image_tokens(config: Any) -> int:
    """Placeholders (= feature rows) of one image: the SigLIP tower's patches."""
    vision = getattr(config, "vision_config", None)
    kind = getattr(vision, "model_type", None)
    if kind != "siglip_vision_model":
        raise ValueError(
            f"vision_config.model_type={kind!r} is not supported: 'siglip_vision_model'"
        )
    side, patch = int(vision.image_size), int(vision.patch_size)
    if side <= 0 or patch <= 0 or side % patch:
        raise ValueError(
            f"vision_config.image_size={side} must be a positive multiple of patch_size={patch}"
        )
    return (side // patch) ** 2


def tower_name(name: str) -> str | None:
    """A checkpoint name without `model.` and with the SigLIP tower's as ours; None for the
    tower's pooling head (unused)."""
    name = name.removeprefix("model.")
    if name.startswith(_TOWER + _TOWER):  # older saves: SiglipVisionModel's nesting
        name = name.removeprefix(_TOWER)
    return None if name.startswith(_TOWER + "head.") else name


class DeepseekVLLayout(Layout):
    """A run of (S / patch)^2 image tokens an image; pixels [3, S, S] (LLaVA 1.5's layout)."""

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        self.config = config
        self.placeholder = placeholder
        self.fixed = image_tokens(config)

    def check_kwargs(self, kwargs: dict[str, Any]) -> None:
        """mm_processor_kwargs refused before any pixel is made: a `size` (or the hybrid's
        `high_res_size`) other than the towers' sides, a `min_size` past them (each side is
        floored at min_size before the padding: 10**6 would allocate a 10**12-pixel image)."""
        side = int(self.config.vision_config.image_size)
        sides = {"size": side, **self._more_sides()}
        for name, want in sides.items():
            got = kwargs.get(name)
            if got is not None and got != {"height": want, "width": want}:
                raise ValueError(
                    f"mm_processor_kwargs[{name!r}] must be {{'height': {want}, 'width': "
                    f"{want}}} (the tower's image side), got {got!r}"
                )
        low = kwargs.get("min_size", 1)
        if isinstance(low, bool) or not isinstance(low, int) or not 0 <= low <= min(sides.values()):
            raise ValueError(
                f"mm_processor_kwargs['min_size'] must be an int in [0, {min(sides.values())}], "
                f"got {low!r}"
            )

    def _more_sides(self) -> dict[str, int]:
        """Other sizes the processor takes, by name (the hybrid's SAM side)."""
        return {}


class _Aligner(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        vision, text = int(config.vision_config.hidden_size), int(config.text_config.hidden_size)
        self.linear1 = nn.Linear(vision, text)
        self.activation = get_act_fn("gelu")
        self.linear2 = nn.Linear(text, text)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, P, Dv] -> [N, P, Dt]
        return self.linear2(self.activation(self.linear1(x)))


class DeepseekVLImageEncoder(nn.Module):
    """Images -> rows of the text model's input embedding (one row per placeholder)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.tokens = image_tokens(config)
        self.vision_model = FinalNormTower(config.vision_config)
        self.aligner = _Aligner(config)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, 3, S, S] -> [N, P, D]
        return self.aligner(self.vision_model.last(pixels))

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        weight = self.aligner.linear1.weight
        pixels = torch.stack([m.pixel_values for m in images])  # type: ignore[misc]
        return list(self(pixels.to(weight.device, weight.dtype)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `[model.]vision_model.[vision_model.]*` and `[model.]aligner.*`
        tensors (the pooling head and any other name passed over); ValueError naming a missing
        or unexpected one."""

        def ours(name: str) -> str | None:
            name = tower_name(name)
            return name if name is not None and name.startswith((_TOWER, "aligner.")) else None

        picked = ((n, t) for n, t in ((ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self, picked)
