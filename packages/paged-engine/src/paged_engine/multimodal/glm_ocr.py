"""GLM-OCR's image path (GlmOcrForConditionalGeneration): GLM-4.1V's (multimodal/glm4v.py) with
a leaner tower.

The host side is GLM-4.1V's: Glm4vImageProcessor's patch rows, the chat template's lone
<|image|> repeated once per merged patch between <|begin_of_image|> and <|end_of_image|>
(QwenLayout), Qwen2-VL's M-RoPE table (GlmOcrModel's get_rope_index is Glm4vModel's). The text
model is GLM-4.1V's decoder (models/glm4.py through models/text_wrappers.py) with no q / k / v
biases and text_config.head_dim read as given; the Hub's multi-token-prediction layer
(`layers.{num_hidden_layers}`) is another stage's layer to the loader and is passed over.

The tower differs from GLM-4.1V's (multimodal/glm4v_vision.py), as transformers runs it:

    no learned position grid and no post_conv_layernorm: patch_embed's rows enter the blocks
    attention   qkv and proj both with a bias when vision_config.attention_bias; per-head
                RMSNorms q_norm / k_norm (eps rms_norm_eps) on q and k before the 2D rope
    mlp         down(act(gate) * up) of width intermediate_size (GLM-4.1V: out_hidden_size),
                every projection with a bias when attention_bias
    merger      gated width out_hidden_size * in_channels (GLM-4.1V: intermediate_size)
    rope        theta vision_config.rope_parameters.rope_theta (rope_type "axial")

Refused by name: the tower's fields as glm4v_vision.py refuses them, a vision rope_type other
than "axial" / "default"; videos, as for GLM-4.1V.
"""

from __future__ import annotations

import torch
from torch import nn

from paged_engine.layers.norm import RMSNorm
from paged_engine.multimodal import glm4v_vision as glm
from paged_engine.multimodal import qwen2_vl_vision as qwen
from paged_engine.multimodal.qwen2_vl import QwenImageEncoder

MODEL_TYPES = frozenset({"glm_ocr_vision", "glm_ocr"})


class _Attention(glm._Attention):
    """GLM-4.1V's attention with q / k RMSNorms per head before the rope, proj's bias by
    attention_bias."""

    def __init__(self, dim: int, num_heads: int, bias: bool, eps: float) -> None:
        super().__init__(dim, num_heads, bias)
        self.proj = nn.Linear(dim, dim, bias=bias)
        head_dim = dim // num_heads
        self.q_norm, self.k_norm = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[torch.Tensor]
    ) -> torch.Tensor:  # x: [P, D]
        rows = x.shape[0]
        q, k, v = self.qkv(x).view(rows, 3, self.num_heads, -1).unbind(1)  # each [P, H, d]
        q, k = qwen._rotate(self.q_norm(q), cos, sin), qwen._rotate(self.k_norm(k), cos, sin)
        return self.proj(qwen._segment_attention(q, k, v, groups).reshape(rows, -1))


class _Block(glm._Block):
    def __init__(self, dim: int, num_heads: int, mlp: nn.Module, eps: float, bias: bool) -> None:
        super().__init__(dim, num_heads, mlp, eps, bias)
        self.attn = _Attention(dim, num_heads, bias, eps)


class GlmOcrVisionEncoder(glm.Glm4vVisionEncoder):
    """`visual` of HF's GlmOcrForConditionalGeneration (GLM-4.1V's forward and loading)."""

    model_types = MODEL_TYPES
    position_grid = False

    def _block(
        self, config, width: int, num_heads: int, eps: float, bias: bool, act: str
    ) -> nn.Module:
        hidden = qwen._int_field(config, "intermediate_size")
        # Qwen2.5-VL's gated MLP carries biases, GLM-4.1V's none
        mlp = (qwen._GatedMLP if bias else glm._GatedMLP)(width, hidden, act)
        return _Block(width, num_heads, mlp, eps, bias)

    def _merger_width(self, config, hidden: int) -> int:
        return self.out_dim * self.in_channels


class GlmOcrImageEncoder(QwenImageEncoder):
    """Images -> rows of the text model's input embedding, one per placeholder."""

    def __init__(self, config) -> None:
        nn.Module.__init__(self)
        self.visual = GlmOcrVisionEncoder(config.vision_config)
