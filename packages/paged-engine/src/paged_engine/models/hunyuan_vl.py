"""HunyuanOCR's language model (`HunYuanVLTextForCausalLM`, text_config "hunyuan_vl_text" of
HunYuanVLForConditionalGeneration): Hunyuan's dense decoder (models/hunyuan.py: q / k norms
after the rope, the NTK-alpha base) whose rope turns each head dim by one of several position
axes, as transformers' HunYuanVLRotaryEmbedding does ("xdrope"):

    rope_parameters.mrope_section [s_0, ..., s_{n-1}] (n >= 3, summing to head_dim / 2)
    dim j of the head (0 <= j < head_dim) rotates at frequency j mod head_dim / 2 by axis
    a(j): the first 2 s_0 dims axis 0, the next 2 s_1 axis 1, ... (transformers splits the
    doubled [freqs | freqs] row, so a NeoX pair (j, j + head_dim / 2) may take two axes)

The axes are (position..., width, height, image index): text tokens have their position on
every axis (the plain rope: what this class runs for [T] positions), an image's grid tokens
their column, row and image ordinal on the last three (multimodal/hunyuan_vl.py builds the
table). The runner carries three rows of rope positions; `XdRotaryEmbedding.axes` reads the
packing multimodal/hunyuan_vl.py writes. Refused by name: a partial_rotary_factor other than 1,
fewer than three sections, sections not summing to head_dim / 2.
"""

from __future__ import annotations

import copy

import torch

from paged_engine.layers.rotary import RotaryEmbedding, RowsRotaryEmbedding, get_rope
from paged_engine.models.deepseek_v2 import DeepseekModel
from paged_engine.models.hunyuan import HunYuanAttention, HunYuanDenseV1ForCausalLM
from paged_engine.models.llama import llama_head_dim
from paged_engine.models.mixtral import check_silu
from paged_engine.models.utils import CausalLMBase

# an image grid token's third row: -(1 + height + PACK * image index); text rows are >= 0
PACK = 1 << 24


def xd_sections(config) -> list[int] | None:
    params = getattr(config, "rope_parameters", None) or {}
    sections = params.get("mrope_section") if isinstance(params, dict) else None
    return None if sections is None else [int(s) for s in sections]


class XdRotaryEmbedding(RowsRotaryEmbedding):
    """A plain rope's tables, turned per head dim by the axis its section gives (see above)."""

    def __init__(self, plain: RotaryEmbedding, sections: list[int]) -> None:
        torch.nn.Module.__init__(self)
        d = plain.head_dim
        if plain.rotary_dim != d or not plain.is_neox_style:
            raise ValueError(
                "text_config.rope_parameters.partial_rotary_factor must be 1 for HunyuanOCR's "
                "multi-axis rope"
            )
        if len(sections) < 3 or sum(sections) * 2 != d:
            raise ValueError(
                f"text_config.rope_parameters.mrope_section={sections} must be at least three "
                f"sizes summing to {d // 2} (half of head_dim)"
            )
        self.head_dim, self.rotary_dim, self.is_neox_style = d, d, True
        self.attention_factor = plain.attention_factor
        self.num_axes = len(sections)
        self.register_buffer("cos", plain.cos, persistent=False)
        self.register_buffer("sin", plain.sin, persistent=False)
        axis = torch.repeat_interleave(torch.arange(len(sections)), torch.tensor(sections) * 2)
        self.register_buffer("dim_axis", axis, persistent=False)  # [D]: each dim's axis
        self.register_buffer("dim_freq", torch.arange(d) % (d // 2), persistent=False)

    def axes(self, positions: torch.Tensor) -> torch.Tensor:
        """[3, T] rows (position, width, height / packed) -> [n, T] axis positions."""
        pos, width, third = positions
        packed = third < 0
        code = -1 - third
        height = torch.where(packed, code % PACK, third)
        index = torch.where(packed, code // PACK, third)
        lead = pos.expand(self.num_axes - 3, -1)
        return torch.cat((lead, torch.stack((width, height, index))))

    def begin_forward(self, positions: torch.Tensor) -> None:
        if positions.dim() == 1:
            super().begin_forward(positions)
        else:  # rotate_heads declines: the layers call forward
            self._positions, self._tables = None, None

    def forward_rows(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        index = self.axes(positions)[self.dim_axis].T  # [T, D]: dim j's position
        cos = self.cos[index, self.dim_freq].unsqueeze(1)  # [T, 1, D] float32
        sin = self.sin[index, self.dim_freq].unsqueeze(1)
        t, half = q.shape[0], self.head_dim // 2

        def rotate(x: torch.Tensor) -> torch.Tensor:
            xf = x.view(t, -1, self.head_dim).float()
            swapped = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
            return (xf * cos + swapped * sin).to(x.dtype).reshape(t, -1)

        return rotate(q), rotate(k)


class HunYuanVLTextForCausalLM(HunYuanDenseV1ForCausalLM):
    def __init__(self, config) -> None:
        check_silu(config, type(self).__name__)
        head_dim = llama_head_dim(config)
        sections = xd_sections(config)
        plain = copy.copy(config)
        params = getattr(config, "rope_parameters", None)
        if isinstance(params, dict):
            plain.rope_parameters = {k: v for k, v in params.items() if k != "mrope_section"}
        rope = get_rope(plain, head_dim)  # NTK-alpha: layers/rotary.py
        if sections is not None:
            rope = XdRotaryEmbedding(rope, sections)
        inner = DeepseekModel(config, type(self).build_mlp, HunYuanAttention, rope)
        CausalLMBase.__init__(self, config, inner)
