"""Chameleon's image tokenizer: the encoder half of its VQ-VAE (HF's ChameleonVQVAE.encode:
`model.vqmodel.*`), pixels -> codebook indices. multimodal/chameleon.py turns the indices into
token-embedding rows.

    pixels [N, 3, S, S]
      -> conv_in (3x3) -> per level i of channel_multiplier: num_res_blocks ResnetBlocks (each
         followed by an AttnBlock where the level's resolution is in attn_resolutions), then a
         stride-2 DownSample (zero pad right / bottom by 1, 3x3 conv) except after the last
      -> mid: ResnetBlock, AttnBlock (attn_type "vanilla", else none), ResnetBlock
      -> GroupNorm, swish, conv_out (3x3) -> quant_conv (1x1): latents [N, embed_dim, s, s]
      -> nearest codebook row by |z|^2 + |e|^2 - 2 z.e (HF's expression, so ties break alike)
      -> indices [N, s * s], row-major, s = S / 2^(levels - 1)

GroupNorms have 32 groups (eps 1e-6); swish is x * sigmoid(x) as HF writes it; the attention
blocks are single-head over the s x s positions with 1x1-conv q / k / v / proj_out. Dropout
and the decoder half (post_quant_conv) are not needed to read images and are not built.
Emu3's VQ-VAE (emu3_vqvae.py) is built from the same ResnetBlock, DownSample, group_norm, swish
and nearest_codes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=32, num_channels=channels, eps=1e-6, affine=True)


def swish(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


class ResnetBlock(nn.Module):
    def __init__(self, channels_in: int, channels_out: int) -> None:
        super().__init__()
        self.norm1 = group_norm(channels_in)
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, padding=1)
        self.norm2 = group_norm(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, padding=1)
        # a 1x1 projection of the input where the widths differ (HF's conv_shortcut=False)
        self.nin_shortcut = (
            nn.Conv2d(channels_in, channels_out, 1) if channels_in != channels_out else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, C_in, h, w] -> [N, C_out, h, w]
        h = self.conv1(swish(self.norm1(x)))
        h = self.conv2(swish(self.norm2(h)))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class AttnBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = group_norm(channels)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(channels, channels, 1) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, C, h, w]
        n, c, hgt, wid = x.shape
        y = self.norm(x)
        q = self.q(y).reshape(n, c, hgt * wid).transpose(1, 2)  # [N, hw, C]
        k = self.k(y).reshape(n, c, hgt * wid)  # [N, C, hw]
        v = self.v(y).reshape(n, c, hgt * wid)
        weights = F.softmax(torch.bmm(q, k) * (int(c) ** -0.5), dim=2)  # [N, hw (q), hw (k)]
        out = torch.bmm(v, weights.transpose(1, 2)).reshape(n, c, hgt, wid)
        return x + self.proj_out(out)


class DownSample(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, C, h, w] -> [N, C, h/2, w/2]
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class _Level(nn.Module):  # one resolution: HF's `down[i]` (block, attn, downsample)
    def __init__(self, blocks: list[nn.Module], attns: list[nn.Module], down: bool) -> None:
        super().__init__()
        self.block = nn.ModuleList(blocks)
        self.attn = nn.ModuleList(attns)
        self.downsample = DownSample(blocks[-1].conv2.out_channels) if down else None


class _Mid(nn.Module):
    def __init__(self, channels: int, attention: bool) -> None:
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels)
        self.attn_1 = AttnBlock(channels) if attention else nn.Identity()
        self.block_2 = ResnetBlock(channels, channels)


class VQEncoder(nn.Module):
    """HF's ChameleonVQVAEEncoder (`vqmodel.encoder.*`)."""

    def __init__(self, vq: Any) -> None:
        super().__init__()
        base, mult = int(vq.base_channels), [int(m) for m in vq.channel_multiplier]
        vanilla = vq.attn_type == "vanilla"
        attn_at = set(vq.attn_resolutions or ()) if vanilla else set()
        self.conv_in = nn.Conv2d(int(vq.in_channels), base, 3, padding=1)
        levels, width, res = [], base, int(vq.resolution)
        for i, m in enumerate(mult):
            blocks, attns = [], []
            for _ in range(int(vq.num_res_blocks)):
                blocks.append(ResnetBlock(width, base * m))
                width = base * m
                if res in attn_at:
                    attns.append(AttnBlock(width))
            last = i == len(mult) - 1
            levels.append(_Level(blocks, attns, down=not last))
            res = res if last else res // 2
        self.down = nn.ModuleList(levels)
        self.mid = _Mid(width, vanilla)
        self.norm_out = group_norm(width)
        latent = int(vq.latent_channels) * (2 if vq.double_latent else 1)
        self.conv_out = nn.Conv2d(width, latent, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, 3, S, S] -> [N, latent, s, s]
        x = self.conv_in(x)
        for level in self.down:
            for i, block in enumerate(level.block):
                x = block(x)
                if len(level.attn):
                    x = level.attn[i](x)
            if level.downsample is not None:
                x = level.downsample(x)
        x = self.mid.block_2(self.mid.attn_1(self.mid.block_1(x)))
        return self.conv_out(swish(self.norm_out(x)))


class _Quantizer(nn.Module):  # HF's `quantize` (its codebook)
    def __init__(self, count: int, dim: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(count, dim)


class ChameleonVQVAE(nn.Module):
    """Pixels -> codebook indices (`vqmodel.encoder`, `quant_conv`, `quantize.embedding`)."""

    def __init__(self, vq: Any) -> None:
        super().__init__()
        self.encoder = VQEncoder(vq)
        self.quant_conv = nn.Conv2d(int(vq.latent_channels), int(vq.embed_dim), 1)
        self.quantize = _Quantizer(int(vq.num_embeddings), int(vq.embed_dim))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, 3, S, S] -> [N, s * s]
        z = self.quant_conv(self.encoder(pixels))  # [N, E, s, s]
        n, e = z.shape[:2]
        flat = z.permute(0, 2, 3, 1).reshape(-1, e)  # [N * s * s, E], row-major positions
        return nearest_codes(flat, self.quantize.embedding.weight).view(n, -1)


def nearest_codes(flat: torch.Tensor, book: torch.Tensor) -> torch.Tensor:
    """[M, E] latents, [K, E] codebook -> [M] index of each latent's nearest code, by
    |z|^2 + |e|^2 - 2 z.e (Chameleon's and Emu3's expression, so ties break as HF's)."""
    dist = flat.pow(2).sum(1, keepdim=True) + book.pow(2).sum(1) - 2 * (flat @ book.t())
    return dist.argmin(1)


def tokens_per_image(vq: Any) -> int:
    """Codes (= placeholders) of one vq.resolution-square image: (S / 2^(levels - 1))^2."""
    side = int(vq.resolution) // 2 ** (len(vq.channel_multiplier) - 1)
    return side * side
