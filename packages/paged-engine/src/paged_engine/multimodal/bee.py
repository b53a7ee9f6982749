"""Bee-8B's images (`BeeForConditionalGeneration`, remote code; vLLM's models/bee.py): the
model is LLaVA-OneVision's (multimodal/llava_next.py: SigLIP tower, anyres tile map scaled down
past "anyres_max_N", `image_newline` per row; the config: models/bee_config.py) with Bee's own
projector:

    features [N, L, C] -> pre_norm (LayerNorm over C, eps 1e-6) -> linear_1 (C -> 4 D, bias)
        -> GELU (exact) -> linear_2 (4 D -> D, bias)        (LLaVA's: C -> D -> D, no norm)

The prompt side is vLLM's: LLaVA-NeXT's placeholder count on every image (`AnyRes.tokens`,
with OneVision's scaling), so an image among several keeps its tiles too (HF OneVision's
processor would give it one padded view; vLLM's Bee processor does not). Pixels: transformers'
LlavaOnevisionImageProcessor with preprocessor_config.json's settings (the release saves its
own processor class; vLLM runs it as LLaVA-NeXT's anyres tiles), one image a call, so each is
tiled; a saved `size` other than the tower's square or pinpoints other than config.json's are
refused by name (the tiles would not fit the model's grid).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from paged_engine.models.bee_config import ARCH
from paged_engine.multimodal.layouts_single_run import AnyResLayout
from paged_engine.multimodal.llava_next import LlavaNextImageEncoder
from paged_engine.multimodal.torch_processors import saved_settings

PRE_NORM_EPS = 1e-6  # vLLM's BeeMultiModalProjector.pre_norm
WIDEN = 4  # linear_1's output: 4 x the text hidden size
# preprocessor_config.json settings LlavaOnevisionImageProcessor takes
_SETTINGS = (
    "do_convert_rgb",
    "do_resize",
    "resample",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
    "do_pad",
)


class BeeProjector(nn.Module):
    """Bee's multi_modal_projector (module doc); built as LLaVA's, (config, feature layers)."""

    def __init__(self, config: Any, num_feature_layers: int) -> None:
        super().__init__()
        if num_feature_layers != 1:
            raise ValueError(
                f"vision_feature_layer={config.vision_feature_layer!r} is not supported for "
                f"{ARCH}: one layer (pre_norm normalizes one tower width)"
            )
        vision, text = config.vision_config.hidden_size, config.text_config.hidden_size
        self.pre_norm = nn.LayerNorm(vision, eps=PRE_NORM_EPS)
        self.linear_1 = nn.Linear(vision, WIDEN * text)
        self.act = nn.GELU()
        self.linear_2 = nn.Linear(WIDEN * text, text)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, L, C] -> [N, L, D]
        return self.linear_2(self.act(self.linear_1(self.pre_norm(x))))


class BeeImageEncoder(LlavaNextImageEncoder):
    """LLaVA-OneVision's encoder with Bee's projector."""

    projector_class = BeeProjector


class BeeLayout(AnyResLayout):
    """LLaVA-NeXT's runs and views on every image (module doc); pixels from the saved
    settings."""

    saved: dict[str, Any] | None = None

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        super().__init__(config, placeholder, tokenizer)
        self.by_count = False  # vLLM's count: tiles whatever the prompt's image count

    def read_saved(self, path: Path) -> None:
        """The saved image settings (preprocessor_config.json, or transformers 5's
        processor_config.json), their size and pinpoints checked (module doc)."""
        saved = saved_settings(Path(path))
        if not saved:
            raise ValueError(
                f"{path} has no preprocessor_config.json: {ARCH}'s image settings (mean, std, "
                "pinpoints) are needed to run its images (pass limit_mm_per_prompt={'image': 0} "
                "to serve its text model only)"
            )
        side = self.anyres.image_size
        size = saved.get("size", {"height": side, "width": side})
        square = {"height": side, "width": side}
        if isinstance(size, int):
            size = {"height": size, "width": size}
        if not isinstance(size, dict) or {k: size.get(k) for k in square} != square:
            raise ValueError(
                f"preprocessor_config.json field size={size!r} is not supported for {ARCH}: "
                f"{square} (the vision tower's image_size)"
            )
        points = saved.get("image_grid_pinpoints")
        pairs = [list(p) for p in self.anyres.pinpoints]
        if points is not None and points != pairs:
            raise ValueError(
                f"preprocessor_config.json field image_grid_pinpoints={points!r} differs from "
                f"config.json's {pairs!r}: the tiles would not match the model's grid ({ARCH})"
            )
        self.saved = saved

    def image_processor(self) -> Any:
        import transformers

        saved = self.saved or {}
        side = self.anyres.image_size
        return transformers.LlavaOnevisionImageProcessor(
            size={"height": side, "width": side},
            image_grid_pinpoints=[list(p) for p in self.anyres.pinpoints],
            **{k: saved[k] for k in _SETTINGS if saved.get(k) is not None},
        )
