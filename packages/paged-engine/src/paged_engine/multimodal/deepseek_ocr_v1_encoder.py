"""DeepSeek-OCR (v1)'s DeepEncoder, projector and tile rows (`DeepseekOCRForCausalLM`, the
Hub's remote code deepencoder.py / modeling_deepseekocr.py; vLLM's deepencoder.py and
deepseek_ocr.py), in the release's weight names (`model.` dropped).

    view [3, S, S] -> sam_model: patch_embed (16-pixel conv) + pos_embed (its 64 x 64 grid
        resized bicubic, antialiased, where S / 16 differs) -> blocks (pre-norm; windowed
        14 x 14 with zero padding, global at global_attn_indexes; decomposed relative
        positions added to the scores, their tables resized linearly where the grid differs)
        -> neck (1x1 conv, LayerNorm2d, 3x3 conv, LayerNorm2d) -> net_2, net_3 (stride-2 3x3
        convs) -> [C, S / 64, S / 64]                                   (HF's
        DeepseekOcr2SamVisionEncoder is the same maths)
    -> vision_model (CLIP-L): SAM's grid flattened in place of the patch embedding, CLS
        first, position embeddings (the patch grid's resized bicubic, antialiased, where the
        sides differ), pre_layrnorm, every layer (no post-layernorm) -> CLS dropped
    -> cat(CLIP's, SAM's) per token -> projector.layers (Linear) -> [side, side, hidden]
    rows of a view: each grid row then image_newline
    an image's rows: the crops' grid (tiles side by side, row-major) with its newlines when
        it has crops, the global view's, then view_seperator (vLLM's order)

`ImageInput.pixel_values`: [3 B B (+ n 3 R R)] flat, the global view then the crops;
`image_size` (width tiles, height tiles, B, R) (multimodal/deepseek_ocr_v1.py makes them).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.models.deepseek_ocr_v1_config import SAM_NECK, SAM_PATCH, SAM_WINDOW
from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.vision_transformer import VisionLayer


def _resize_grid(table: torch.Tensor, side: int) -> torch.Tensor:
    """[1, g, g, C] -> [1, side, side, C] (bicubic, antialiased, in float32)."""
    if table.shape[1] == side:
        return table
    x = F.interpolate(
        table.permute(0, 3, 1, 2).float(), (side, side), mode="bicubic", antialias=True
    )
    return x.to(table.dtype).permute(0, 2, 3, 1)


def _rel_table(table: torch.Tensor, size: int) -> torch.Tensor:
    """[size, size, d]: row (i, j) the learned offset i - j, the table resized linearly to
    2 size - 1 rows where it has another length."""
    n = 2 * size - 1
    if table.shape[0] != n:
        x = F.interpolate(table.float().T[None], size=n, mode="linear")
        table = x[0].T.to(table.dtype)
    idx = torch.arange(size, device=table.device)
    return table[idx[:, None] - idx[None, :] + size - 1]


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int, tokens: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.rel_pos_h = nn.Parameter(torch.zeros(2 * tokens - 1, dim // heads))
        self.rel_pos_w = nn.Parameter(torch.zeros(2 * tokens - 1, dim // heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, h, w, C]
        b, h, w, c = x.shape
        q, k, v = self.qkv(x).view(b, h * w, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        grid = q.reshape(b, self.heads, h, w, -1)  # unscaled queries: the bias's
        rel_h = torch.einsum("bnhwc,hkc->bnhwk", grid, _rel_table(self.rel_pos_h, h))
        rel_w = torch.einsum("bnhwc,wkc->bnhwk", grid, _rel_table(self.rel_pos_w, w))
        bias = (rel_h[..., :, None] + rel_w[..., None, :]).reshape(b, self.heads, h * w, h * w)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.proj(out.transpose(1, 2).reshape(b, h, w, c))


class _Mlp(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, 4 * dim)
        self.lin2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(F.gelu(self.lin1(x)))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, window: int, grid: int) -> None:
        super().__init__()
        self.window = window  # 0: global attention over the whole grid
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = _Attention(dim, heads, window or grid)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = _Mlp(dim)

    def _attend(self, x: torch.Tensor) -> torch.Tensor:  # [B, h, w, C]
        n = self.window
        if not n:
            return self.attn(x)
        b, h, w, c = x.shape
        x = F.pad(x, (0, 0, 0, -w % n, 0, -h % n))  # zeros right / bottom, attended too
        hh, ww = x.shape[1] // n, x.shape[2] // n
        win = x.view(b, hh, n, ww, n, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, n, n, c)
        out = self.attn(win).view(b, hh, ww, n, n, c).permute(0, 1, 3, 2, 4, 5)
        return out.reshape(b, hh * n, ww * n, c)[:, :h, :w]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attend(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _Norm2d(nn.LayerNorm):
    """LayerNorm over the channels of [B, C, H, W]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class _Sam(nn.Module):
    """`sam_model`: SAM ViT-B with its neck and the two downsampling convs."""

    def __init__(self, v: Any) -> None:
        super().__init__()
        dim, grid = v.sam_width, v.sam_image_size // SAM_PATCH
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, dim, SAM_PATCH, stride=SAM_PATCH)
        self.pos_embed = nn.Parameter(torch.zeros(1, grid, grid, dim))
        windows = [0 if i in v.sam_global else SAM_WINDOW for i in range(v.sam_layers)]
        self.blocks = nn.ModuleList(_Block(dim, v.sam_heads, n, grid) for n in windows)
        self.neck = nn.Sequential(
            nn.Conv2d(dim, SAM_NECK, 1, bias=False),
            _Norm2d(SAM_NECK, eps=1e-6),
            nn.Conv2d(SAM_NECK, SAM_NECK, 3, padding=1, bias=False),
            _Norm2d(SAM_NECK, eps=1e-6),
        )
        c2, c3 = v.downsample_channels
        self.net_2 = nn.Conv2d(SAM_NECK, c2, 3, stride=2, padding=1, bias=False)
        self.net_3 = nn.Conv2d(c2, c3, 3, stride=2, padding=1, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, 3, S, S] -> [N, C, g, g]
        x = self.patch_embed.proj(pixels).permute(0, 2, 3, 1)
        x = x + _resize_grid(self.pos_embed, x.shape[1])
        for block in self.blocks:
            x = block(x)
        return self.net_3(self.net_2(self.neck(x.permute(0, 3, 1, 2))))


class _ClipEmbeddings(nn.Module):
    def __init__(self, clip: Any) -> None:
        super().__init__()
        d, p = clip.hidden_size, clip.patch_size
        self.side = clip.image_size // p
        self.class_embedding = nn.Parameter(torch.zeros(d))
        self.patch_embedding = nn.Conv2d(3, d, p, stride=p, bias=False)  # loaded, never run
        self.position_embedding = nn.Embedding(self.side**2 + 1, d)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:  # [N, L, D] -> [N, 1 + L, D]
        n, length, d = patches.shape
        side = round(length**0.5)
        pos = self.position_embedding.weight
        grid = _resize_grid(pos[1:].view(1, self.side, self.side, d), side).reshape(-1, d)
        cls = self.class_embedding.expand(n, 1, d)
        return torch.cat([cls, patches], dim=1) + torch.cat([pos[:1], grid])[None]


class _Clip(nn.Module):
    """`vision_model`: CLIP-L's embeddings, pre_layrnorm and layers (`transformer.layers`)."""

    def __init__(self, clip: Any) -> None:
        super().__init__()
        self.embeddings = _ClipEmbeddings(clip)
        self.pre_layrnorm = nn.LayerNorm(clip.hidden_size, eps=clip.layer_norm_eps)
        self.transformer = nn.Module()
        self.transformer.layers = nn.ModuleList(
            VisionLayer(clip) for _ in range(clip.num_hidden_layers)
        )

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(patches))
        for layer in self.transformer.layers:
            x = layer(x)
        return x


class DeepseekOCRImageEncoder(nn.Module):
    """Images -> rows of the text model's input embedding (one row per placeholder)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        v = config.vision_config
        hidden = int(config.text_config.hidden_size)
        self.sam_model = _Sam(v)
        self.vision_model = _Clip(v.clip)
        self.projector = nn.Module()
        self.projector.layers = nn.Linear(int(config.projector_input_dim), hidden)
        self.image_newline = nn.Parameter(torch.zeros(hidden))
        self.view_seperator = nn.Parameter(torch.zeros(hidden))  # (the release's spelling)

    def views(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, 3, S, S] -> [N, g, g, hidden]: DeepEncoder's tokens, projected."""
        sam = self.sam_model(pixels)  # [N, C, g, g]
        patches = sam.flatten(2).transpose(1, 2)
        clip = self.vision_model(patches)[:, 1:]
        out = self.projector.layers(torch.cat([clip, patches], dim=-1))
        g = sam.shape[-1]
        return out.view(out.shape[0], g, g, -1)

    def _rows(self, grid: torch.Tensor) -> torch.Tensor:  # [H, W, D] -> [H (W + 1), D]
        newline = self.image_newline.view(1, 1, -1).expand(grid.shape[0], 1, -1)
        return torch.cat([grid, newline], dim=1).flatten(0, 1)

    def image_rows(self, pixels: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
        """One image's flat pixels and (width tiles, height tiles, B, R) -> its rows."""
        wt, ht, base, crop = (int(s) for s in size)
        whole, crops = pixels.split([3 * base * base, pixels.numel() - 3 * base * base])
        parts = []
        if wt * ht > 1:
            tiles = self.views(crops.view(-1, 3, crop, crop))  # [n, g, g, D] row-major
            g, d = tiles.shape[1], tiles.shape[-1]
            grid = tiles.view(ht, wt, g, g, d).permute(0, 2, 1, 3, 4).reshape(ht * g, wt * g, d)
            parts.append(self._rows(grid))
        parts.append(self._rows(self.views(whole.view(1, 3, base, base))[0]))
        parts.append(self.view_seperator[None])
        return torch.cat(parts)

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        weight = self.projector.layers.weight
        out = []
        for m in images:
            assert m.pixel_values is not None and m.image_size is not None
            out.append(
                self.image_rows(m.pixel_values.to(weight.device, weight.dtype), m.image_size)
            )
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `model.{sam_model, vision_model, projector, image_newline,
        view_seperator}` tensors; CLIP's fused qkv_proj split into q / k / v."""
        mine = ("sam_model.", "vision_model.", "projector.", "image_newline", "view_seperator")

        def convert(name: str, t: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
            if ".self_attn.qkv_proj." not in name:
                return [(name, t)]
            q, k, v = t.chunk(3, dim=0)
            return [
                (name.replace("qkv_proj", p), x)
                for p, x in zip(("q_proj", "k_proj", "v_proj"), (q, k, v))
            ]

        picked = (
            (n.removeprefix("model."), t)
            for n, t in weights
            if n.startswith("model.") and n.removeprefix("model.").startswith(mine)
        )
        return load_named_weights(self, picked, convert=convert)
