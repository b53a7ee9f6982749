"""EXAONE 4.5's image path (Exaone4_5_ForConditionalGeneration): Qwen2.5-VL's tower with
grouped-query attention, Qwen2-VL's prompt runs, and plain 1-D text positions.

    image -> Qwen2VLImageProcessor(Pil) (the auto class transformers names for exaone4_5): patch
        rows [t*h*w, 3 * tp * p * p], resized to multiples of patch * merge pixels
    -> the vision encoder ("visual": multimodal/qwen2_vl_vision.py's Qwen2.5-VL tower)
        -> [t*h*w / merge^2, text hidden]
    prompt: the chat template's lone <|image_pad|> repeated once per merged patch
        (Exaone4_5_Processor is Qwen2VLProcessor's replace_image_token: a run layout)

What differs from Qwen2.5-VL, as transformers runs it:
- The tower's attention is grouped-query: `attn.qkv` holds num_heads query heads, then
  vision_config.num_key_value_heads key heads and as many value heads (rows q | k | v); query
  head j reads key / value head j // (num_heads / num_key_value_heads) (HF's repeat_kv).
  Everything else (patch embedding, RMSNorms eps 1e-6, windows and fullatt_block_indexes, the
  axial 2-D rope of head_dim / 4 frequencies per axis, gated MLP, merger) is Qwen2.5-VL's.
- The decoder is EXAONE 4.0's (models/exaone4.py through models/text_wrappers.py) and rotates
  by the token's sequence position: Exaone4_5_Model builds position_ids as arange, no M-RoPE
  table (so layouts_qwen.Exaone45Layout has none, and no mrope_section is read).

Refused by name: vision_config.num_key_value_heads not dividing num_heads, and the tower's
fields as qwen2_vl_vision.py refuses them. Videos are refused by the input processor
(multi_modal_data['video']).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from paged_engine.multimodal import qwen2_vl_vision as qwen
from paged_engine.multimodal.qwen2_vl import QwenImageEncoder

MODEL_TYPE = "exaone4_5_vision"


class _GroupedAttention(nn.Module):
    """Qwen2.5-VL's tower attention with fewer key / value heads than query heads."""

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, (num_heads + 2 * num_kv_heads) * self.head_dim)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[torch.Tensor]
    ) -> torch.Tensor:  # x: [P, D]
        rows, d, kv = x.shape[0], self.head_dim, self.num_kv_heads
        q, k, v = self.qkv(x).split([self.num_heads * d, kv * d, kv * d], dim=-1)
        q, k, v = q.view(rows, -1, d), k.view(rows, kv, d), v.view(rows, kv, d)
        repeat = self.num_heads // kv  # query head j reads key / value head j // repeat
        k = qwen._rotate(k, cos, sin).repeat_interleave(repeat, dim=1)
        v = v.repeat_interleave(repeat, dim=1)
        out = qwen._segment_attention(qwen._rotate(q, cos, sin), k, v, groups)
        return self.proj(out.reshape(rows, -1))


class Exaone45VisionEncoder(qwen.QwenVisionEncoder):
    """`visual` of HF's Exaone4_5_ForConditionalGeneration: Qwen2.5-VL's, grouped-query."""

    def __init__(self, vision_config: Any) -> None:
        model_type = getattr(vision_config, "model_type", None)
        if model_type != MODEL_TYPE:
            raise ValueError(
                f"vision_config.model_type={model_type!r} is not supported; supported: "
                f"{MODEL_TYPE!r}"
            )
        num_heads = qwen._int_field(vision_config, "num_heads")
        num_kv = qwen._int_field(vision_config, "num_key_value_heads")
        if num_heads % num_kv:
            raise ValueError(
                f"vision_config.num_key_value_heads={num_kv} must divide num_heads={num_heads}"
            )
        depth = qwen._int_field(vision_config, "depth")
        # Qwen2.5-VL's fields and checks on a view of the config under its model_type, one
        # block deep (its full-width qkv is replaced: no tower-sized transient allocation)
        view = copy.copy(vision_config)
        view.model_type, view.depth = "qwen2_5_vl_vision", 1
        super().__init__(view)
        width = qwen._int_field(vision_config, "hidden_size")
        hidden = qwen._int_field(vision_config, "intermediate_size")
        act = vision_config.hidden_act

        def block() -> nn.Module:
            mlp = qwen._GatedMLP(width, hidden, act)
            out = qwen._Block(width, num_heads, mlp, rms=True)
            out.attn = _GroupedAttention(width, num_heads, num_kv)
            return out

        self.blocks = nn.ModuleList(block() for _ in range(depth))


class Exaone45ImageEncoder(QwenImageEncoder):
    """Images -> rows of the text model's input embedding, one per placeholder."""

    def __init__(self, config: Any) -> None:
        nn.Module.__init__(self)
        self.visual = Exaone45VisionEncoder(config.vision_config)
