"""The vision encoder ("visual") of GLM-4.1V, GLM-4.5V and GLM-4.6V (one tower), in HF's names.

Qwen2-VL's tower (multimodal/qwen2_vl_vision.py: the same patch rows in merge-block order, the
same 2D rotary, attention within each frame) with GLM's own pieces, as transformers runs them:

    pixel_values [P, C*tp*p*p]
        -> patch_embed.proj (a Conv3d with bias whose kernel is the whole patch: one matmul)
        -> post_conv_layernorm (RMSNorm, eps rms_norm_eps)
        -> + embeddings.position_embedding: a learned side x side grid (side = image_size /
             patch_size) resampled to the image's h x w patches by bicubic grid_sample
             (align_corners=False, border padding) in float32, cast back
        -> blocks: x = x + attn(norm1(x), 2D rope);  x = x + mlp(norm2(x))
             (RMSNorms of eps rms_norm_eps; qkv with a bias only when attention_bias, proj
             without; mlp down(act(gate) * up) of width out_hidden_size, no biases)
        -> post_layernorm (RMSNorm)
        -> downsample: a Conv2d (with bias) of kernel = stride = merge over each m x m block of
             consecutive patches (one matmul) -> [P / m**2, out_hidden_size]
        -> merger: proj (no bias) -> LayerNorm (eps 1e-5) -> GELU (exact)
             -> down(hidden_act(gate) * up) of width intermediate_size, no biases
        -> [P / m**2, out_hidden_size]  (each image's rows contiguous, in the input's order)

A patch at (row r, column c) of an h x w image samples the position grid at the normalised
point ((c + 0.5) / w * 2 - 1, (r + 0.5) / h * 2 - 1); every frame of an image gets the same
embeddings (HF indexes the image's shape per frame: the same for images, whose t is 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.layers.norm import RMSNorm
from paged_engine.multimodal import qwen2_vl_vision as qwen
from paged_engine.multimodal.qwen2_vl_vision import QwenVisionEncoder, _int_field

# vision_config.model_type values (GLM-4.6V's wrapper builds GLM-4.1V's tower; transformers 4
# named the sub-configs after their wrappers)
MODEL_TYPES = frozenset({"glm4v_vision", "glm4v_moe_vision", "glm4v", "glm4v_moe"})
_MERGER_NORM_EPS = 1e-5  # the merger's nn.LayerNorm default


class _Attention(qwen._Attention):
    """Qwen2-VL's attention; qkv's bias per attention_bias, proj without one."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool) -> None:
        nn.Module.__init__(self)
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)  # rows: q | k | v, each head-major
        self.proj = nn.Linear(dim, dim, bias=False)


class _GatedMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.act_fn = get_act_fn(act, "vision_config.hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _Block(qwen._Block):
    """Qwen2-VL's block (its forward) with GLM's norms, attention and MLP."""

    def __init__(self, dim: int, num_heads: int, mlp: nn.Module, eps: float, bias: bool) -> None:
        nn.Module.__init__(self)
        self.norm1, self.norm2 = RMSNorm(dim, eps), RMSNorm(dim, eps)
        self.attn = _Attention(dim, num_heads, bias)
        self.mlp = mlp


class _Embeddings(nn.Module):
    """The learned position grid, resampled to each image's patch grid."""

    def __init__(self, num_positions: int, dim: int) -> None:
        super().__init__()
        self.side = math.isqrt(num_positions)
        self.position_embedding = nn.Embedding(num_positions, dim)

    def forward(self, grid: tuple[int, int, int], positions: torch.Tensor) -> torch.Tensor:
        """grid: one image's (t, h, w); positions [h*w, 2] (row, column) of one frame's
        patches -> [t*h*w, D] in the table's dtype."""
        table = self.position_embedding.weight
        t, h, w = grid
        side, dim = self.side, table.shape[1]
        image = table.view(side, side, dim).permute(2, 0, 1)[None].float()  # [1, D, side, side]
        pos = positions.to(table.device)
        # float32, in HF's steps: ((index + 0.5) / size) * 2 - 1
        norm_h = ((pos[:, 0] + 0.5) / torch.tensor(float(h))) * 2 - 1
        norm_w = ((pos[:, 1] + 0.5) / torch.tensor(float(w))) * 2 - 1
        points = torch.stack((norm_w, norm_h), dim=-1)[None, :, None]  # [1, h*w, 1, 2]
        sampled = F.grid_sample(
            image, points, mode="bicubic", align_corners=False, padding_mode="border"
        )  # [1, D, h*w, 1]
        return sampled[0, :, :, 0].T.to(table.dtype).repeat(t, 1)


class _PatchMerger(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim, bias=False)
        self.post_projection_norm = nn.LayerNorm(dim, _MERGER_NORM_EPS)
        self.act1 = nn.GELU()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.act_fn = get_act_fn(act, "vision_config.hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, D]
        x = self.act1(self.post_projection_norm(self.proj(x)))
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _float_field(config, name: str) -> float:
    value = getattr(config, name, None)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"vision_config.{name}={value!r} is not supported: a positive number")
    return float(value)


class Glm4vVisionEncoder(QwenVisionEncoder):
    """`visual` of HF's Glm4vForConditionalGeneration / Glm4vMoeForConditionalGeneration /
    Glm46VForConditionalGeneration (QwenVisionEncoder's grid checks, patch positions, frames
    and weight loading)."""

    model_types = MODEL_TYPES
    position_grid = True  # the learned grid and post_conv_layernorm (GLM-OCR has neither)

    def __init__(self, vision_config) -> None:
        nn.Module.__init__(self)
        config = vision_config
        model_type = getattr(config, "model_type", None)
        if model_type not in self.model_types:
            raise ValueError(
                f"vision_config.model_type={model_type!r} is not supported; supported: "
                f"{sorted(self.model_types)}"
            )
        width = _int_field(config, "hidden_size")
        num_heads = _int_field(config, "num_heads")
        depth = _int_field(config, "depth")
        hidden = _int_field(config, "intermediate_size")
        self.patch_size = _int_field(config, "patch_size")
        self.temporal_patch_size = _int_field(config, "temporal_patch_size")
        self.in_channels = _int_field(config, "in_channels", 3)
        self.merge = _int_field(config, "spatial_merge_size")
        self.out_dim = _int_field(config, "out_hidden_size")
        self.head_dim = qwen._head_dim(config, width, num_heads)
        self.rope_theta = qwen._rope_theta(config)
        eps = _float_field(config, "rms_norm_eps")
        bias = getattr(config, "attention_bias", False)
        if not isinstance(bias, bool):
            raise ValueError(f"vision_config.attention_bias={bias!r} is not supported: a bool")
        act = getattr(config, "hidden_act", None)
        if not isinstance(act, str):
            raise ValueError(f"vision_config.hidden_act={act!r} is not supported")
        self.window = None
        self.full_blocks = frozenset(range(depth))

        self.patch_embed = qwen._PatchEmbed(
            self.in_channels, self.temporal_patch_size, self.patch_size, width, bias=True
        )
        if self.position_grid:
            image_size = _int_field(config, "image_size")
            if image_size < self.patch_size:
                raise ValueError(
                    f"vision_config.image_size={image_size} is under one patch ({self.patch_size})"
                )
            self.post_conv_layernorm = RMSNorm(width, eps)
            self.embeddings = _Embeddings((image_size // self.patch_size) ** 2, width)
        self.blocks = nn.ModuleList(
            self._block(config, width, num_heads, eps, bias, act) for _ in range(depth)
        )
        self.post_layernorm = RMSNorm(width, eps)
        m = self.merge
        self.downsample = nn.Conv2d(width, self.out_dim, kernel_size=m, stride=m)
        self.merger = _PatchMerger(self.out_dim, self._merger_width(config, hidden), act)

    def _block(
        self, config, width: int, num_heads: int, eps: float, bias: bool, act: str
    ) -> nn.Module:
        """One tower block (a hook: GLM-OCR's adds q / k norms and MLP biases)."""
        return _Block(width, num_heads, _GatedMLP(width, self.out_dim, act), eps, bias)

    def _merger_width(self, config, hidden: int) -> int:
        """The merger's gated width (a hook: GLM-OCR's is out_hidden_size * in_channels)."""
        return hidden

    def _downsample(self, x: torch.Tensor) -> torch.Tensor:
        """[P, D] -> [P / m**2, out_dim]: each m*m consecutive patches (row-major in their
        block) as one m x m image under the Conv2d, as one matmul."""
        weight = self.downsample.weight  # [out, D, m, m] -> [out, (m, m, D)]
        flat = weight.permute(0, 2, 3, 1).flatten(1)
        return F.linear(x.reshape(-1, flat.shape[1]), flat, self.downsample.bias)

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]
    ) -> torch.Tensor:
        """pixel_values [sum t*h*w, C*tp*p*p] (HF's image processor's, images concatenated);
        grid_thw: each image's (t, h, w) in patches -> [sum t*h*w / m**2, out_dim]."""
        grids = self._grids(pixel_values, grid_thw)
        x = self.patch_embed(pixel_values)
        positions = self._positions(grids)  # [P, 2] (row, column), frames repeated
        if self.position_grid:
            x = self.post_conv_layernorm(x)
            embeds, start = [], 0
            for t, h, w in grids:  # each image's first frame's positions
                embeds.append(self.embeddings((t, h, w), positions[start : start + h * w]))
                start += t * h * w
            x = x + torch.cat(embeds).to(x.dtype)
        cos, sin = qwen._rotary_tables(positions, self.head_dim, self.rope_theta, x.device)
        frames = [g.to(x.device) for g in self._frames(grids)]
        for block in self.blocks:
            x = block(x, cos, sin, frames)
        return self.merger(self._downsample(self.post_layernorm(x)))
