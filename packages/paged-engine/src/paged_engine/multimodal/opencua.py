"""OpenCUA's image path (`OpenCUAForConditionalGeneration`, remote code: xlangai/OpenCUA-7B /
-32B; config models/opencua_config.py), as vLLM's opencua.py runs it.

    image -> Qwen2VLImageProcessor (the release's preprocessor_config.json, its top-level
        min_pixels / max_pixels): patch rows [t*h*w, 3 * tp * p * p], resized to multiples
        of patch * merge pixels
    -> Qwen2.5-VL's vision tower and merger (multimodal/qwen2_vl_vision.py: windows,
       full-attention blocks, the 2 x 2 patch merger) -> [t*h*w / merge^2, text hidden]
    prompt: each "<|media_placeholder|>" repeated once per merged patch (vLLM's prompt
        replacement; layouts_qwen.Exaone45Layout), the Qwen2 decoder at plain 1-D positions:
        OpenCUA replaced Qwen2.5-VL's M-RoPE by 1-D RoPE, so there is no M-RoPE table

Weights: the release's `vision_tower.*` (also `visual.*` / `model.visual.*`, the names vLLM's
hf_to_vllm_mapper takes too) here; the decoder's `language_model.model.*` /
`language_model.lm_head.*` (models/text_wrappers.py). Videos are refused by the input processor
(multi_modal_data['video']): vLLM's OpenCUA takes images only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from paged_engine.models.opencua_config import TOWER_TYPES
from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.qwen2_vl import QwenImageEncoder
from paged_engine.multimodal.qwen2_vl_vision import QwenVisionEncoder

_TOWER_PREFIXES = ("vision_tower.", "model.visual.", "visual.")


def _ours(name: str) -> str | None:
    """A checkpoint name as this encoder's (`visual.*`); None for the decoder's."""
    for prefix in _TOWER_PREFIXES:
        if name.startswith(prefix):
            return "visual." + name.removeprefix(prefix)
    return None


class OpenCUAImageEncoder(QwenImageEncoder):
    """Images -> rows of the Qwen2 decoder's input embedding, one per placeholder."""

    def __init__(self, config: Any) -> None:
        nn.Module.__init__(self)
        kind = getattr(config.vision_config, "model_type", None)
        if kind not in TOWER_TYPES:
            raise ValueError(f"vision_config.model_type={kind!r} is not supported: {TOWER_TYPES}")
        self.visual = QwenVisionEncoder(config.vision_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The tower's tensors (the decoder's passed over); ValueError naming a missing or
        unexpected one."""
        picked = ((n, t) for n, t in ((_ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self, picked)
