"""dots.ocr's image path (`DotsOCRForCausalLM`, remote code: rednote-hilab/dots.ocr; config
models/dots_ocr_config.py), as vLLM's dots_ocr.py runs it.

    image -> Qwen2VLImageProcessor (the release's preprocessor_config.json): patch rows
        [t*h*w, C * tp * p * p] in merge-block order, resized to multiples of patch * merge
    -> the NaViT tower (`vision_tower.*`, DotsVisionTransformer):
        patch_embed.patchifier: a Conv2d (bias) over each patch's first temporal frame, run as
            one matmul, then an RMSNorm (vision_config.rms_norm_eps)
        blocks: x = x + attn(norm1(x), 2-D rope); x = x + mlp(norm2(x)); RMSNorms, attention
            over each whole frame (no windows), qkv / proj / fc1 / fc2 / fc3 biased iff use_bias
            (the release's false; models/dots_ocr_config.py refuses true), mlp =
            fc2(silu(fc1(x)) * fc3(x))
        post_trunk_norm: an RMSNorm (post_norm: the release's true, false refused)
        merger: Qwen2-VL's (LayerNorm eps 1e-6 ln_q, m*m patches concatenated, Linear, GELU,
            Linear) -> [t*h*w / m**2, LM hidden]
    prompt: "<|img|><|imgpad|><|endofimg|>", the lone <|imgpad|> repeated once per merged patch
        (Qwen2VLProcessor with image_token "<|imgpad|>": layouts_qwen.Exaone45Layout); the Qwen2
        decoder rotates by plain 1-D positions (vLLM runs its Qwen2ForCausalLM), no M-RoPE table

The rope is Qwen2-VL's (multimodal/qwen2_vl_vision.py: head_dim / 4 frequencies, theta 10000, by
row then column, rotate-half); the patch order, frame segments and merger are that file's too.
Weights: `vision_tower.*` here (the attention's `qkv_proj` / `out_proj`, names vLLM also maps,
taken as `qkv` / `proj`), the LM's `model.*` / `lm_head.*` (models/text_wrappers.py).
Videos are refused by the input processor (multi_modal_data['video']).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.norm import RMSNorm
from paged_engine.models.dots_ocr_config import TOWER_TYPE
from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal import qwen2_vl_vision as qwen
from paged_engine.multimodal.qwen2_vl import QwenImageEncoder

_PREFIX = "vision_tower."
# the attention's names as vLLM maps them (a port's) -> the release's
_RENAMES = ((".attn.qkv_proj.", ".attn.qkv."), (".attn.out_proj.", ".attn.proj."))
_ROPE_THETA = 10000.0


class _Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, bias: bool) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)  # rows: q | k | v, each head-major
        self.proj = nn.Linear(dim, dim, bias=bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[torch.Tensor]
    ) -> torch.Tensor:  # x: [P, D]
        rows = x.shape[0]
        q, k, v = self.qkv(x).view(rows, 3, self.num_heads, -1).unbind(1)
        q, k = qwen._rotate(q, cos, sin), qwen._rotate(k, cos, sin)
        return self.proj(qwen._segment_attention(q, k, v, groups).reshape(rows, -1))


class _SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)  # gate
        self.fc3 = nn.Linear(dim, hidden, bias=bias)  # up
        self.fc2 = nn.Linear(hidden, dim, bias=bias)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.fc1(x)) * self.fc3(x))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, eps: float, bias: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(dim, eps), RMSNorm(dim, eps)
        self.attn = _Attention(dim, heads, bias)
        self.mlp = _SwiGLU(dim, hidden, bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[torch.Tensor]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, groups)
        return x + self.mlp(self.norm2(x))


class _PatchEmbed(nn.Module):
    """The release's patchifier: a Conv2d whose kernel is the whole patch over the first of a
    row's tp frames (one matmul), then an RMSNorm."""

    def __init__(self, channels: int, temporal: int, patch: int, dim: int, eps: float) -> None:
        super().__init__()
        self.channels, self.temporal = channels, temporal
        self.proj = nn.Conv2d(channels, dim, patch, stride=patch)
        self.norm = RMSNorm(dim, eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [P, C*tp*p*p] -> [P, D]
        weight = self.proj.weight
        rows = pixels.to(weight.device, weight.dtype).view(pixels.shape[0], self.channels, -1)
        first = rows.unflatten(2, (self.temporal, -1))[:, :, 0].flatten(1)  # [P, C*p*p]
        return self.norm(F.linear(first, weight.flatten(1), self.proj.bias))


class DotsVisionTower(nn.Module):
    """The release's `vision_tower` (DotsVisionTransformer), names as its checkpoint's."""

    def __init__(self, vision: Any) -> None:
        super().__init__()
        kind = getattr(vision, "model_type", None)
        if kind != TOWER_TYPE:
            raise ValueError(f"vision_config.model_type={kind!r} is not supported: {TOWER_TYPE!r}")
        width = qwen._int_field(vision, "embed_dim")
        heads = qwen._int_field(vision, "num_attention_heads")
        self.head_dim = qwen._head_dim(vision, width, heads)
        self.patch_size = qwen._int_field(vision, "patch_size")
        self.temporal_patch_size = qwen._int_field(vision, "temporal_patch_size")
        self.in_channels = qwen._int_field(vision, "num_channels")
        self.merge = qwen._int_field(vision, "spatial_merge_size")
        self.out_dim = qwen._int_field(vision, "hidden_size")
        hidden = qwen._int_field(vision, "intermediate_size")
        eps, bias = float(vision.rms_norm_eps), bool(vision.use_bias)
        self.patch_embed = _PatchEmbed(
            self.in_channels, self.temporal_patch_size, self.patch_size, width, eps
        )
        depth = qwen._int_field(vision, "num_hidden_layers")
        self.blocks = nn.ModuleList(_Block(width, heads, hidden, eps, bias) for _ in range(depth))
        self.post_trunk_norm = RMSNorm(width, eps) if vision.post_norm else None
        self.merger = qwen._PatchMerger(width, self.out_dim, self.merge, rms=False)

    # (row, column) of each patch in merge-block order: Qwen2-VL's, which reads self.merge only
    _positions = qwen.QwenVisionEncoder._positions

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]
    ) -> torch.Tensor:
        """pixel_values [sum t*h*w, C*tp*p*p]; grid_thw: each image's (t, h, w) in patches
        -> [sum t*h*w / m**2, hidden_size]."""
        width = self.in_channels * self.temporal_patch_size * self.patch_size**2
        grids = qwen._check_grids(pixel_values, grid_thw, self.merge, width)
        x = self.patch_embed(pixel_values)
        device = x.device
        cos, sin = qwen._rotary_tables(self._positions(grids), self.head_dim, _ROPE_THETA, device)
        frames = [g.to(device) for g in qwen._frame_segments(grids)]
        for block in self.blocks:
            x = block(x, cos, sin, frames)
        if self.post_trunk_norm is not None:
            x = self.post_trunk_norm(x)
        return self.merger(x)


def _ours(name: str) -> str | None:
    """A checkpoint name as the tower's own; None for the LM's."""
    if not name.startswith(_PREFIX):
        return None
    name = name.removeprefix(_PREFIX).replace("patch_embed.patchifier.", "patch_embed.")
    for old, new in _RENAMES:
        name = name.replace(old, new)
    return name


class DotsOCRImageEncoder(QwenImageEncoder):
    """Images -> rows of the Qwen2 decoder's input embedding, one per placeholder."""

    def __init__(self, config: Any) -> None:
        nn.Module.__init__(self)
        self.visual = DotsVisionTower(config.vision_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The tower's `vision_tower.*` tensors (the LM's passed over); ValueError naming a
        missing or unexpected one."""
        picked = ((n, t) for n, t in ((_ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self.visual, picked)
