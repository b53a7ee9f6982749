"""DeepSeek-VL2's tower, projector and tile rows (`DeepseekVLV2ForCausalLM`, the Hub's remote
code modeling_deepseek_vl_v2.py / siglip_vit.py; vLLM's deepseek_vl2.py), in the release's
weight names (timm's for the tower).

    view [3, S, S] -> vision (SigLIP in timm's layout): patch_embed.proj (p-pixel conv, the
        last S mod p pixels unread) + pos_embed (no class token) -> blocks (pre-norm; fused
        attn.qkv, attn.proj; mlp.fc1, tanh GELU, mlp.fc2) -> norm -> [g, g, D], g = S // p
        (HF's SiglipVisionModel's last_hidden_state is the same maths; attn_pool, the
        ignored head, is not loaded)
    -> projector: the grid padded with zeros to a multiple of r = downsample_ratio, r x r
        neighbours unfolded into one token (F.unfold's channel-major order) -> layers
        (Linear, then GELU + Linear per further depth) -> [h, h, hidden], h = ceil(g / r)
    rows of a view grid: each row then image_newline; an image's rows: the global view's,
        view_seperator, the tiles' grid (side by side, row-major) with global_view_pos
        "head" (the release's), the other way round with "tail"

vLLM builds timm's tower with dynamic_img_pad, which pads 384-pixel views to 392 and resizes
pos_embed to 28 x 28; the release (and this module) reads 27 x 27 patches and pads the grid in
the projector instead. `ImageInput.pixel_values`: [(1 + wt ht) 3 S S] flat, the global view
first; `image_size` (wt, ht) (multimodal/deepseek_vl2.py makes them).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, L, D]
        n, length, d = x.shape
        q, k, v = self.qkv(x).view(n, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(n, length, d))


class _Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = _Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = _Mlp(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _SiglipTimm(nn.Module):
    """`vision`: the release's timm SigLIP ViT up to its final norm."""

    def __init__(self, v: Any) -> None:
        super().__init__()
        dim, p = v.hidden_size, v.patch_size
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, dim, p, stride=p)
        self.pos_embed = nn.Parameter(torch.zeros(1, (v.image_size // p) ** 2, dim))
        heads, hidden = v.num_attention_heads, v.intermediate_size
        self.blocks = nn.ModuleList(_Block(dim, heads, hidden) for _ in range(v.num_hidden_layers))
        self.norm = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, 3, S, S] -> [N, g g, D]
        x = self.patch_embed.proj(pixels).flatten(2).transpose(1, 2) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def _projector(config: Any) -> nn.Sequential:
    """`projector.layers`: Linear, then (GELU, Linear) per further depth (vLLM's indices)."""
    r, width = config.downsample_ratio, config.vision_config.hidden_size
    hidden = int(config.text_config.hidden_size)
    mid = hidden * config.projector_ratio
    mods: list[nn.Module] = [nn.Linear(width * r * r, mid)]
    for i in range(1, config.projector_depth):
        mods += [nn.GELU(), nn.Linear(mid, hidden if i == config.projector_depth - 1 else mid)]
    return nn.Sequential(*mods)


class DeepseekVL2ImageEncoder(nn.Module):
    """Images -> rows of the text model's input embedding (one row per placeholder)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = int(config.text_config.hidden_size)
        self.ratio = int(config.downsample_ratio)
        self.side = int(config.vision_config.image_size)
        self.head = config.global_view_pos == "head"
        self.vision = _SiglipTimm(config.vision_config)
        self.projector = nn.Module()
        self.projector.layers = _projector(config)
        self.image_newline = nn.Parameter(torch.zeros(hidden))
        self.view_seperator = nn.Parameter(torch.zeros(hidden))  # (the release's spelling)

    def views(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, 3, S, S] -> [N, h, h, hidden]: the tower's tokens, merged r x r, projected."""
        x = self.vision(pixels)
        n, length, d = x.shape
        g, r = round(length**0.5), self.ratio
        grid = x.view(n, g, g, d).permute(0, 3, 1, 2)
        grid = F.pad(grid, (0, -g % r, 0, -g % r))  # zeros right / bottom
        merged = F.unfold(grid, kernel_size=r, stride=r).transpose(1, 2)  # [N, h h, d r r]
        out = self.projector.layers(merged)
        h = -(-g // r)
        return out.view(n, h, h, -1)

    def _rows(self, grid: torch.Tensor) -> torch.Tensor:  # [H, W, D] -> [H (W + 1), D]
        newline = self.image_newline.view(1, 1, -1).expand(grid.shape[0], 1, -1)
        return torch.cat([grid, newline], dim=1).flatten(0, 1)

    def image_rows(self, pixels: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
        """One image's flat pixels and (width tiles, height tiles) -> its rows."""
        wt, ht = (int(s) for s in size)
        views = self.views(pixels.view(1 + wt * ht, 3, self.side, self.side))
        h, d = views.shape[1], views.shape[-1]
        whole = self._rows(views[0])
        tiles = views[1:].view(ht, wt, h, h, d).permute(0, 2, 1, 3, 4)
        local = self._rows(tiles.reshape(ht * h, wt * h, d))
        parts = (whole, local) if self.head else (local, whole)
        return torch.cat([parts[0], self.view_seperator[None], parts[1]])

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        weight = self.image_newline
        out = []
        for m in images:
            assert m.pixel_values is not None and m.image_size is not None
            out.append(
                self.image_rows(m.pixel_values.to(weight.device, weight.dtype), m.image_size)
            )
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `vision.`, `projector.`, `image_newline`, `view_seperator`
        tensors; the tower's unused head (`vision.attn_pool.`, `vision.head.`) skipped."""
        mine = ("vision.", "projector.", "image_newline", "view_seperator")
        unused = ("vision.attn_pool.", "vision.head.", "vision.fc_norm.")
        picked = ((n, t) for n, t in weights if n.startswith(mine) and not n.startswith(unused))
        return load_named_weights(self, picked)
