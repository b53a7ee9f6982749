"""HyperCLOVA X SEED Vision V2's image path (HyperCLOVAXVisionV2ForConditionalGeneration):
Qwen2.5-VL's tower, a linear projector, the HyperCLOVA X decoder at plain 1-D positions.

    image -> Qwen2VLImageProcessor(Pil) (the auto class transformers names for it): patch rows
        [t*h*w, 3 * tp * p * p], resized to multiples of patch * merge pixels
    -> Qwen2.5-VL's vision tower (multimodal/qwen2_vl_vision.py: windows, full-attention
       blocks, the 2 x 2 patch merger) -> [t*h*w / merge^2, out_hidden_size]
    -> projector: one biased linear -> [t*h*w / merge^2, text hidden]
    prompt: HyperCLOVAXVisionV2Processor repeats the lone <|image_pad|> once per merged patch
        (Qwen2-VL's runs: layouts_qwen.Exaone45Layout, no M-RoPE table: the wrapper's
        prepare_inputs_for_generation drops position_ids, so the decoder rotates by arange)
    text model: HyperCLOVA X (models/hyperclovax.py; its logits times logits_scaling, as the
        wrapper's own head multiplies them)

Weights: transformers 5 saves `model.vision_model.*` and `model.vision_projector.*` (its
conversion mapping renames the projector to `model.projector` in memory; both names are taken
here), the Hub's release the same with the text model under `model.language_model.model.` /
`model.language_model.lm_head.` (models/text_wrappers.py maps them). Refused by name: a tower
other than Qwen2.5-VL's (vision_config.model_type) and what qwen2_vl_vision.py refuses of its
fields. Videos are refused by the input processor (multi_modal_data['video']).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.qwen2_vl import QwenImageEncoder
from paged_engine.multimodal.qwen2_vl_vision import QwenVisionEncoder

ARCH = "HyperCLOVAXVisionV2ForConditionalGeneration"
TOWER_TYPE = "qwen2_5_vl_vision"
_TOWER = "vision_model."
_PROJECTORS = ("vision_projector.", "projector.")  # transformers 5's save, its in-memory name


def _ours(name: str) -> str | None:
    """A checkpoint name as this encoder's (`visual.*`, `projector.*`); None for the rest."""
    name = name.removeprefix("model.")
    if name.startswith(_TOWER):
        return "visual." + name.removeprefix(_TOWER)
    for prefix in _PROJECTORS:
        if name.startswith(prefix):
            return "projector." + name.removeprefix(prefix)
    return None


class HyperCLOVAXVisionV2ImageEncoder(QwenImageEncoder):
    """Images -> rows of the text model's input embedding, one per placeholder."""

    def __init__(self, config: Any) -> None:
        nn.Module.__init__(self)
        vision = config.vision_config
        kind = getattr(vision, "model_type", None)
        if kind != TOWER_TYPE:
            raise ValueError(f"vision_config.model_type={kind!r} is not supported: {TOWER_TYPE!r}")
        self.visual = QwenVisionEncoder(vision)
        self.projector = nn.Linear(self.visual.out_dim, int(config.text_config.hidden_size))

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        rows = self.projector(self._tower(images))  # [sum of runs, text hidden]
        return list(rows.split([m.length for m in images]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The tower's and the projector's tensors (the text model's passed over); ValueError
        naming a missing or unexpected one."""
        picked = ((n, t) for n, t in ((_ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self, picked)
