"""ViP-LLaVA's image path (VipLlavaForConditionalGeneration): LLaVA's, with a normed projector.

    pixels [N, 3, S, S] -> VisionTransformer hidden_states at each of vision_feature_layer
        (-2, -5, -8, -11, 6 for the released checkpoints), the first token (CLIP's CLS)
        dropped from each, concatenated on the feature axis -> [N, L, k * vision hidden]
        -> multi_modal_projector: projector_layernorm -> linear_1 -> act -> linear_2
        -> [N, L, text hidden]

Everything else is LLaVA 1.5's (multimodal/llava.py): a fixed run of `<image>` placeholders
an image (the checkpoint's LlavaProcessor writes it), the tower built up to the deepest layer
read, the same weight names with `multi_modal_projector.projector_layernorm.*` added. HF's
config has no vision_feature_select_strategy: its model always drops the first token, which is
llava.select_strategy's "default". The projector's linears always have biases (HF's do).
"""

from __future__ import annotations

import torch
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.multimodal.llava import LlavaImageEncoder

ARCH = "VipLlavaForConditionalGeneration"


class VipLlavaProjector(nn.Module):
    def __init__(self, config, num_feature_layers: int) -> None:
        super().__init__()
        width = config.vision_config.hidden_size * num_feature_layers
        text = config.text_config.hidden_size
        eps = float(getattr(config, "projector_layernorm_eps", 1e-5))
        self.projector_layernorm = nn.LayerNorm(width, eps=eps)
        self.linear_1 = nn.Linear(width, text)
        self.act = get_act_fn(config.projector_hidden_act, "projector_hidden_act")
        self.linear_2 = nn.Linear(text, text)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, L, k * vision] -> [N, L, text]
        return self.linear_2(self.act(self.linear_1(self.projector_layernorm(x))))


class VipLlavaImageEncoder(LlavaImageEncoder):
    """Images -> rows of the text model's input embedding (one row per placeholder)."""

    projector_class = VipLlavaProjector
